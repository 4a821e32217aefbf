// How a node's worker processes come to be: the process backend behind the WorkerGroup. The
// group relays output, classifies and stops; the backend starts a process from a WorkerSpec and
// reports its exit: ExecBackend (fork + execve by the agent, reaped by its Reaper), or the
// preload backend (a long-lived per-node process that has imported the training code and forks
// workers on request) -- its workers are its children, so their exits reach the agent from it,
// not from waitpid; hence collect() rather than a pid wait.
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "elastrun/util/unique_fd.hpp"

namespace elastrun::launcher {

struct WorkerSpec;
class Reaper;
class Watchdog;

struct StartedProcess {
  pid_t pid = -1;  // leads a process group of its own (pgid == pid)
  util::UniqueFd stdout_read, stderr_read;
  std::string exec_error;                // the program could not be executed (it then exits 127)
  std::string_view started_by = "exec";  // "exec", or "preload" (forked by the preloader)
};

class ProcessBackend {
 public:
  // The process's wait status (WIFEXITED, WTERMSIG, ...), from collect() on its caller's thread.
  using ExitHandler = std::function<void(pid_t pid, int wait_status)>;

  virtual ~ProcessBackend() = default;
  virtual std::string_view name() const = 0;

  // Starts the process of `spec`; throws std::system_error / std::runtime_error.
  virtual StartedProcess start(const WorkerSpec& spec, ExitHandler on_exit) = 0;
  // Hands every exit observed since the last call to its handler; never blocks.
  virtual void collect() = 0;
  // The process `pid` is gone and its group signalled for the last time: stop protecting it,
  // and never call its handler (its owner is going away).
  virtual void release(pid_t pid) = 0;
  // After a group of workers stopped: ends what they left behind (adopted orphans).
  virtual void end_leftovers() = 0;
  // Early work before the first start (the preloader's imports while the rendezvous runs).
  virtual void prepare() {}
};

// fork + execve from the agent: each worker in its own process group, PR_SET_PDEATHSIG(SIGKILL),
// default signal dispositions, an empty mask, --numa-binding's CPUs, stdout/stderr into pipes;
// exits reaped by `reaper`; each group registered with `watchdog` (may be null).
std::unique_ptr<ProcessBackend> make_exec_backend(Reaper& reaper, Watchdog* watchdog);

// --preload=MODULES: `python -u ...` workers of `python` are forked by a per-node preloader
// that imported MODULES once (preload_backend.cpp); every other start goes to the exec backend.
struct PreloadConfig {
  std::string python;   // the resolved interpreter the workers run
  std::string modules;  // comma-separated, as given to --preload
};
std::unique_ptr<ProcessBackend> make_preload_backend(Reaper& reaper, Watchdog* watchdog, PreloadConfig config);

}  // namespace elastrun::launcher
