// The guarantee "no orphans, ever" when the agent itself dies (kill -9, the OOM killer): a small
// process forked by the agent that outlives it. The agent registers each worker's process group
// over a pipe; when the pipe reaches end of file (the agent is gone, or closed it on its way
// out), the watchdog sends SIGTERM to every group still registered, waits up to the grace, sends
// SIGKILL, and exits. PR_SET_PDEATHSIG reaches only a worker itself; a group signal also reaches
// what the worker started in its group (`sh -c 'train ...; echo done'`); and every process whose
// environment carries this agent's tag (environment_entry(), given to every worker) gets the
// same signals -- what a worker started in a session or group of its own (setsid, a daemon's
// double fork) inherits the tag. It also removes the agent's --metrics-dir file, which must not
// report a dead agent as up. A future per-node preloader registers the groups of the
// processes it forks the same way and passes the tag on.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>

#include "elastrun/util/unique_fd.hpp"
#include "elastrun/worker/contract.hpp"

namespace elastrun::launcher {

class Watchdog {
 public:
  // Forks the watchdog process; throws std::system_error. `remove_at_end`: a file the agent keeps
  // only while it lives (its --metrics-dir file), removed when the pipe ends ("" for none).
  explicit Watchdog(std::chrono::milliseconds grace, std::string remove_at_end = {});
  ~Watchdog();  // closes the pipe (the watchdog ends what is still registered, then exits) and reaps it
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  void watch(pid_t process_group);   // a worker's process group, from its start
  void forget(pid_t process_group);  // the group is gone (stopped and reaped by the agent)
  pid_t pid() const { return pid_; }
  // "ELASTRUN_AGENT_TAG=<agent pid>-<random>": put it in every worker's environment.
  const std::string& environment_entry() const { return environment_entry_; }
  static constexpr const char* kTagVariable = contract::env::kAgentTag.data();  // the worker contract's name

 private:
  void send(int op, pid_t process_group);
  std::string environment_entry_;  // before the fork: the watchdog keeps its copy
  std::string remove_at_end_;
  util::UniqueFd pipe_;
  pid_t pid_ = -1;
};

}  // namespace elastrun::launcher
