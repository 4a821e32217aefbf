// Worker failures: one record per failed worker (with its @record error file), published to the
// rendezvous store so that group rank 0 can print one job-wide summary naming the root cause
// (the first failure in time) and every other failure.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "error_file.hpp"
#include "workers.hpp"

namespace elastrun::rdzv {
class Rendezvous;
}

namespace elastrun::launcher {

struct Failure {
  std::chrono::system_clock::time_point when;
  std::string node;
  int rank = 0;
  int local_rank = 0;
  int exit_code = 0;
  int signal = 0;
  int restart_count = 0;
  std::string error_file;
  std::optional<ErrorFileInfo> error;
  std::string exec_error;
  std::string watchdog;  // why the agent killed it: "no progress for 5 s (--hang-timeout)", a torch FileTimer
  std::string stacks;    // the hung worker's stacks, taken before it was killed (--hang-timeout)
  // Not a worker's failure but a member node lost (`node`; rank -1), and how it was found:
  // recorded just before the worker failures it caused, so that it is the root cause.
  std::string lost;

  // "exited with code 5", "killed by SIGSEGV (11)"
  std::string how() const;
  // "rank 1 (local rank 1, node n2) exited with code 5: <error message>";
  // "node n3 lost: <how>" for a lost member
  std::string one_line() const;
  nlohmann::json to_json() const;
  // nullopt for text that is not a JSON object; missing fields take their defaults.
  static std::optional<Failure> from_json(const std::string& text);
};

// A worker's exit as a failure: its error file (TORCHELASTIC_ERROR_FILE; "" for none) is read.
Failure failure_from_exit(const WorkerExit& exit, const std::string& node, int restart_count,
                          const std::string& error_file);

// 2026-12-03T16:49:38.123Z
std::string iso_time(std::chrono::system_clock::time_point t);

// The summary's lines (banner included), root cause first. `job_wide`: the failures are every
// node's (group rank 0), else this node's. Empty for no failures.
std::vector<std::string> summary_lines(const std::string& run_id, const std::vector<Failure>& failures, bool job_wide,
                                       int max_restarts);

// This agent's failures, and the job-wide view through the rendezvous store.
class FailureReport {
 public:
  // Logs the failure, publishes it for the job-wide summary (best effort: the store may be
  // gone) under a key unique to this agent (`agent_key`, e.g. "<node>.<pid>"), and keeps it.
  void add(Failure failure, rdzv::Rendezvous& rdzv, const std::string& agent_key, pid_t pid);
  // A member node lost (`how` it was found), dated `when` (just before the failures it caused).
  void add_loss(const std::string& node, const std::string& how, std::chrono::system_clock::time_point when,
                rdzv::Rendezvous& rdzv, const std::string& agent_key);
  bool empty() const { return failures_.empty(); }
  const Failure& first() const { return failures_.front(); }
  const Failure& last() const { return failures_.back(); }

  // Once per agent: group rank 0 of the last round logs every agent's failures, the others
  // their own. `rdzv` may be null (no rendezvous was made).
  void print_summary(rdzv::Rendezvous* rdzv, const std::string& run_id, int max_restarts);

 private:
  std::vector<Failure> job_failures(rdzv::Rendezvous& rdzv) const;

  std::vector<Failure> failures_;
  bool printed_ = false;
};

}  // namespace elastrun::launcher
