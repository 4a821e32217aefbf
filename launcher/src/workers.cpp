#include "workers.hpp"

#include <fcntl.h>
#include <sched.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "elastrun/rdzv/net.hpp"

namespace elastrun::launcher {

using rdzv::UniqueFd;
using Clock = std::chrono::steady_clock;

namespace {

std::mutex console_mutex;  // one line at a time on the agent's stdout/stderr

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        pollfd p{fd, POLLOUT, 0};
        ::poll(&p, 1, 100);
        continue;
      }
      return;  // EPIPE (console gone), ENOSPC (log file): the worker keeps running
    }
    data.remove_prefix(static_cast<std::size_t>(n));
  }
}

struct Stream {
  UniqueFd fd;
  int console_fd = -1;  // 1, 2 or -1 (not shown)
  UniqueFd file;
  std::string prefix;
  std::string partial;
  UniqueFd filtered;  // --duplicate-*-filters: matching console lines
  const std::vector<std::string>* filters = nullptr;

  void duplicate_if_matching(std::string_view line) {
    if (!filtered || filters == nullptr) return;
    for (const auto& needle : *filters)
      if (line.find(needle) != std::string_view::npos) {
        std::string copy = prefix;
        copy.append(line);
        if (copy.back() != '\n') copy += '\n';
        write_all(filtered.get(), copy);
        return;
      }
  }

  void emit_lines(bool flush) {
    if (console_fd < 0) {
      partial.clear();
      return;
    }
    std::string out;
    std::size_t start = 0;
    while (true) {
      auto nl = partial.find('\n', start);
      if (nl == std::string::npos) break;
      out += prefix;
      out.append(partial, start, nl - start + 1);
      duplicate_if_matching(std::string_view(partial).substr(start, nl - start + 1));
      start = nl + 1;
    }
    partial.erase(0, start);
    if ((flush || partial.size() > 65536) && !partial.empty()) {
      out += prefix;
      out += partial;
      out += '\n';
      duplicate_if_matching(partial);
      partial.clear();
    }
    if (!out.empty()) {
      std::lock_guard lock(console_mutex);
      write_all(console_fd, out);
    }
  }
};

// We are a child subreaper: descendants of the workers that left their process group (setsid,
// double fork) are reparented to us when their parent dies. Once the workers are gone every
// remaining child is such an orphan: SIGKILL and reap them, repeatedly (their own children are
// reparented to us in turn) -- all but `keep`, the agent's own watchdog.
void kill_adopted_orphans(pid_t keep) {
  for (int round = 0; round < 64; ++round) {
    std::vector<pid_t> children;
    std::error_code ec;
    for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", ec)) {
      std::ifstream in(task.path() / "children");
      pid_t pid = 0;
      while (in >> pid)
        if (pid != keep) children.push_back(pid);
    }
    if (children.empty()) return;
    for (pid_t pid : children) {
      spdlog::warn("warning: killing pid {}, left behind by a worker", pid);
      if (::kill(pid, SIGKILL) != 0 && errno != ESRCH)
        spdlog::error("error: kill({}, SIGKILL): {}", pid, std::strerror(errno));
    }
    for (pid_t pid : children) {
      pid_t got;
      do got = ::waitpid(pid, nullptr, 0);
      while (got < 0 && errno == EINTR);
    }
  }
}

}  // namespace

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

std::optional<std::string> find_executable(const std::string& program) {
  auto executable = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  if (program.empty()) return std::nullopt;
  if (program.find('/') != std::string::npos) return executable(program) ? std::optional(program) : std::nullopt;
  const char* path = std::getenv("PATH");
  std::string_view rest = path ? path : "/usr/local/bin:/usr/bin:/bin";
  while (true) {
    auto colon = rest.find(':');
    std::string dir(rest.substr(0, colon));
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    if (executable(candidate)) return candidate;
    if (colon == std::string_view::npos) return std::nullopt;
    rest.remove_prefix(colon + 1);
  }
}

struct WorkerGroup::Impl {
  struct Worker {
    WorkerSpec spec;
    pid_t pid = -1;
    bool exited = false;
    std::string exec_error;
  };
  std::vector<Worker> workers;
  std::vector<Stream> streams;  // owned by the relay thread once it runs
  UniqueFd wake_read, wake_write;
  std::thread relay;
  std::atomic<bool> relay_stop{false};
  std::atomic<bool> relay_done{false};
  bool stopped = false;
  Watchdog* watchdog = nullptr;  // ends the groups if the agent dies (may be null)

  void relay_loop();
  void stop_relay(std::chrono::milliseconds patience);
  std::optional<WorkerExit> note_exit(pid_t pid, int status);
  void spawn(Worker& w);
};

void WorkerGroup::Impl::relay_loop() {
  std::vector<pollfd> fds;
  std::vector<char> buf(65536);
  while (true) {
    fds.clear();
    fds.push_back({wake_read.get(), POLLIN, 0});
    std::vector<Stream*> open;
    for (auto& s : streams)
      if (s.fd) {
        fds.push_back({s.fd.get(), POLLIN, 0});
        open.push_back(&s);
      }
    if (open.empty()) break;
    int n = ::poll(fds.data(), fds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("error: worker output relay: poll: {}", std::strerror(errno));
      break;
    }
    bool stop = false;
    if (fds[0].revents) {
      char c[64];
      while (::read(wake_read.get(), c, sizeof c) > 0) {
      }
      stop = relay_stop.load();
    }
    for (std::size_t i = 0; i < open.size(); ++i) {
      if (!fds[i + 1].revents && !stop) continue;
      auto& s = *open[i];
      while (true) {
        ssize_t got = ::read(s.fd.get(), buf.data(), buf.size());
        if (got > 0) {
          std::string_view data(buf.data(), static_cast<std::size_t>(got));
          if (s.file) write_all(s.file.get(), data);
          s.partial.append(data);
          s.emit_lines(false);
          if (static_cast<std::size_t>(got) < buf.size()) break;
          continue;
        }
        if (got < 0 && errno == EINTR) continue;
        if (got < 0 && errno == EAGAIN && !stop) break;
        // EOF, error, or stopping: flush what is left and close this stream
        s.emit_lines(true);
        s.fd.reset();
        break;
      }
    }
    if (stop) break;
  }
  relay_done = true;
}

void WorkerGroup::Impl::stop_relay(std::chrono::milliseconds patience) {
  if (!relay.joinable()) return;
  const auto deadline = Clock::now() + patience;
  while (!relay_done && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (!relay_done) {
    // a grandchild that left the process group still holds a pipe: stop reading it
    relay_stop = true;
    char c = 1;
    if (::write(wake_write.get(), &c, 1) < 0 && errno != EAGAIN)
      spdlog::error("error: waking the output relay: {}", std::strerror(errno));
  }
  relay.join();
}

std::optional<WorkerExit> WorkerGroup::Impl::note_exit(pid_t pid, int status) {
  for (auto& w : workers) {
    if (w.pid != pid || w.exited) continue;
    w.exited = true;
    WorkerExit e;
    e.local_rank = w.spec.local_rank;
    e.global_rank = w.spec.global_rank;
    e.pid = pid;
    e.when = std::chrono::system_clock::now();
    e.exec_error = w.exec_error;
    if (WIFSIGNALED(status))
      e.signal = WTERMSIG(status);
    else
      e.exit_code = WEXITSTATUS(status);
    return e;
  }
  return std::nullopt;  // a grandchild reparented to us (child subreaper): just reaped
}

void WorkerGroup::Impl::spawn(Worker& w) {
  int out[2], err[2], exec_err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) throw_errno("pipe2");
  UniqueFd out_r(out[0]), out_w(out[1]);
  if (::pipe2(err, O_CLOEXEC) != 0) throw_errno("pipe2");
  UniqueFd err_r(err[0]), err_w(err[1]);
  if (::pipe2(exec_err, O_CLOEXEC) != 0) throw_errno("pipe2");
  UniqueFd exec_r(exec_err[0]), exec_w(exec_err[1]);

  // Everything the child needs is prepared before fork: after it, only async-signal-safe calls.
  std::vector<char*> argv, envp;
  for (auto& a : w.spec.argv) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : w.spec.env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t parent = ::getpid();
  sigset_t empty;
  sigemptyset(&empty);
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  for (int cpu : w.spec.cpus)
    if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(cpu, &cpus);

  pid_t pid = ::fork();
  if (pid < 0) throw_errno("fork");
  if (pid == 0) {
    ::setpgid(0, 0);
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) ::_exit(126);
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; ++sig)
      if (sig != SIGKILL && sig != SIGSTOP) ::sigaction(sig, &dfl, nullptr);  // EINVAL for glibc-internal ones
    ::sigprocmask(SIG_SETMASK, &empty, nullptr);
    // --numa-binding; a failure (a cpuset that excludes them) leaves the affinity as it was
    if (!w.spec.cpus.empty()) (void)::sched_setaffinity(0, sizeof cpus, &cpus);
    if (::dup2(out_w.get(), 1) < 0 || ::dup2(err_w.get(), 2) < 0) ::_exit(126);
    if (exec_w.get() != 3 && ::dup2(exec_w.get(), 3) < 0) ::_exit(126);
    ::fcntl(3, F_SETFD, FD_CLOEXEC);
    ::close_range(4, ~0U, 0);
    ::execve(w.spec.path.c_str(), argv.data(), envp.data());
    int e = errno;
    [[maybe_unused]] auto ignored = ::write(3, &e, sizeof e);
    ::_exit(127);
  }
  w.pid = pid;
  if (::setpgid(pid, pid) != 0 && errno != EACCES && errno != ESRCH)
    spdlog::warn("warning: setpgid({}): {}", pid, std::strerror(errno));
  if (watchdog) watchdog->watch(pid);
  out_w.reset();
  err_w.reset();
  exec_w.reset();
  int child_errno = 0;
  ssize_t got;
  do got = ::read(exec_r.get(), &child_errno, sizeof child_errno);
  while (got < 0 && errno == EINTR);
  if (got == static_cast<ssize_t>(sizeof child_errno))
    w.exec_error = fmt::format("cannot execute {}: {}", w.spec.path, std::strerror(child_errno));

  auto open_log = [](const std::string& path) {
    if (path.empty()) return UniqueFd();
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    if (!fd) throw_errno("cannot open log file " + path);
    return fd;
  };
  const auto prefix =
      w.spec.console_prefix.empty() ? fmt::format("[rank {}] ", w.spec.global_rank) : w.spec.console_prefix;
  rdzv::set_nonblocking(out_r.get());
  rdzv::set_nonblocking(err_r.get());
  streams.push_back({std::move(out_r),
                     w.spec.console_stdout ? 1 : -1,
                     open_log(w.spec.stdout_file),
                     prefix,
                     {},
                     open_log(w.spec.stdout_filtered_file),
                     &w.spec.stdout_filters});
  streams.push_back({std::move(err_r),
                     w.spec.console_stderr ? 2 : -1,
                     open_log(w.spec.stderr_file),
                     prefix,
                     {},
                     open_log(w.spec.stderr_filtered_file),
                     &w.spec.stderr_filters});
}

WorkerGroup::WorkerGroup(std::vector<WorkerSpec> specs, Watchdog* watchdog) : impl_(std::make_unique<Impl>()) {
  impl_->watchdog = watchdog;
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) throw_errno("pipe2");
  impl_->wake_read = UniqueFd(wake[0]);
  impl_->wake_write = UniqueFd(wake[1]);
  impl_->workers.reserve(specs.size());
  for (auto& s : specs) impl_->workers.push_back({std::move(s), -1, false, {}});
  try {
    for (auto& w : impl_->workers) impl_->spawn(w);
  } catch (...) {
    stop(std::chrono::milliseconds(0));
    throw;
  }
  impl_->relay = std::thread([this] { impl_->relay_loop(); });
}

WorkerGroup::~WorkerGroup() {
  if (!impl_->stopped) stop(std::chrono::milliseconds(0));
}

std::vector<WorkerExit> WorkerGroup::poll_exits() {
  std::vector<WorkerExit> exits;
  while (true) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid == 0) break;
    if (pid < 0) {
      if (errno == EINTR) continue;
      if (errno != ECHILD) spdlog::error("error: waitpid: {}", std::strerror(errno));
      break;
    }
    if (auto e = impl_->note_exit(pid, status)) exits.push_back(std::move(*e));
  }
  return exits;
}

bool WorkerGroup::all_exited() const {
  for (const auto& w : impl_->workers)
    if (w.pid > 0 && !w.exited) return false;
  return true;
}

std::vector<pid_t> WorkerGroup::pids() const {
  std::vector<pid_t> out;
  for (const auto& w : impl_->workers) out.push_back(w.pid);
  return out;
}

void WorkerGroup::signal_all(int sig) {
  for (const auto& w : impl_->workers) {
    if (w.pid <= 0 || w.exited) continue;
    if (::kill(-w.pid, sig) != 0 && errno != ESRCH && errno != EPERM)
      spdlog::error("error: kill(-{}, {}): {}", w.pid, signal_name(sig), std::strerror(errno));
  }
}

std::vector<WorkerExit> WorkerGroup::stop(std::chrono::milliseconds grace) {
  impl_->stopped = true;
  std::vector<WorkerExit> exits = poll_exits();
  auto signal_groups = [&](int sig, bool live_only) {
    for (const auto& w : impl_->workers) {
      if (w.pid <= 0 || (live_only && w.exited)) continue;
      if (::kill(-w.pid, sig) != 0 && errno != ESRCH && errno != EPERM)
        spdlog::error("error: kill(-{}, {}): {}", w.pid, signal_name(sig), std::strerror(errno));
    }
  };
  signal_groups(SIGTERM, true);
  const auto deadline = Clock::now() + grace;
  while (!all_exited() && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    for (auto& e : poll_exits()) exits.push_back(std::move(e));
  }
  // SIGKILL to every group, also of workers that exited: a straggling grandchild must not survive.
  signal_groups(SIGKILL, false);
  for (auto& w : impl_->workers) {
    if (w.pid <= 0 || w.exited) continue;
    int status = 0;
    pid_t got;
    do got = ::waitpid(w.pid, &status, 0);
    while (got < 0 && errno == EINTR);
    if (got == w.pid) {
      if (auto e = impl_->note_exit(got, status)) exits.push_back(std::move(*e));
    } else {
      spdlog::error("error: waitpid({}): {}", w.pid, std::strerror(errno));
      w.exited = true;
    }
  }
  for (auto& e : poll_exits()) exits.push_back(std::move(e));  // reparented grandchildren
  kill_adopted_orphans(impl_->watchdog ? impl_->watchdog->pid() : -1);
  if (impl_->watchdog)
    for (const auto& w : impl_->workers)
      if (w.pid > 0) impl_->watchdog->forget(w.pid);
  impl_->stop_relay(std::chrono::milliseconds(2000));
  return exits;
}

}  // namespace elastrun::launcher
