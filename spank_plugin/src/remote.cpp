// slurmstepd (remote context). user_init runs once per node and step, in slurmstepd, before the
// tasks are forked: it finds the step's first node from the step environment and resolves an
// address every node can reach (MASTER_ADDR). task_init runs in each forked task just before
// exec: it derives the task's ranks from its SLURM_* variables (elastrun_env's
// detect_environment, which knows heterogeneous steps) and sets the torch variables.
//
// Batch, extern and interactive steps are never touched: a batch script is one process, and
// RANK/WORLD_SIZE exported there would leak into every srun of the script.
//
// Failure policy: a task that cannot get a correct environment must not start (a torch program
// with a missing or wrong MASTER_ADDR hangs in init_process_group). Slurm ignores errors of an
// `optional` plugin, so task_init prints one line on the task's stderr, logs it, and ends the
// task with exit code 1 itself.
extern "C" {
#include <slurm/slurm.h>
}

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <stdexcept>

#include "common.hpp"
#include "slurm_api.hpp"
#include "torch_env.hpp"

namespace elastrun::spank::remote {
namespace {

bool normal_step(spank_t sp) {
  uint32_t step = 0;
  spank_err_t rc = spank_get_item(sp, S_JOB_STEPID, &step);
  if (rc != ESPANK_SUCCESS)
    throw std::runtime_error("spank_get_item(S_JOB_STEPID): " + spank_error_text(rc));
  return step <= SLURM_MAX_NORMAL_STEP_ID;
}

rdzv::EnvMap job_environment(spank_t sp) {
  char** env = nullptr;
  spank_err_t rc = spank_get_item(sp, S_JOB_ENV, &env);
  if (rc != ESPANK_SUCCESS || !env)
    throw std::runtime_error("spank_get_item(S_JOB_ENV): " + spank_error_text(rc));
  rdzv::EnvMap map;
  for (char** e = env; *e; ++e) {
    std::string_view entry(*e);
    const auto eq = entry.find('=');
    if (eq == std::string_view::npos) continue;
    map.emplace(std::string(entry.substr(0, eq)), std::string(entry.substr(eq + 1)));
  }
  return map;
}

bool resolves(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &result);
  if (result) freeaddrinfo(result);
  return rc == 0;
}

// MASTER_ADDR for `node` (see docs/spank.md, site argument master_addr).
std::string resolve_master(const std::string& node, MasterAddrMode mode) {
  if (mode == MasterAddrMode::Hostname) return node;
  if (mode == MasterAddrMode::Auto && resolves(node)) return node;
  // NodeAddr: slurm.conf's node table first (no RPC), then slurmctld (dynamic/cloud nodes).
  if (auto addr = slurm_api::conf_node_addr(node); addr && !addr->empty() &&
      (mode == MasterAddrMode::NodeAddr || *addr != node))
    return *addr;
  std::string addr = slurm_api::ctld_node_addr(node);
  if (mode == MasterAddrMode::Auto && addr == node)
    throw std::runtime_error(fmt::format(
        "the step's first node '{}' does not resolve (getaddrinfo) and its NodeAddr is the same "
        "name; add it to DNS or /etc/hosts, or set NodeAddr in slurm.conf",
        node));
  return addr;
}

[[noreturn]] void fail_task(const std::string& message, bool logged = false) {
  if (!logged) {
    try {
      log_error("{}", message);
    } catch (...) {
    }
  }
  std::fprintf(stderr, "elastrun: error: %s\n", message.c_str());
  std::fflush(stderr);
  _exit(1);
}

}  // namespace

int user_init(spank_t sp) {
  auto& s = state();
  if (!s.torch_env || !normal_step(sp)) return 0;
  try {
    const auto step = detect_step(job_environment(sp), slurm_api::hostlist_expander());
    s.master_node = master_node(step);
    s.master_addr = resolve_master(s.master_node, s.site.master_addr);
    log_debug("MASTER_ADDR={} (first node {}, master_addr={})", s.master_addr, s.master_node,
              to_string(s.site.master_addr));
  } catch (const std::exception& e) {
    s.master_error = fmt::format("--torch-env: {}", e.what());
    log_error("{}", s.master_error);
    return -1;
  }
  return 0;
}

int task_init(spank_t sp) {
  auto& s = state();
  try {
    if (!s.torch_env || !normal_step(sp)) return 0;
  } catch (const std::exception& e) {
    fail_task(fmt::format("--torch-env: {}", e.what()));
  }
  if (!s.master_error.empty()) fail_task(s.master_error, /*logged=*/true);
  EnvVars vars;
  try {
    const auto task = detect_step(job_environment(sp), slurm_api::hostlist_expander());
    if (s.master_addr.empty()) {  // user_init did not run for this step: resolve here
      s.master_node = master_node(task);
      s.master_addr = resolve_master(s.master_node, s.site.master_addr);
    } else if (master_node(task) != s.master_node) {
      throw std::runtime_error(fmt::format(
          "the task's first step node '{}' differs from the step's '{}'; the step environment "
          "is inconsistent",
          master_node(task), s.master_node));
    }
    vars = torch_environment(task, s.master_addr, s.site.run_id);
  } catch (const std::exception& e) {
    fail_task(fmt::format("--torch-env: {}", e.what()));
  }
  for (const auto& [name, value] : vars) {
    spank_err_t rc = spank_setenv(sp, name.c_str(), value.c_str(), 1);
    if (rc != ESPANK_SUCCESS)
      fail_task(fmt::format("--torch-env: cannot set {} in the task environment: {}", name,
                            spank_error_text(rc)));
  }
  return 0;
}

}  // namespace elastrun::spank::remote
