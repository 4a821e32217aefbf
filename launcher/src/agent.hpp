// The elastic agent: `elastrun [torchrun flags] PROGRAM [ARGS...]`, one per node.
//
// A short loop, each state a method that returns the next one (like torch's
// SimpleElasticAgent._invoke_run); the states are named in the logs ("state MONITOR"):
//
//   RENDEZVOUS -> START_WORKERS -> MONITOR -> SUCCEEDED                       -> exit 0
//                                         -> FAILED -> (RESTART) -> RENDEZVOUS | exit 1
//                                         -> MEMBERSHIP_CHANGED -> RENDEZVOUS
//                                         -> CHECKPOINT_STOP    -> exit 85 (requeue) | SUCCEEDED
//
// Each state method returns the next state as a value that carries what the next state needs
// (a Transition: the std::variant of the payloads in `states`, as torch's RunResult carries a
// run's outcome): FAILED gets the failed exits, MEMBERSHIP_CHANGED the change, CHECKPOINT_STOP
// why it was entered and the exits seen before, EXIT the code. What must outlive an attempt (the
// reaper, watchdog, process backend, event log, node endpoint) is the NodeRuntime's
// (node_runtime.hpp); worker exits are classified by one function (workers.hpp: classify).
// RESTART is a logged transition of FAILED ("state RESTART restart N of M"), not a state of
// its own. The FAILED decision is restart_policy.hpp's pure function; signals are signals.hpp's;
// the worker environment is worker_env.hpp's; failures and the job-wide summary are
// failure_report.hpp's; requeue policy is requeue.hpp's; the stores an agent hosts come from
// rdzv/bootstrap.hpp. Stopping for a checkpoint (CHECKPOINT_STOP, the scale-up checkpoint) and
// the requeue coordination between agents are in agent_stop.cpp. See docs/launcher.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "control_file.hpp"
#include "elastrun/rdzv/auth.hpp"
#include "elastrun/rdzv/bootstrap.hpp"
#include "elastrun/rdzv/env.hpp"
#include "elastrun/rdzv/rendezvous.hpp"
#include "events.hpp"
#include "failure_report.hpp"
#include "gpu_binding.hpp"
#include "hang_watch.hpp"
#include "health_check.hpp"
#include "job_outcome.hpp"
#include "node_runtime.hpp"
#include "options.hpp"
#include "restart_policy.hpp"
#include "signals.hpp"
#include "straggler_watch.hpp"
#include "subprocess.hpp"
#include "workers.hpp"

namespace elastrun::launcher {

// Parses the command line and runs the agent. Returns the process exit code:
// 0 success, 1 failure (workers failed past --max-restarts, rendezvous error), 2 bad command
// line, 85 workers checkpointed and stopped, 128+N stopped by signal N.
int run_agent(int argc, char** argv);

// Why CHECKPOINT_STOP was entered; each way there makes one.
struct StopRequest {
  FailureClass cls = FailureClass::TimeLimit;
  int signal = 0;  // the signal that asked for it, 0 if a worker or a peer did
  std::string reason;
};

// The states, each with the data it is entered with.
namespace states {
struct Rendezvous {};
struct StartWorkers {};
struct Monitor {};
struct Succeeded {};
struct Failed {
  std::vector<WorkerExit> failures;  // the local failures that ended MONITOR
};
struct MembershipChanged {
  rdzv::Change change = rdzv::Change::None;
};
struct CheckpointStop {
  StopRequest why;
  std::vector<WorkerExit> exits;  // this attempt's exits seen before (a worker's exit 85, ...)
};
struct Exit {
  int code = 1;
};
}  // namespace states

using Transition = std::variant<states::Rendezvous, states::StartWorkers, states::Monitor, states::Succeeded,
                                states::Failed, states::MembershipChanged, states::CheckpointStop, states::Exit>;
std::string_view state_name(const Transition& t);  // "RENDEZVOUS", ...

// A directory removed with everything in it when the agent ends (error files without --log-dir).
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

class Agent {
 public:
  Agent(const AgentOptions& options, const rdzv::DetectedEnv& env, AgentSignals& signals)
      : o_(options), env_(env), signals_(signals), runtime_(options.stop_grace) {}
  ~Agent();  // removes the run's generated token file if this agent hosted the store
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;
  int run();

 private:
  using Clock = std::chrono::steady_clock;

  // ---- the states (agent.cpp) ----
  Transition rendezvous();
  Transition start_workers();
  Transition monitor();
  Transition failed(states::Failed entered);
  Transition membership_changed(states::MembershipChanged entered);
  Transition succeeded();
  Transition checkpoint_stop(states::CheckpointStop entered);  // agent_stop.cpp
  static Transition exit_with(int rc) { return states::Exit{rc}; }

  // ---- set-up (agent_setup.cpp) ----
  void resolve_command();
  void bootstrap();
  void choose_auth(bool standalone);
  void use_job_dir();  // the job directory's defaults for the event log, logs and outcome file
  void open_event_log();
  void start_metrics();  // --metrics-dir: the node's textfile, from the event log
  void linger_for_peers();

  // ---- helpers of the states (agent.cpp) ----
  void open_control_channel(const std::filesystem::path& attempt_dir);
  void write_control(elastrun::control::Request request);
  std::vector<WorkerExit> stop_workers(std::chrono::milliseconds grace);
  // Every new exit of the group: its event, one log line by its classify() kind, and each failure
  // recorded (failure report, store) unless `record_failures` is false. Returns them.
  std::vector<WorkerExit> collect_exits(bool record_failures = true);
  void record(const WorkerExit& e);
  void watch_for_hangs();  // MONITOR: expired FileTimers, --hang-timeout (hang_watch.hpp)
  void print_summary() { failures_.print_summary(rdzv_.get(), plan_.run_id, o_.max_restarts); }
  int closed_exit(const rdzv::RendezvousClosed& closed);
  void log_state(std::string_view name, const std::string& what);   // and its event
  void record_exit(const WorkerExit& e);                            // the event of every worker exit
  rdzv::Change wait_for_change(std::chrono::milliseconds timeout);  // and the member_lost event
  rdzv::Change note_change(rdzv::Change change);                    // the event of a change seen elsewhere
  void record_losses(const FailedObservation& seen, const std::vector<WorkerExit>& failures);
  void write_outcome(JobOutcome outcome, int exit_code);  // --outcome-file, group rank 0

  // ---- the node's health: checks before it joins, stragglers while it trains (agent_health.cpp) ----
  // Runs --health-check when due (first join, after a failure of this node's workers); the exit
  // code when the node failed one and leaves the job, nullopt when it may join.
  std::optional<int> check_node_health();
  // --straggler-action=exclude: group rank 0 named this node a straggler; the exit code then.
  std::optional<int> leave_if_excluded();
  void leave_job(const std::string& reason);   // recorded, published (excluded on requeue), store kept
  void refresh_unhealthy_nodes();              // each round: the nodes that left the job this way
  std::vector<std::string> unhealthy_nodes();  // ... as last read (any thread: excluded on requeue)
  void report_node_verdicts();                 // group rank 0 at the end: who left, who was slow
  // MONITOR: --health-check-interval, the checks again without blocking; the exit code when one failed
  std::optional<int> watch_node_health();
  int fail_health_check(const std::string& when, const HealthVerdict& failed, long long ms, nlohmann::json checks);
  // memory checkpoints between agents (memory_peers.hpp): at setup, then after each round
  void start_memory_peers(bool etcd);
  void memory_peers_round(const rdzv::RoundResult& round);
  void start_straggler_watch();  // START_WORKERS: fresh windows (and scores on group rank 0)
  void watch_stragglers();       // MONITOR, every tick (straggler_watch.hpp)

  // ---- stopping for a checkpoint, requeue coordination (agent_stop.cpp) ----
  static StopRequest stop_for_signal(int sig, std::string_view detail = {});  // Slurm's warning, preemption
  std::optional<StopRequest> killed_by_slurm_stop_signal(const std::vector<WorkerExit>& exits);
  std::optional<StopRequest> stop_requested_elsewhere();   // a peer's request, published in the store
  bool ask_workers_to_checkpoint(const StopRequest& why);  // false: they cannot be asked
  void await_checkpoint(std::vector<WorkerExit>& exits);   // up to --checkpoint-timeout
  void meet_after_checkpoint();                            // the other agents, bounded
  rdzv::Change checkpoint_before_scale_up();
  bool request_requeue(FailureClass cls, const std::vector<std::string>& exclude, int signal);
  void requeue_failed_job();
  void requeue_after_node_loss();
  void end_job_if_batch_script_lost(
      const std::vector<std::string>& last_round_members);  // group rank 0's last act (agent_stop.cpp)

  AgentOptions o_;  // a copy: use_job_dir() fills in the job directory's defaults
  const rdzv::DetectedEnv& env_;
  AgentSignals& signals_;
  rdzv::BootstrapPlan plan_;
  rdzv::AuthConfig auth_;
  rdzv::AgentStores stores_;
  std::unique_ptr<rdzv::Rendezvous> rdzv_;
  int min_nodes_ = 1, max_nodes_ = 1;
  std::vector<rdzv::NodeBounds> component_bounds_;  // --het-nnodes
  std::string command_path_;
  std::vector<std::string> command_argv_;
  std::size_t command_argv_program_end_ = 1;  // index after the program (python -u [-m] SCRIPT)
  std::vector<std::vector<int>> numa_nodes_;  // --numa-binding: read once at start
  std::string socket_ifname_;                 // the workers' NCCL/GLOO_SOCKET_IFNAME: chosen once at start
  int cpus_ = 0;                              // this agent's CPUs (its affinity mask), read once at start
  GpuSet gpus_;                               // the step's GPUs on this node, read once at start
  std::vector<std::vector<int>> gpu_cpus_;    // --numa-binding: the CPUs near each GPU, read once at start
  std::optional<TempDir> tmp_;
  std::filesystem::path attempt_base_;
  std::string job_dir_;            // the job directory in use ("" if none: job_dir.hpp)
  bool log_dir_per_node_ = false;  // the log dir is the job's, shared by every node's agent
  int attempt_ = 0;                // local starts of the workers, for per-attempt files
  std::int64_t restart_count_ = 0;
  FailureReport failures_;
  // fenced commits: the current round's fence (none between rounds), read by the endpoint's
  // thread for the workers' commit_fence requests; before runtime_, whose endpoint uses them
  std::mutex fence_mutex_;
  std::optional<rdzv::CommitFence> fence_;
  std::string check_commit(const std::string& what);  // the endpoint's thread
  std::string etcd_endpoint_;                         // "" : the embedded store
  void set_fence(std::optional<rdzv::CommitFence> fence) {
    std::lock_guard lock(fence_mutex_);
    fence_ = std::move(fence);
  }
  NodeRuntime runtime_;  // for the whole job; before group_, which uses its backend
  EventLog& events() { return runtime_.events(); }
  std::optional<WorkerGroup> group_;
  std::vector<std::string> error_files_;  // this attempt's, by local rank
  // hung workers (hang_watch.hpp): torch's FileTimer FIFO, --hang-timeout progress files
  std::optional<FileTimerServer> file_timer_;
  std::filesystem::path attempt_dir_;                                  // this attempt's directory
  std::map<pid_t, std::pair<std::string, std::string>> killed_by_us_;  // pid -> (why, stacks)
  double next_hang_check_ = 0;
  int rc_ = 1;  // the code of the final Exit
  // checkpoint-and-stop (state CHECKPOINT_STOP)
  std::string control_path_;  // this attempt's control file (ELASTRUN_CONTROL_FILE)
  std::uint64_t control_sequence_ = 0;
  Clock::time_point next_stop_poll_{};
  // requeue: once per agent, from the main thread or the signal thread (request_requeue)
  std::mutex requeue_mutex_;
  bool requeue_attempted_ = false, requeued_ = false;
  std::set<std::string> ever_members_;  // nodes of every round so far (end_job_if_batch_script_lost)
  // --health-check: due at the first join and after each failure of this node's workers
  bool health_due_ = true;
  bool health_checked_once_ = false;
  std::filesystem::path health_marker_;  // this node's marker in the checkpoint directory (removed at the end)
  std::optional<BackgroundCommand> background_check_;  // --health-check-interval: the command running now
  std::size_t background_command_ = 0;                 // ... its index in --health-check's commands
  Clock::time_point next_health_check_{}, background_check_started_{};
  // stragglers (straggler_watch.hpp): this attempt's windows per local rank, the last published
  std::vector<ComputeWindows> compute_windows_;
  std::vector<std::optional<ComputeWindows::Window>> rank_windows_;
  long published_window_ = -1;
  std::optional<StragglerScore> straggler_score_;  // group rank 0, this round
  Clock::time_point next_straggler_score_{};
  std::mutex unhealthy_mutex_;
  std::vector<std::string> unhealthy_;  // refresh_unhealthy_nodes()
  bool health_checks_on() const { return o_.health_check_builtin || !o_.health_check_commands.empty(); }
};

}  // namespace elastrun::launcher
