#include "watchdog.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <system_error>

#include <spdlog/spdlog.h>

namespace elastrun::launcher {
namespace {

struct Message {
  std::int32_t op;  // +1 watch, -1 forget
  std::int32_t process_group;
};

constexpr int kMaxGroups = 4096;

void write_text(const char* text) { [[maybe_unused]] auto ignored = ::write(2, text, std::strlen(text)); }

// The watchdog process. Runs after fork() in a process that may have had threads: only
// async-signal-safe calls (read, kill, nanosleep, write, _exit), no allocation.
[[noreturn]] void watchdog_main(int fd, long grace_ms) {
  static pid_t groups[kMaxGroups];
  int count = 0;
  Message m{};
  while (true) {
    const ssize_t n = ::read(fd, &m, sizeof m);
    if (n < 0 && errno == EINTR) continue;
    if (n != static_cast<ssize_t>(sizeof m)) break;  // end of file: the agent is gone or done
    if (m.process_group <= 1) continue;
    if (m.op > 0 && count < kMaxGroups) {
      groups[count++] = m.process_group;
    } else if (m.op < 0) {
      for (int i = 0; i < count; ++i)
        if (groups[i] == m.process_group) groups[i] = groups[--count];
    }
  }
  int alive = 0;
  for (int i = 0; i < count; ++i) alive += ::kill(-groups[i], 0) == 0;
  if (alive == 0) ::_exit(0);
  write_text("[elastrun watchdog] the agent is gone: ending its workers' process groups\n");
  for (int i = 0; i < count; ++i) ::kill(-groups[i], SIGTERM);
  for (long waited = 0; waited < grace_ms; waited += 50) {
    alive = 0;
    for (int i = 0; i < count; ++i) alive += ::kill(-groups[i], 0) == 0;
    if (alive == 0) ::_exit(0);
    const timespec step{0, 50'000'000};
    ::nanosleep(&step, nullptr);
  }
  for (int i = 0; i < count; ++i) ::kill(-groups[i], SIGKILL);
  ::_exit(0);
}

}  // namespace

Watchdog::Watchdog(std::chrono::milliseconds grace) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::system_error(errno, std::generic_category(), "pipe2");
  util::UniqueFd read_end(fds[0]), write_end(fds[1]);
  const long grace_ms = static_cast<long>(grace.count());
  pid_ = ::fork();
  if (pid_ < 0) throw std::system_error(errno, std::generic_category(), "fork");
  if (pid_ == 0) {
    // Not in the agent's process group: a terminal's Ctrl-C or a group kill of the agent must
    // leave the watchdog to do its job; and no signal but SIGKILL ends it before the pipe does.
    ::setpgid(0, 0);
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGPIPE}) ::sigaction(sig, &ignore, nullptr);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::prctl(PR_SET_NAME, "elastrun-wdog");
    int fd = read_end.get();
    if (fd != 3 && ::dup2(fd, 3) >= 0) fd = 3;
    ::close_range(fd + 1, ~0U, 0);  // stdin/stdout/stderr stay (the message goes to stderr)
    if (fd > 3) ::close_range(3, fd - 1, 0);
    watchdog_main(fd, grace_ms);
  }
  pipe_ = std::move(write_end);
}

Watchdog::~Watchdog() {
  pipe_.reset();
  if (pid_ <= 0) return;
  int status = 0;
  pid_t got;
  do got = ::waitpid(pid_, &status, 0);
  while (got < 0 && errno == EINTR);
}

void Watchdog::watch(pid_t process_group) { send(+1, process_group); }
void Watchdog::forget(pid_t process_group) { send(-1, process_group); }

void Watchdog::send(int op, pid_t process_group) {
  const Message m{op, static_cast<std::int32_t>(process_group)};
  ssize_t n;
  do n = ::write(pipe_.get(), &m, sizeof m);  // 8 bytes: atomic on a pipe
  while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(sizeof m))
    spdlog::warn("warning: the worker watchdog (pid {}) did not take process group {}: {}", pid_, process_group,
                 n < 0 ? std::strerror(errno) : "short write");
}

}  // namespace elastrun::launcher
