// The agent's one reaper. The agent is a child subreaper (PR_SET_CHILD_SUBREAPER): besides the
// processes it starts (workers, the watchdog, later a preloader) it adopts whatever their
// descendants leave behind (a daemon's double fork, setsid). Only this class waits for children
// in general: each part that starts a process registers the pid with its exit handler (own()),
// reap() hands every exit to the part that owns the pid, and a pid no part owns is an adopted
// orphan -- reaped, and ended by kill_unowned() once the workers are gone. No part calls
// waitpid(-1) or kills "every child but X" on its own; a part may still wait for a pid it owns
// and started in the same thread (the stacks dumper of hang_watch.cpp).
//
// Not thread-safe by design beyond own()/disown(): reap() and kill_unowned() run on the agent's
// main thread, the only one that starts children.
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <mutex>
#include <vector>

namespace elastrun::launcher {

class Reaper {
 public:
  // Called on reap()'s thread with the child's wait status (WIFEXITED, WTERMSIG, ...).
  using ExitHandler = std::function<void(pid_t pid, int wait_status)>;

  void own(pid_t pid, ExitHandler on_exit);
  void disown(pid_t pid);  // the owner is going away: an exit of `pid` is then an orphan's
  bool owns(pid_t pid) const;

  // Reaps every child that has exited, without blocking: waitid(P_ALL, WNOWAIT) names it, the
  // owner's handler gets its status; an unowned one is logged as an adopted orphan. Returns how
  // many children were reaped.
  std::size_t reap();

  // SIGKILLs every live child no part owns and reaps it, round after round (an orphan's own
  // children are reparented to us in turn). Returns the pids killed.
  std::vector<pid_t> kill_unowned();

  // The agent's children now (every thread's), as /proc lists them.
  static std::vector<pid_t> children();

 private:
  mutable std::mutex mutex_;
  std::map<pid_t, ExitHandler> owners_;
};

}  // namespace elastrun::launcher
