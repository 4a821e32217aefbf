#include "watchdog.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <random>
#include <system_error>

#include <fmt/format.h>

#include <spdlog/spdlog.h>

namespace elastrun::launcher {
namespace {

struct Message {
  std::int32_t op;  // +1 watch, -1 forget
  std::int32_t process_group;
};

constexpr int kMaxGroups = 4096;

void write_text(const char* text) { [[maybe_unused]] auto ignored = ::write(2, text, std::strlen(text)); }

// Signals every process but this one whose environment carries `entry` (the agent's tag, given
// to every worker and inherited by whatever a worker starts, in its process group or not: setsid,
// a daemon's double fork); sig 0 only counts them. Async-signal-safe: open, getdents64, read,
// close, kill -- no allocation, static buffers (environments longer than kEnvironBytes are only
// searched that far).
constexpr std::size_t kEnvironBytes = 256 * 1024;

bool parse_pid(const char* name, pid_t* pid) {
  pid_t value = 0;
  if (*name == '\0') return false;
  for (const char* c = name; *c; ++c) {
    if (*c < '0' || *c > '9' || value > 100'000'000) return false;
    value = value * 10 + (*c - '0');
  }
  *pid = value;
  return value > 0;
}

bool carries_entry(const char* pid_name, const char* entry, std::size_t entry_length) {
  static char path[64];
  static char environment[kEnvironBytes];
  std::size_t at = 0;
  for (const char* part : {"/proc/", pid_name, "/environ"})
    for (const char* c = part; *c && at + 1 < sizeof path; ++c) path[at++] = *c;
  path[at] = '\0';
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;  // gone, or not ours to read
  std::size_t length = 0;
  while (length < sizeof environment) {
    const ssize_t n = ::read(fd, environment + length, sizeof environment - length);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    length += static_cast<std::size_t>(n);
  }
  ::close(fd);
  for (std::size_t begin = 0; begin < length;) {
    std::size_t end = begin;
    while (end < length && environment[end] != '\0') ++end;
    if (end - begin == entry_length && std::memcmp(environment + begin, entry, entry_length) == 0) return true;
    begin = end + 1;
  }
  return false;
}

int signal_tagged(const char* entry, std::size_t entry_length, int sig) {
  static char entries[16384];
  const int proc = ::open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (proc < 0) return 0;
  const pid_t self = ::getpid();
  int found = 0;
  while (true) {
    const ssize_t n = ::getdents64(proc, entries, sizeof entries);
    if (n <= 0) break;
    for (ssize_t offset = 0; offset < n;) {
      const auto* d = reinterpret_cast<const dirent64*>(entries + offset);
      offset += d->d_reclen;
      pid_t pid = 0;
      if (!parse_pid(d->d_name, &pid) || pid == self || !carries_entry(d->d_name, entry, entry_length)) continue;
      ++found;
      if (sig != 0) ::kill(pid, sig);
    }
  }
  ::close(proc);
  return found;
}

// The watchdog process. Runs after fork() in a process that may have had threads: only
// async-signal-safe calls (read, kill, nanosleep, write, open, getdents64, _exit), no allocation.
[[noreturn]] void watchdog_main(int fd, long grace_ms, const char* tag, std::size_t tag_length,
                                const char* remove_at_end) {
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
  if (*remove_at_end) ::unlink(remove_at_end);  // the agent's metrics file: it reports a live agent
  const auto alive = [&] {
    int left = 0;
    for (int i = 0; i < count; ++i) left += ::kill(-groups[i], 0) == 0;
    return left + signal_tagged(tag, tag_length, 0);
  };
  if (alive() == 0) ::_exit(0);
  write_text("[elastrun watchdog] the agent is gone: ending its workers and what they started\n");
  for (int i = 0; i < count; ++i) ::kill(-groups[i], SIGTERM);
  signal_tagged(tag, tag_length, SIGTERM);
  for (long waited = 0; waited < grace_ms; waited += 50) {
    if (alive() == 0) ::_exit(0);
    const timespec step{0, 50'000'000};
    ::nanosleep(&step, nullptr);
  }
  for (int i = 0; i < count; ++i) ::kill(-groups[i], SIGKILL);
  // twice: a tagged process may have forked between the scan and its SIGKILL
  for (int round = 0; round < 2; ++round) signal_tagged(tag, tag_length, SIGKILL);
  ::_exit(0);
}

}  // namespace

Watchdog::Watchdog(std::chrono::milliseconds grace, std::string remove_at_end)
    : environment_entry_(
          fmt::format("{}={}-{:016x}", kTagVariable, ::getpid(), std::random_device{}() * 0x9E3779B97F4A7C15ULL)),
      remove_at_end_(std::move(remove_at_end)) {
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
    watchdog_main(fd, grace_ms, environment_entry_.c_str(), environment_entry_.size(), remove_at_end_.c_str());
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
