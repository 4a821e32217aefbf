// Running a short helper command to its end with its output captured: the stacks dumpers of
// hang_watch.cpp (gdb, py-spy) and the site's health check (health_check.hpp).
//
// The child runs in its own process group, with stdin from /dev/null, stdout and stderr into one
// pipe, every signal unblocked (the agent blocks some for its sigwait thread), and is killed (its
// whole group) at the deadline. It is always reaped here: call it only from the thread that
// reaps the agent's children (reaper.hpp allows a part to wait for a pid it started there).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "elastrun/util/unique_fd.hpp"

namespace elastrun::launcher {

struct CommandOutput {
  bool started = false;    // false: it could not be run at all (`output` says why)
  bool timed_out = false;  // killed at the deadline
  int exit_code = -1;      // its exit code, -1 if killed by a signal
  int signal = 0;          // the signal that ended it, 0 if it exited
  std::string output;      // stdout and stderr interleaved, the first 1 MiB
  bool succeeded() const { return started && !timed_out && signal == 0 && exit_code == 0; }
};

// Runs argv[0] (searched on PATH) with argv. `extra_env`: NAME=VALUE entries added to (or
// replacing those of) the agent's environment.
CommandOutput run_captured(const std::vector<std::string>& argv, std::chrono::milliseconds timeout,
                           const std::vector<std::string>& extra_env = {});

class Reaper;

// The same without blocking the agent's main thread (--health-check-interval while workers run):
// the child is owned by the agent's reaper, which reaps it in its rounds and hands over its status;
// poll() drains its output and says when it is done. At the deadline its process group is killed.
// Destroying it early kills it too (the reaper still reaps it).
class BackgroundCommand {
 public:
  BackgroundCommand(const std::vector<std::string>& argv, std::chrono::milliseconds timeout, Reaper& reaper);
  ~BackgroundCommand();
  BackgroundCommand(const BackgroundCommand&) = delete;
  BackgroundCommand& operator=(const BackgroundCommand&) = delete;
  // nullopt while it runs; its output once the reaper has seen it end (or it could not start).
  std::optional<CommandOutput> poll();

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;  // with the reaper's handler, which may outlive this object
  int pid_ = -1;
  util::UniqueFd read_end_;
  std::chrono::steady_clock::time_point deadline_;
  CommandOutput output_;
};

// The last non-empty line of `text` (trimmed, at most `max_chars`), "" if none: what a failed
// command said last.
std::string last_line(const std::string& text, std::size_t max_chars = 300);

}  // namespace elastrun::launcher
