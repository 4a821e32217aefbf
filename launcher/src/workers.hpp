// The local worker processes of one attempt: started by the node's process backend
// (process_backend.hpp), each leading its own process group, their stdout/stderr relayed line by
// line with a "[rank N] " prefix (console) and/or raw into per-attempt log files, their exits
// collected without blocking, and stopped with SIGTERM -> grace -> SIGKILL to each group. The
// destructor stops whatever still runs: no worker outlives its WorkerGroup.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "process_backend.hpp"

namespace elastrun::launcher {

struct WorkerSpec {
  int local_rank = 0;
  int global_rank = 0;
  std::string path;                                   // resolved executable
  std::vector<std::string> argv;                      // argv[0] included
  std::vector<std::string> env;                       // "KEY=VALUE"
  bool console_stdout = true, console_stderr = true;  // relay to the agent's stdout/stderr
  std::string stdout_file, stderr_file;               // raw copies ("" = none)
  std::string error_file;      // TORCHELASTIC_ERROR_FILE (PyTorch's @record JSON), read on failure
  std::string console_prefix;  // before each console line ("" = "[rank N] ")
  // --duplicate-std{out,err}-filters: console lines containing one of these also go to the file
  std::vector<std::string> stdout_filters, stderr_filters;
  std::string stdout_filtered_file, stderr_filtered_file;
  std::vector<int> cpus;  // --numa-binding: the CPUs the worker may run on (empty = unchanged)
};

struct WorkerExit {
  int local_rank = 0;
  int global_rank = 0;
  pid_t pid = 0;
  int exit_code = 0;       // valid when signal == 0
  int signal = 0;          // terminating signal, 0 if it exited
  std::string exec_error;  // the program could not be executed (then exit_code 127)
  std::chrono::system_clock::time_point when;
  bool ok() const { return signal == 0 && exit_code == 0; }
  // exit 85 (elastrun::control::kCheckpointedExitCode): "I saved a checkpoint and stopped"
  bool checkpointed() const { return signal == 0 && exit_code == 85; }
};

// What a worker's exit means to the agent -- the one classification every state uses.
enum class ExitKind {
  Finished,      // exit 0
  Checkpointed,  // exit 85: saved a checkpoint and stopped, asks for a requeue
  Failed,        // anything else: a non-zero code, a signal, an exec failure
};
ExitKind classify(const WorkerExit& e);
std::string_view to_string(ExitKind kind);  // "finished", "checkpointed", "failed"

// The local workers' exits after a checkpoint-and-stop request, counted by kind.
struct CheckpointTally {
  int checkpointed = 0, finished = 0;
  bool complete = false;      // some checkpointed, and every other one finished
  bool all_finished = false;  // every one exited 0: the training ended instead
};
CheckpointTally tally_checkpoint(const std::vector<WorkerExit>& exits, int local_workers);

// A WorkerExit from a wait status.
WorkerExit worker_exit_from_status(const WorkerSpec& spec, pid_t pid, int wait_status, std::string exec_error);

class WorkerGroup {
 public:
  // Starts every worker through `backend` (which must outlive the group); throws
  // std::system_error / std::runtime_error (already started workers are stopped first).
  WorkerGroup(std::vector<WorkerSpec> specs, ProcessBackend& backend);
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Collects exits without blocking; returns workers that exited since the last call.
  std::vector<WorkerExit> poll_exits();
  bool all_exited() const;
  std::vector<pid_t> pids() const;
  // How each worker came to be, in rank order: "exec" or "preload" (ProcessBackend).
  std::vector<std::string> started_by() const;

  // `sig` to each live worker's process group (--forward-signals).
  void signal_all(int sig);

  // SIGTERM to each live worker's group, up to `grace`, then SIGKILL; every child reaped and the
  // output relay drained. Returns the exits observed while stopping.
  std::vector<WorkerExit> stop(std::chrono::milliseconds grace);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Human name of a signal: "SIGSEGV".
std::string signal_name(int sig);

// Resolves `program` like execvp would (a name with '/' as is, else through $PATH); nullopt if
// no executable file is found.
std::optional<std::string> find_executable(const std::string& program);

}  // namespace elastrun::launcher
