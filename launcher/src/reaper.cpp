#include "reaper.hpp"

#include <signal.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <spdlog/spdlog.h>

namespace elastrun::launcher {

void Reaper::own(pid_t pid, ExitHandler on_exit) {
  std::lock_guard lock(mutex_);
  owners_[pid] = std::move(on_exit);
}

void Reaper::disown(pid_t pid) {
  std::lock_guard lock(mutex_);
  owners_.erase(pid);
}

bool Reaper::owns(pid_t pid) const {
  std::lock_guard lock(mutex_);
  return owners_.contains(pid);
}

std::size_t Reaper::reap() {
  std::size_t reaped = 0;
  while (true) {
    siginfo_t info{};
    // WNOWAIT: look first, so that the status is taken by pid below (one child at a time)
    if (::waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
      if (errno == EINTR) continue;
      if (errno != ECHILD) spdlog::error("error: waitid: {}", std::strerror(errno));
      return reaped;
    }
    const pid_t pid = info.si_pid;
    if (pid == 0) return reaped;  // children, none exited
    int status = 0;
    pid_t got;
    do got = ::waitpid(pid, &status, WNOHANG);
    while (got < 0 && errno == EINTR);
    if (got < 0 && errno == ECHILD) continue;  // reaped meanwhile by a waiter of its own
    if (got != pid) {
      spdlog::error("error: waitpid({}): {}", pid, got < 0 ? std::strerror(errno) : "not reaped");
      return reaped;
    }
    ++reaped;
    ExitHandler handler;
    {
      std::lock_guard lock(mutex_);
      if (auto it = owners_.find(pid); it != owners_.end()) {
        handler = std::move(it->second);
        owners_.erase(it);
      }
    }
    if (handler)
      handler(pid, status);
    else
      spdlog::debug("reaped pid {}, an orphan adopted from a worker", pid);
  }
}

std::vector<pid_t> Reaper::children() {
  std::vector<pid_t> out;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    std::ifstream in(task.path() / "children");
    pid_t pid = 0;
    while (in >> pid) out.push_back(pid);
  }
  return out;
}

std::vector<pid_t> Reaper::kill_unowned() {
  std::vector<pid_t> killed;
  for (int round = 0; round < 64; ++round) {
    std::vector<pid_t> orphans;
    for (pid_t pid : children())
      if (!owns(pid)) orphans.push_back(pid);
    if (orphans.empty()) break;
    for (pid_t pid : orphans) {
      spdlog::warn("warning: killing pid {}, left behind by a worker", pid);
      if (::kill(pid, SIGKILL) != 0 && errno != ESRCH)
        spdlog::error("error: kill({}, SIGKILL): {}", pid, std::strerror(errno));
      killed.push_back(pid);
    }
    for (pid_t pid : orphans) {  // unowned: nobody else waits for them
      pid_t got;
      do got = ::waitpid(pid, nullptr, 0);
      while (got < 0 && errno == EINTR);
    }
  }
  return killed;
}

}  // namespace elastrun::launcher
