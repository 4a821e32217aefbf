// elastrun::slurm — the one adapter around libslurm (slurmctld RPCs and libslurm's hostlist
// parser) for the agent and the rendezvous. Every libslurm call of theirs is in slurm/src/api.cpp,
// behind one initialisation that first checks a configuration exists (libslurm with none calls
// fatal(), which exits the process). The SPANK plugin cannot link libslurm (it runs inside
// slurmd/srun, which export the symbols): it looks its few calls up at run time
// (spank_plugin/src/slurm_api.cpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace elastrun::slurm {

// Whether slurmctld can be asked at all: $SLURM_CONF or a slurm.conf (or configless cache) exists.
bool config_available();

// ---- hostlists (libslurm's parser, unvalidated: rdzv::expand_hostlist checks the text first) ----
std::optional<std::vector<std::string>> hostlist_expand(const std::string& text);
std::string hostlist_compress(const std::vector<std::string>& hosts);

// ---- nodes ----
// Slurm's NodeAddr for a node, nullopt if slurmctld does not answer or does not know it.
std::optional<std::string> node_addr(const std::string& node_name);
// "down" (DOWN, NOT_RESPONDING, FAIL...) or up; nullopt when slurmctld cannot be asked.
std::optional<bool> node_is_down(const std::string& node_name);

// ---- jobs ----
// A numeric Slurm job id, nullopt for anything else ("12_3" array ids, "12+1" het offsets, junk).
std::optional<std::uint32_t> numeric_job_id(std::string_view job_id);

struct JobView {
  bool cancelled = false, timed_out = false, preempted = false;
  std::uint32_t restart_count = 0;
  std::string batch_host;  // "" unless a batch job with a known host
  std::string nodes;       // the job's current node list (hostlist expression)
};
std::optional<JobView> load_job(std::uint32_t job_id);

// What `elastrun status/list` show of a job (slurm_load_job: no accounting needed).
struct JobRecord {
  std::uint32_t job_id = 0;
  std::string state;  // Slurm's name: PENDING, RUNNING, REQUEUED, COMPLETING, COMPLETED, TIMEOUT...
  std::string name, work_dir, command, nodes, user;
  std::uint32_t num_nodes = 0, restart_count = 0;
  long submit_time = 0, start_time = 0, end_time = 0;
  int exit_code = 0;  // the batch script's, when it ended
};
struct JobQuery {
  std::optional<JobRecord> job;  // nullopt: slurmctld does not know the job (or did not answer)
  std::string error;             // "" when slurmctld answered (job or no job)
};
JobQuery query_job(std::uint32_t job_id);
// Every job slurmctld knows (all users), or the error.
std::string query_jobs(std::vector<JobRecord>& jobs);
// The cluster's ClusterName; "" when slurmctld cannot be asked.
std::string cluster_name();

// Calls that change the job: "" on success, else libslurm's error text.
std::string requeue_job(std::uint32_t job_id);
std::string complete_job(std::uint32_t job_id, int exit_code);  // as if its batch script exited so
std::string exclude_nodes(std::uint32_t job_id, const std::string& hostlist);
std::string signal_job_steps(std::uint32_t job_id, int signal);  // every step, not the batch script
std::string cancel_job(std::uint32_t job_id);                    // as `scancel JOB`

// SlurmdTimeout of the cluster's configuration.
std::optional<std::chrono::seconds> slurmd_timeout();

}  // namespace elastrun::slurm
