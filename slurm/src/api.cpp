#include "elastrun/slurm/api.hpp"

#include <slurm/slurm.h>
#include <slurm/slurm_errno.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

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

namespace {

// squeue's names for a job state (libslurm's own table is not in its public headers): the flags
// that squeue shows instead of the base state first, then the base state.
std::string state_name(std::uint32_t state) {
  struct Flag {
    std::uint32_t bit;
    const char* name;
  };
  for (const Flag& f :
       {Flag{JOB_REQUEUE_FED, "REQUEUE_FED"}, Flag{JOB_REQUEUE_HOLD, "REQUEUE_HOLD"},
        Flag{JOB_SPECIAL_EXIT, "SPECIAL_EXIT"}, Flag{JOB_REQUEUE, "REQUEUED"}, Flag{JOB_RESIZING, "RESIZING"},
        Flag{JOB_CONFIGURING, "CONFIGURING"}, Flag{JOB_COMPLETING, "COMPLETING"}, Flag{JOB_STAGE_OUT, "STAGE_OUT"},
        Flag{JOB_SIGNALING, "SIGNALING"}})
    if (state & f.bit) return f.name;
  switch (state & JOB_STATE_BASE) {
    case JOB_PENDING: return "PENDING";
    case JOB_RUNNING: return "RUNNING";
    case JOB_SUSPENDED: return "SUSPENDED";
    case JOB_COMPLETE: return "COMPLETED";
    case JOB_CANCELLED: return "CANCELLED";
    case JOB_FAILED: return "FAILED";
    case JOB_TIMEOUT: return "TIMEOUT";
    case JOB_NODE_FAIL: return "NODE_FAIL";
    case JOB_PREEMPTED: return "PREEMPTED";
    case JOB_BOOT_FAIL: return "BOOT_FAIL";
    case JOB_DEADLINE: return "DEADLINE";
    case JOB_OOM: return "OUT_OF_MEMORY";
    default: return "UNKNOWN";
  }
}

JobRecord record_of(const slurm_job_info_t& job) {
  JobRecord r;
  r.job_id = job.job_id;
  r.state = state_name(job.job_state);
  const auto text = [](const char* p) { return p ? std::string(p) : std::string(); };
  r.name = text(job.name);
  r.work_dir = text(job.work_dir);
  r.command = text(job.command);
  r.nodes = text(job.nodes);
  r.user = text(job.user_name);
  r.num_nodes = job.num_nodes;
  r.restart_count = job.restart_cnt;
  r.submit_time = static_cast<long>(job.submit_time);
  r.start_time = static_cast<long>(job.start_time);
  r.end_time = static_cast<long>(job.end_time);
  r.exit_code = WIFEXITED(job.exit_code) ? WEXITSTATUS(job.exit_code) : 128 + WTERMSIG(job.exit_code);
  return r;
}

}  // namespace

JobQuery query_job(std::uint32_t job_id) {
  JobQuery q;
  if (!config_available()) {
    q.error = "no Slurm configuration to reach slurmctld (set SLURM_CONF)";
    return q;
  }
  init_once();
  job_info_msg_t* raw = nullptr;
  if (slurm_load_job(&raw, job_id, SHOW_ALL) != SLURM_SUCCESS || !raw) {
    if (slurm_get_errno() != ESLURM_INVALID_JOB_ID) q.error = last_error();
    return q;
  }
  std::unique_ptr<job_info_msg_t, JobInfoDeleter> info(raw);
  for (std::uint32_t i = 0; i < info->record_count; ++i)
    if (info->job_array[i].job_id == job_id) q.job = record_of(info->job_array[i]);
  return q;
}

std::string query_jobs(std::vector<JobRecord>& jobs) {
  if (!config_available()) return "no Slurm configuration to reach slurmctld (set SLURM_CONF)";
  init_once();
  job_info_msg_t* raw = nullptr;
  if (slurm_load_jobs(0, &raw, SHOW_ALL) != SLURM_SUCCESS || !raw) return last_error();
  std::unique_ptr<job_info_msg_t, JobInfoDeleter> info(raw);
  for (std::uint32_t i = 0; i < info->record_count; ++i) jobs.push_back(record_of(info->job_array[i]));
  return {};
}

std::string cluster_name() {
  if (!config_available()) return {};
  init_once();
  slurm_conf_t* conf = nullptr;
  if (slurm_load_ctl_conf(0, &conf) != SLURM_SUCCESS || !conf) return {};
  std::string name = conf->cluster_name ? conf->cluster_name : "";
  slurm_free_ctl_conf(conf);
  return name;
}

std::string signal_job_steps(std::uint32_t job_id, int signal) {
  if (!config_available()) return "no Slurm configuration to reach slurmctld";
  init_once();
  return slurm_kill_job(job_id, static_cast<uint16_t>(signal), KILL_STEPS_ONLY) == SLURM_SUCCESS ? std::string()
                                                                                                 : last_error();
}

std::string cancel_job(std::uint32_t job_id) {
  if (!config_available()) return "no Slurm configuration to reach slurmctld";
  init_once();
  return slurm_kill_job(job_id, SIGKILL, 0) == SLURM_SUCCESS ? std::string() : last_error();
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
