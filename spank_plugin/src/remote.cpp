// slurmstepd (remote context). user_init runs once per node and step, in slurmstepd, before the
// tasks are forked: it finds the step's first node from the step environment and resolves an
// address every node can reach (MASTER_ADDR). task_init runs in each forked task just before
// exec: it derives the task's ranks from its SLURM_* variables (elastrun_env's
// detect_environment, which knows heterogeneous steps) and sets the torch variables.
//
// --elastic: task_init turns the node's one task into the elastrun agent. The task is the forked
// child of slurmstepd that will execve(argv[0], argv, env) of exactly the array S_JOB_ARGV
// returns (without --multi-prog, slurmstepd sets each task->argv = job->argv when it builds the
// step record; exec_task then runs TaskProlog, sets TMPDIR and the user's limits). So
// argv[0] (already the program's full path) is replaced by the agent's path in this child only,
// the program's path and the agent's flags go into the task environment (spank_setenv), and the
// agent rebuilds `elastrun FLAGS PROGRAM ARGS` (launcher/src/spank_commands.cpp). Nothing of
// Slurm's own task setup is skipped. The agent's state (--log-dir: error files) goes into a
// per-step, per-node directory under the site argument tmpdir, removed in slurm_spank_exit
// here and, should slurmstepd itself be killed, by the job epilog (slurmd.cpp).
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
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "collective_env.hpp"
#include "common.hpp"
#include "elastic.hpp"
#include "slurm_api.hpp"
#include "torch_env.hpp"

namespace elastrun::spank::remote {
namespace {

bool normal_step(spank_t sp) {
  uint32_t step = 0;
  spank_err_t rc = spank_get_item(sp, S_JOB_STEPID, &step);
  if (rc != ESPANK_SUCCESS) throw std::runtime_error("spank_get_item(S_JOB_STEPID): " + spank_error_text(rc));
  return step <= SLURM_MAX_NORMAL_STEP_ID;
}

rdzv::EnvMap job_environment(spank_t sp) {
  char** env = nullptr;
  spank_err_t rc = spank_get_item(sp, S_JOB_ENV, &env);
  if (rc != ESPANK_SUCCESS || !env) throw std::runtime_error("spank_get_item(S_JOB_ENV): " + spank_error_text(rc));
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
  if (auto addr = slurm_api::conf_node_addr(node);
      addr && !addr->empty() && (mode == MasterAddrMode::NodeAddr || *addr != node))
    return *addr;
  std::string addr = slurm_api::ctld_node_addr(node);
  if (mode == MasterAddrMode::Auto && addr == node)
    throw std::runtime_error(
        fmt::format("the step's first node '{}' does not resolve (getaddrinfo) and its NodeAddr is the same "
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

std::string env_value(const rdzv::EnvMap& env, const std::string& name) {
  auto it = env.find(name);
  return it == env.end() ? std::string() : it->second;
}

template <typename T>
T get_item(spank_t sp, spank_item_t item, const char* name) {
  T value{};
  const spank_err_t rc = spank_get_item(sp, item, &value);
  if (rc != ESPANK_SUCCESS) throw std::runtime_error(fmt::format("spank_get_item({}): {}", name, spank_error_text(rc)));
  return value;
}

// The per-step, per-node directory for the agent's files, created as the user (task_init runs
// as the user). An existing one must be ours and a real directory (tmpdir may be shared).
std::string make_step_dir(const std::string& base, uint32_t job, uint32_t step, const std::string& node) {
  const std::string path = base + "/" + step_dir_name(job, step, node);
  if (::mkdir(path.c_str(), 0700) != 0) {
    if (errno != EEXIST)
      throw std::runtime_error(fmt::format("cannot create {}: {} (site argument tmpdir)", path, std::strerror(errno)));
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid())
      throw std::runtime_error(fmt::format("{} exists and is not a directory of uid {}", path, ::getuid()));
  }
  return path;
}

void elastic_task_init(spank_t sp) {
  const auto& s = state();
  const auto local_tasks = get_item<uint32_t>(sp, S_JOB_LOCAL_TASK_COUNT, "S_JOB_LOCAL_TASK_COUNT");
  if (local_tasks != 1)
    throw std::runtime_error(
        fmt::format("one elastrun agent runs per node, but this node has {} tasks of the step; use "
                    "srun --ntasks-per-node=1 (workers per node: --elastic-nproc=N)",
                    local_tasks));
  const uint32_t job = get_item<uint32_t>(sp, S_JOB_ID, "S_JOB_ID");
  const uint32_t step = get_item<uint32_t>(sp, S_JOB_STEPID, "S_JOB_STEPID");
  const auto env = job_environment(sp);
  if (!env_value(env, "SLURM_HET_SIZE").empty() || !env_value(env, "SLURM_PACK_SIZE").empty())
    throw std::runtime_error("--elastic does not support heterogeneous steps; use one component");
  AgentPlan plan;
  plan.range = s.elastic_range;
  plan.nproc = s.elastic_nproc;
  plan.run_id = env_value(env, kRunIdEnv);
  const std::string port = env_value(env, kStorePortEnv);
  plan.store_host = env_value(env, kStoreHostEnv);
  if (plan.store_host.empty()) plan.store_host = env_value(env, "SLURM_LAUNCH_NODE_IPADDR");
  const std::string token = env_value(env, kStepTokenEnv);
  if (port.empty() || plan.run_id.empty() || token.empty())
    throw std::runtime_error(
        fmt::format("the task environment lacks {}, {} or {}, which srun's plugin sets (is the plugin "
                    "loaded by srun, i.e. listed in the submit host's plugstack.conf?)",
                    kStorePortEnv, kRunIdEnv, kStepTokenEnv));
  if (plan.store_host.empty())
    throw std::runtime_error("no SLURM_LAUNCH_NODE_IPADDR in the task environment: where is srun?");
  const long p = std::strtol(port.c_str(), nullptr, 10);
  if (p <= 0 || p > 65535 || !safe_token(plan.run_id) || !safe_token(plan.store_host))
    throw std::runtime_error(fmt::format("bad {}='{}', {}='{}' or store host '{}'", kStorePortEnv, port, kRunIdEnv,
                                         plan.run_id, plan.store_host));
  plan.store_port = static_cast<std::uint16_t>(p);
  // The step's node index names the directory: slurmstepd knows it at step end too (it does
  // not know SLURMD_NODENAME, which is set in each task only).
  const std::string node = std::to_string(get_item<uint32_t>(sp, S_JOB_NODEID, "S_JOB_NODEID"));
  plan.log_dir = make_step_dir(s.site.tmpdir, job, step, node);

  int argc = 0;
  char** argv = nullptr;
  const spank_err_t rc = spank_get_item(sp, S_JOB_ARGV, &argc, &argv);
  if (rc != ESPANK_SUCCESS || argc < 1 || !argv || !argv[0])
    throw std::runtime_error("spank_get_item(S_JOB_ARGV): " + spank_error_text(rc));
  // Lives until execve: this process is the task, it never returns to slurmstepd's loop.
  static std::string agent;
  const char* agent_env = env.contains(kAgentEnv) ? env.at(kAgentEnv).c_str() : nullptr;
  agent = agent_path(agent_env);
  if (::access(agent.c_str(), X_OK) != 0)
    throw std::runtime_error(
        fmt::format("the elastrun agent '{}' is not executable here ({}); install it or set the site "
                    "argument agent= (or {})",
                    agent, std::strerror(errno), kAgentEnv));
  const std::vector<std::pair<const char*, std::string>> vars = {
      {kProgramEnv, argv[0]}, {kAgentArgsEnv, join_lines(agent_flags(plan))}, {kTokenEnv, token}};
  for (const auto& [name, value] : vars) {
    const spank_err_t set = spank_setenv(sp, name, value.c_str(), 1);
    if (set != ESPANK_SUCCESS)
      throw std::runtime_error(fmt::format("cannot set {} in the task environment: {}", name, spank_error_text(set)));
  }
  const spank_err_t unset = spank_unsetenv(sp, kStepTokenEnv);  // one copy of the secret is enough
  if (unset != ESPANK_SUCCESS)
    throw std::runtime_error(
        fmt::format("cannot unset {} in the task environment: {}", kStepTokenEnv, spank_error_text(unset)));
  log_debug("task of step {}.{} (node index {}) becomes the agent {} (program {})", job, step, node, agent, argv[0]);
  argv[0] = agent.data();
}

}  // namespace

int user_init(spank_t sp) {
  auto& s = state();
  if (s.elastic || !s.torch_env || !normal_step(sp)) return 0;
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
  if (s.elastic) {
    try {
      if (!normal_step(sp)) return 0;
      elastic_task_init(sp);
    } catch (const std::exception& e) {
      fail_task(fmt::format("--elastic: {}", e.what()));
    }
    return 0;
  }
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
      throw std::runtime_error(
          fmt::format("the task's first step node '{}' differs from the step's '{}'; the step environment "
                      "is inconsistent",
                      master_node(task), s.master_node));
    }
    vars = torch_environment(task, s.master_addr, s.site.run_id);
    // as the agent's workers: the device to use and the collective libraries' defaults, with the
    // interface of this node's address (as MASTER_ADDR is found for the first node) when it has several
    const auto task_env = job_environment(sp);
    std::string ifname;
    try {
      const auto node = env_value(task_env, "SLURMD_NODENAME");
      if (!node.empty()) {
        const auto choice = launcher::choose_socket_interface(
            launcher::first_ipv4_of(resolve_master(node, s.site.master_addr)), launcher::network_interfaces());
        ifname = choice.ifname;
        if (choice.warning) log_info("{}", choice.note);
      }
    } catch (const std::exception& e) {
      log_debug("no socket interface chosen for the collective libraries: {}", e.what());
    }
    for (auto& kv : task_device_environment(task_env, task.placement.local_rank, ifname)) vars.push_back(std::move(kv));
  } catch (const std::exception& e) {
    fail_task(fmt::format("--torch-env: {}", e.what()));
  }
  for (const auto& [name, value] : vars) {
    spank_err_t rc = spank_setenv(sp, name.c_str(), value.c_str(), 1);
    if (rc != ESPANK_SUCCESS)
      fail_task(fmt::format("--torch-env: cannot set {} in the task environment: {}", name, spank_error_text(rc)));
  }
  return 0;
}

int exit(spank_t sp) {
  if (!state().elastic || !normal_step(sp)) return 0;
  const auto job = get_item<uint32_t>(sp, S_JOB_ID, "S_JOB_ID");
  const auto step = get_item<uint32_t>(sp, S_JOB_STEPID, "S_JOB_STEPID");
  const auto uid = get_item<uid_t>(sp, S_JOB_UID, "S_JOB_UID");
  const auto gid = get_item<gid_t>(sp, S_JOB_GID, "S_JOB_GID");
  const auto node = std::to_string(get_item<uint32_t>(sp, S_JOB_NODEID, "S_JOB_NODEID"));
  remove_user_tree(state().site.tmpdir + "/" + step_dir_name(job, step, node), uid, gid);
  return 0;
}

}  // namespace elastrun::spank::remote
