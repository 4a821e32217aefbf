// Bringing a stopped job back: the Slurm side (libslurm: the job's state, slurm_requeue,
// excluding failed nodes) and the per-class requeue budget that survives requeues.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "options.hpp"

namespace elastrun::launcher {

// What slurmctld says about the job right now (nullopt from load_slurm_job: not reachable).
struct SlurmJobView {
  bool cancelled = false;   // scancel: a SIGTERM then is not a preemption
  bool preempted = false;   // preempt_time set: the SIGTERM is preemption's
  bool timed_out = false;   // state TIMEOUT: the time limit was reached
  int restart_count = 0;    // restart_cnt
};
std::optional<SlurmJobView> load_slurm_job(const std::string& job_id);

// slurm_requeue(job, 0); "" on success, else libslurm's error text.
std::string requeue_slurm_job(const std::string& job_id);

// ExcNodes=<nodes> on the (requeued, pending) job; "" on success, else the error text.
// Retries for a few seconds: slurmctld accepts it only once the requeued job is pending.
std::string exclude_nodes_from_job(const std::string& job_id, const std::vector<std::string>& nodes);

// Requeues used per FailureClass over the job's life. With a checkpoint directory the counts
// live in <dir>/elastrun-requeue.json (written by the requeueing agent, keyed by job id);
// without one every class is charged SLURM_RESTART_COUNT (all requeues so far), conservatively.
class RequeueLedger {
 public:
  RequeueLedger(std::string checkpoint_dir, std::string job_id, int slurm_restart_count);
  std::int64_t used(FailureClass c) const;
  // Adds one requeue of class `c` and saves the ledger; "" or the error text (not fatal).
  std::string charge(FailureClass c);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string job_id_;
  int restart_count_ = 0;
  std::int64_t used_[kFailureClasses] = {};
};

}  // namespace elastrun::launcher
