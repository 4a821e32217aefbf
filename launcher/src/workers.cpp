#include "workers.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <utility>

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
    std::string_view started_by;
  };
  explicit Impl(ProcessBackend& b) : backend(b) {}
  ProcessBackend& backend;
  std::vector<Worker> workers;
  std::vector<WorkerExit> collected;  // handed over by the backend, not yet returned
  std::vector<Stream> streams;        // owned by the relay thread once it runs
  UniqueFd wake_read, wake_write;
  std::thread relay;
  std::atomic<bool> relay_stop{false};
  std::atomic<bool> relay_done{false};
  bool stopped = false;

  void relay_loop();
  void stop_relay(std::chrono::milliseconds patience);
  void note_exit(Worker& w, int wait_status);
  void start(Worker& w);
  std::vector<WorkerExit> collect();
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

WorkerExit worker_exit_from_status(const WorkerSpec& spec, pid_t pid, int wait_status, std::string exec_error) {
  WorkerExit e;
  e.local_rank = spec.local_rank;
  e.global_rank = spec.global_rank;
  e.pid = pid;
  e.when = std::chrono::system_clock::now();
  e.exec_error = std::move(exec_error);
  if (WIFSIGNALED(wait_status))
    e.signal = WTERMSIG(wait_status);
  else
    e.exit_code = WEXITSTATUS(wait_status);
  return e;
}

ExitKind classify(const WorkerExit& e) {
  if (e.ok()) return ExitKind::Finished;
  if (e.checkpointed()) return ExitKind::Checkpointed;
  return ExitKind::Failed;
}

std::string_view to_string(ExitKind kind) {
  switch (kind) {
    case ExitKind::Finished: return "finished";
    case ExitKind::Checkpointed: return "checkpointed";
    case ExitKind::Failed: return "failed";
  }
  return "?";
}

CheckpointTally tally_checkpoint(const std::vector<WorkerExit>& exits, int local_workers) {
  CheckpointTally t;
  for (const auto& e : exits) {
    if (classify(e) == ExitKind::Checkpointed) ++t.checkpointed;
    if (classify(e) == ExitKind::Finished) ++t.finished;
  }
  t.complete = t.checkpointed > 0 && t.checkpointed + t.finished == local_workers;
  t.all_finished = t.finished == local_workers;
  return t;
}

void WorkerGroup::Impl::note_exit(Worker& w, int wait_status) {
  if (w.exited) return;
  w.exited = true;
  collected.push_back(worker_exit_from_status(w.spec, w.pid, wait_status, w.exec_error));
}

std::vector<WorkerExit> WorkerGroup::Impl::collect() {
  backend.collect();
  return std::exchange(collected, {});
}

void WorkerGroup::Impl::start(Worker& w) {
  // `workers` never grows once starting begins: the handler's reference stays valid, and the
  // group releases every pid before it goes away.
  auto started = backend.start(w.spec, [this, &w](pid_t, int status) { note_exit(w, status); });
  w.pid = started.pid;
  w.exec_error = std::move(started.exec_error);
  w.started_by = started.started_by;

  auto open_log = [](const std::string& path) {
    if (path.empty()) return UniqueFd();
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    if (!fd) throw_errno("cannot open log file " + path);
    return fd;
  };
  const auto prefix =
      w.spec.console_prefix.empty() ? fmt::format("[rank {}] ", w.spec.global_rank) : w.spec.console_prefix;
  rdzv::set_nonblocking(started.stdout_read.get());
  rdzv::set_nonblocking(started.stderr_read.get());
  streams.push_back({std::move(started.stdout_read),
                     w.spec.console_stdout ? 1 : -1,
                     open_log(w.spec.stdout_file),
                     prefix,
                     {},
                     open_log(w.spec.stdout_filtered_file),
                     &w.spec.stdout_filters});
  streams.push_back({std::move(started.stderr_read),
                     w.spec.console_stderr ? 2 : -1,
                     open_log(w.spec.stderr_file),
                     prefix,
                     {},
                     open_log(w.spec.stderr_filtered_file),
                     &w.spec.stderr_filters});
}

WorkerGroup::WorkerGroup(std::vector<WorkerSpec> specs, ProcessBackend& backend)
    : impl_(std::make_unique<Impl>(backend)) {
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) throw_errno("pipe2");
  impl_->wake_read = UniqueFd(wake[0]);
  impl_->wake_write = UniqueFd(wake[1]);
  impl_->workers.reserve(specs.size());
  for (auto& s : specs) impl_->workers.push_back({std::move(s), -1, false, {}, {}});
  try {
    for (auto& w : impl_->workers) impl_->start(w);
  } catch (...) {
    stop(std::chrono::milliseconds(0));
    throw;
  }
  impl_->relay = std::thread([this] { impl_->relay_loop(); });
}

WorkerGroup::~WorkerGroup() {
  if (!impl_->stopped) stop(std::chrono::milliseconds(0));
}

std::vector<WorkerExit> WorkerGroup::poll_exits() { return impl_->collect(); }

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

std::vector<std::string> WorkerGroup::started_by() const {
  std::vector<std::string> out;
  for (const auto& w : impl_->workers) out.emplace_back(w.started_by);
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
  std::vector<WorkerExit> exits = impl_->collect();
  auto collect_more = [&] {
    for (auto& e : impl_->collect()) exits.push_back(std::move(e));
  };
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
    collect_more();
  }
  // SIGKILL to every group, also of workers that exited: a straggling grandchild must not survive.
  signal_groups(SIGKILL, false);
  const auto killed_at = Clock::now();
  auto next_warning = killed_at + std::chrono::seconds(10);
  for (collect_more(); !all_exited(); collect_more()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    for (auto& w : impl_->workers)  // gone without an exit handed to us (reaped by another waiter)
      if (w.pid > 0 && !w.exited && ::kill(w.pid, 0) != 0 && errno == ESRCH) {
        spdlog::error("error: worker {} (pid {}) was reaped elsewhere: its exit status is lost", w.spec.global_rank,
                      w.pid);
        impl_->note_exit(w, W_EXITCODE(0, SIGKILL));
      }
    if (Clock::now() >= next_warning) {  // uninterruptible sleep (a hung filesystem): keep waiting
      next_warning += std::chrono::seconds(10);
      for (const auto& w : impl_->workers)
        if (w.pid > 0 && !w.exited)
          spdlog::warn("warning: worker {} (pid {}) still not gone {} s after SIGKILL", w.spec.global_rank, w.pid,
                       std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - killed_at).count());
    }
  }
  for (const auto& w : impl_->workers)
    if (w.pid > 0) impl_->backend.release(w.pid);
  impl_->backend.end_leftovers();  // reparented grandchildren
  impl_->stop_relay(std::chrono::milliseconds(2000));
  return exits;
}

}  // namespace elastrun::launcher
