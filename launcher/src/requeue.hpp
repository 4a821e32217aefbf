// Bringing a stopped job back: the Slurm side (libslurm: the job's state, slurm_requeue,
// excluding failed nodes) and the per-class requeue budget that survives requeues.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "elastrun/rdzv/env.hpp"
#include "options.hpp"

namespace elastrun::launcher {

// What slurmctld says about the job right now (nullopt from load_slurm_job: not reachable).
struct SlurmJobView {
  bool cancelled = false;  // scancel: a SIGTERM then is not a preemption
  bool preempted = false;  // preempt_time set: the SIGTERM is preemption's
  bool timed_out = false;  // state TIMEOUT: the time limit was reached
  int restart_count = 0;   // restart_cnt
  // A batch job whose batch host has left the job (a --no-kill job keeps running on its other
  // nodes when the node running the batch script dies: nothing is left to end the job).
  bool batch_host_left = false;
  std::string batch_host;
};
std::optional<SlurmJobView> load_slurm_job(const std::string& job_id);

// The outcome of a call that may fail without being fatal to the agent.
struct CallResult {
  bool ok = true;
  std::string error;  // what went wrong (libslurm's text, a path), when !ok
  static CallResult failed(std::string why) { return {false, std::move(why)}; }
};

// slurm_requeue(job, 0).
CallResult requeue_slurm_job(const std::string& job_id);

// slurm_complete_job(job, exit_code << 8): ends the job now with that exit code (COMPLETED for 0,
// FAILED otherwise) and its remaining steps with it, as the end of the batch script would.
CallResult complete_slurm_job(const std::string& job_id, int exit_code);

// slurm.conf's SlurmdTimeout as slurmctld has it (how long a silent node takes to be declared
// DOWN), std::nullopt when slurmctld cannot be asked.
std::optional<std::chrono::seconds> slurmd_timeout();

// ExcNodes=<nodes> on the (requeued, pending) job. Retries for a few seconds: slurmctld accepts
// it only once the requeued job is pending.
CallResult exclude_nodes_from_job(const std::string& job_id, const std::vector<std::string>& nodes);

// Requeues used per FailureClass over the job's life. With a checkpoint directory the counts
// live in <dir>/elastrun-requeue.json (written by the requeueing agent, keyed by job id);
// without one every class is charged SLURM_RESTART_COUNT (all requeues so far), conservatively.
class RequeueLedger {
 public:
  RequeueLedger(std::string checkpoint_dir, std::string job_id, int slurm_restart_count);
  std::int64_t used(FailureClass c) const;
  // Adds one requeue of class `c` and saves the ledger.
  CallResult charge(FailureClass c);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string job_id_;
  int restart_count_ = 0;
  std::int64_t used_[kFailureClasses] = {};
};

// ---- the requeue policy ---------------------------------------------------------------------
// Whether a stop of class `cls` brings the job back, as a pure function of what slurmctld says
// (`job`: consulted only for a SIGTERM, which also comes from scancel and from reaching the time
// limit) and of the ledger's counts.
struct RequeueDecision {
  enum class Verdict {
    Requeue,       // within the class budget
    NotSlurm,      // not running under Slurm: the exit code tells the caller
    Cancelled,     // SIGTERM of scancel
    NotPreempted,  // SIGTERM, but neither preemption nor the time limit (kill, scancel --signal)
    BudgetUsedUp,  // the class's requeues are used up
  };
  Verdict verdict = Verdict::Requeue;
  FailureClass cls = FailureClass::App;  // the class charged (SIGTERM at the time limit: timelimit)
  bool slurmctld_unreachable = false;    // a SIGTERM was taken for preemption for want of an answer
  std::int64_t used = 0;                 // requeues of `cls` before this one
  std::int64_t budget = 0;               // kUnlimited or a count
};
RequeueDecision decide_requeue(FailureClass cls, int signal, bool under_slurm, const std::optional<SlurmJobView>& job,
                               const RequeueLedger& ledger, const std::array<std::int64_t, kFailureClasses>& budgets);

// Brings the job back through Slurm, for group rank 0 (or the survivor that claimed it): decides,
// charges the ledger, calls slurm_requeue and excludes `exclude` (best effort), logging each
// step. `signal`: the stop signal behind the request (SIGTERM is checked with slurmctld), or 0.
// `slurm`: the job, null when not under Slurm. False when the job will not come back.
bool requeue_job(const rdzv::SlurmEnv* slurm, const AgentOptions& options, FailureClass cls,
                 const std::vector<std::string>& exclude, int signal);

}  // namespace elastrun::launcher
