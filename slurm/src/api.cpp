#include "elastrun/slurm/api.hpp"

#include <slurm/slurm.h>
#include <slurm/slurm_errno.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <mutex>

namespace elastrun::slurm {
namespace {

void init_once() {
  static std::once_flag once;
  std::call_once(once, [] { slurm_init(nullptr); });  // $SLURM_CONF or the default; idempotent
}

std::string last_error() { return slurm_strerror(slurm_get_errno()); }

struct HostlistDeleter {
  void operator()(hostlist* h) const { slurm_hostlist_destroy(h); }
};
using HostlistPtr = std::unique_ptr<hostlist, HostlistDeleter>;
struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};
struct NodeInfoDeleter {
  void operator()(node_info_msg_t* m) const { slurm_free_node_info_msg(m); }
};
struct JobInfoDeleter {
  void operator()(job_info_msg_t* m) const { slurm_free_job_info_msg(m); }
};

std::unique_ptr<node_info_msg_t, NodeInfoDeleter> load_node(const std::string& name) {
  if (!config_available()) return nullptr;
  init_once();
  node_info_msg_t* raw = nullptr;
  std::vector<char> writable(name.begin(), name.end());
  writable.push_back('\0');
  if (slurm_load_node_single(&raw, writable.data(), SHOW_ALL) != SLURM_SUCCESS) return nullptr;
  return std::unique_ptr<node_info_msg_t, NodeInfoDeleter>(raw);
}

}  // namespace

// libslurm with no configuration to read (no $SLURM_CONF, no slurm.conf, no configless cache)
// tries DNS SRV records and then calls fatal(), which exits the process with three log lines:
// outside a Slurm cluster there is simply nobody to ask.
bool config_available() {
  static const bool available = [] {
    const char* conf = std::getenv("SLURM_CONF");
    if (conf && *conf) return ::access(conf, R_OK) == 0;
    for (const char* path : {"/etc/slurm/slurm.conf", "/run/slurm/conf/slurm.conf", "/var/run/slurm/conf/slurm.conf"})
      if (::access(path, R_OK) == 0) return true;
    return false;
  }();
  return available;
}

std::optional<std::vector<std::string>> hostlist_expand(const std::string& text) {
  HostlistPtr list(slurm_hostlist_create(text.c_str()));  // parsing needs no configuration
  if (!list) return std::nullopt;
  std::vector<std::string> hosts;
  hosts.reserve(static_cast<std::size_t>(slurm_hostlist_count(list.get())));
  while (std::unique_ptr<char, FreeDeleter> host{slurm_hostlist_shift(list.get())}) hosts.emplace_back(host.get());
  return hosts;
}

std::string hostlist_compress(const std::vector<std::string>& hosts) {
  HostlistPtr list(slurm_hostlist_create(nullptr));
  if (!list) return {};
  for (const auto& h : hosts) slurm_hostlist_push_host(list.get(), h.c_str());
  std::unique_ptr<char, FreeDeleter> text{slurm_hostlist_ranged_string_malloc(list.get())};
  return text ? std::string(text.get()) : std::string();
}

std::optional<std::string> node_addr(const std::string& node_name) {
  auto info = load_node(node_name);
  if (!info || info->record_count < 1 || !info->node_array[0].node_addr) return std::nullopt;
  return std::string(info->node_array[0].node_addr);
}

std::optional<bool> node_is_down(const std::string& node_name) {
  auto info = load_node(node_name);
  if (!info || info->record_count < 1) return std::nullopt;
  const auto state = info->node_array[0].node_state;
  return (state & NODE_STATE_BASE) == NODE_STATE_DOWN || (state & NODE_STATE_NO_RESPOND) || (state & NODE_STATE_FAIL);
}

std::optional<std::uint32_t> numeric_job_id(std::string_view job_id) {
  const std::string text(job_id);
  char* end = nullptr;
  const unsigned long id = std::strtoul(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || text[0] == '-' || id == 0 || id > 0xfffffff0UL) return std::nullopt;
  return static_cast<std::uint32_t>(id);
}

std::optional<JobView> load_job(std::uint32_t job_id) {
  if (!config_available()) return std::nullopt;
  init_once();
  job_info_msg_t* raw = nullptr;
  if (slurm_load_job(&raw, job_id, SHOW_ALL) != SLURM_SUCCESS || !raw) return std::nullopt;
  std::unique_ptr<job_info_msg_t, JobInfoDeleter> info(raw);
  if (info->record_count < 1) return std::nullopt;
  const auto& job = info->job_array[0];
  JobView view;
  const auto base = job.job_state & JOB_STATE_BASE;
  view.cancelled = base == JOB_CANCELLED;
  view.timed_out = base == JOB_TIMEOUT;
  view.preempted = base == JOB_PREEMPTED || job.preempt_time != 0;
  view.restart_count = job.restart_cnt;
  if (job.batch_flag && job.batch_host && *job.batch_host) view.batch_host = job.batch_host;
  if (job.nodes) view.nodes = job.nodes;
  return view;
}

std::string requeue_job(std::uint32_t job_id) {
  if (!config_available()) return "no Slurm configuration to reach slurmctld";
  init_once();
  return slurm_requeue(job_id, 0) == SLURM_SUCCESS ? std::string() : last_error();
}

std::string complete_job(std::uint32_t job_id, int exit_code) {
  if (!config_available()) return "no Slurm configuration to reach slurmctld";
  init_once();
  // a wait()-style status, as salloc passes its command's
  return slurm_complete_job(job_id, static_cast<std::uint32_t>(exit_code & 0xff) << 8) == SLURM_SUCCESS ? std::string()
                                                                                                        : last_error();
}

std::string exclude_nodes(std::uint32_t job_id, const std::string& hostlist) {
  if (!config_available()) return "no Slurm configuration to reach slurmctld";
  init_once();
  std::string list = hostlist;
  job_desc_msg_t desc;
  slurm_init_job_desc_msg(&desc);
  desc.job_id = job_id;
  desc.exc_nodes = list.data();
  return slurm_update_job(&desc) == SLURM_SUCCESS ? std::string() : last_error();
}

std::optional<std::chrono::seconds> slurmd_timeout() {
  if (!config_available()) return std::nullopt;
  init_once();
  slurm_conf_t* conf = nullptr;
  if (slurm_load_ctl_conf(0, &conf) != SLURM_SUCCESS || !conf) return std::nullopt;
  const std::chrono::seconds timeout(conf->slurmd_timeout);
  slurm_free_ctl_conf(conf);
  return timeout;
}

}  // namespace elastrun::slurm
