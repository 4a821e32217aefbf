// What `elastrun status` says about a job: TorchX's AppState from Slurm's job state and our own
// records, and what only we know, read from the job directory's event logs (schema v1,
// docs/events.md). Pure functions over canned inputs (tests/jobs/).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace elastrun::jobs {

// TorchX's names (torchx.specs.AppState).
inline constexpr const char* kAppStates[] = {"UNSUBMITTED", "SUBMITTED", "PENDING",   "RUNNING",
                                             "SUCCEEDED",   "FAILED",    "CANCELLED", "UNKNOWN"};

// Slurm's state name (slurm_job_state_string: PENDING, RUNNING, REQUEUED, COMPLETING, TIMEOUT...)
// as TorchX maps it: a requeued or suspended job is PENDING, a timeout or a preemption FAILED.
std::string app_state_of_slurm(const std::string& slurm_state);

// Our records: the agents' outcome.json ("succeeded", "checkpointed", "failed"; "" if none) and
// whether `elastrun cancel` asked for the job's end. `slurm_state` is "" once slurmctld forgot
// the job (MinJobAge): then the state comes from our files alone.
std::string app_state(const std::string& slurm_state, const std::string& outcome, bool cancel_requested);

struct RoundSeen {
  double time = 0;
  long generation = 0;
  int world_size = 0;
  std::vector<std::string> members;
};

struct NodeLost {
  double time = 0;
  std::string node, how;
};

// A node another verdict than loss took out or flagged: a straggler (group rank 0's `straggler`
// event) or a failed health check (the node's own `health_check` event with ok false).
struct NodeFlagged {
  double time = 0;
  std::string node, what;
};

struct CheckpointSeen {
  long step = 0;
  std::string tier;  // "file" or "memory"
  double time = 0;
  double blocked_s = 0, durable_s = 0;
};

struct JobSummary {
  std::vector<RoundSeen> rounds;        // one per generation, in order
  std::vector<NodeLost> lost;           // one per node, first seen
  std::vector<NodeFlagged> stragglers;  // one per node, first named
  std::vector<NodeFlagged> unhealthy;   // one per node: its failed health check
  int restarts = 0;                     // the job-wide restart count of the newest round
  int max_restarts = -1;                // the budget, when an agent decided a failure
  int requeues = 0;                     // successful requeue events
  std::optional<long> step;             // the newest training step (worker `step` events)
  double step_time = 0;                 // when it was written
  std::optional<double> steps_per_s;    // over the newest round's steps
  std::optional<CheckpointSeen> checkpoint;
  double time_lost_s = 0;  // failures: each from its first sign to the next step (or start)
  std::string root_cause;  // the first failure: a lost node or a worker's exit
  double first_time = 0, last_time = 0;
};

// `events`: every line of every events-*.jsonl of the job, any order (sorted here by time).
JobSummary summarise(std::vector<nlohmann::json> events);

}  // namespace elastrun::jobs
