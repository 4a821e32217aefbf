// The preload process backend (process_backend.hpp; elastrun --preload=MODULES): one preloader
// per node (preloader.py, run from the source embedded in this binary) imports MODULES once and
// forks each Python worker on request. The workers are the preloader's children, so their exits
// reach us as its reports (collect()), not from waitpid; each worker still leads its own process
// group, dies with its parent (PDEATHSIG: the preloader, which dies with us) and is registered
// with the watchdog, so stop, kill and `kill -9` of the agent treat it as an exec'd worker.
// Anything but a `python -u ...` worker of the agent's interpreter, and every start after the
// preloader failed twice, goes to the exec backend.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <system_error>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "preloader_source.hpp"
#include "process_backend.hpp"
#include "reaper.hpp"
#include "watchdog.hpp"
#include "workers.hpp"

extern char** environ;

namespace elastrun::launcher {

namespace {

using util::UniqueFd;
using Clock = std::chrono::steady_clock;

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

// How long the preloader may take for its imports (a cold parallel filesystem is slow).
constexpr std::chrono::seconds kReadyTimeout{300};
// Preloaders started before starts go to the exec backend for good.
constexpr int kPreloaderStarts = 2;

class PreloadBackend final : public ProcessBackend {
 public:
  PreloadBackend(Reaper& reaper, Watchdog* watchdog, PreloadConfig config)
      : reaper_(reaper), watchdog_(watchdog), config_(std::move(config)), exec_(make_exec_backend(reaper, watchdog)) {}

  ~PreloadBackend() override { stop_preloader(); }

  std::string_view name() const override { return "preload"; }

  void prepare() override {
    if (!preloader_running() && starts_ < kPreloaderStarts) start_preloader();
  }

  StartedProcess start(const WorkerSpec& spec, ExitHandler on_exit) override {
    if (!is_ours(spec) || !usable()) return exec_->start(spec, std::move(on_exit));
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0) throw_errno("pipe2");
    UniqueFd out_r(out[0]), out_w(out[1]);
    if (::pipe2(err, O_CLOEXEC) != 0) throw_errno("pipe2");
    UniqueFd err_r(err[0]), err_w(err[1]);
    const nlohmann::json order = {
        {"start",
         {{"argv", std::vector<std::string>(spec.argv.begin() + 2, spec.argv.end())},  // after "python -u"
          {"env", spec.env},
          {"cpus", spec.cpus}}}};
    if (!send_order(order.dump(), out_w.get(), err_w.get())) {
      lost_preloader("its socket closed");
      return exec_->start(spec, std::move(on_exit));
    }
    out_w.reset();
    err_w.reset();
    while (true) {
      auto reply = receive(Clock::now() + std::chrono::seconds(30));
      if (!reply) {
        lost_preloader("no answer to a start within 30 s");
        return exec_->start(spec, std::move(on_exit));
      }
      if (!is_answer(*reply)) {
        note(std::move(*reply));
        continue;
      }
      if (reply->contains("error"))
        throw std::runtime_error("the preloader could not start the worker: " + reply->value("error", ""));
      const pid_t pid = reply->value("started", -1);
      if (pid <= 0) throw std::runtime_error("the preloader's answer to a start names no process: " + reply->dump());
      handlers_[pid] = std::move(on_exit);
      if (watchdog_) watchdog_->watch(pid);
      StartedProcess started;
      started.pid = pid;
      started.stdout_read = std::move(out_r);
      started.stderr_read = std::move(err_r);
      started.started_by = name();
      return started;
    }
  }

  void collect() override {
    exec_->collect();  // our preloader's exit comes through the reaper too
    while (auto message = receive(Clock::now())) note(std::move(*message));
    while (!exits_.empty()) {
      const auto report = std::move(exits_.front());
      exits_.pop_front();
      deliver(report.value("exit", -1), report.value("status", 0));
    }
    if (!preloader_running() && !handlers_.empty()) {
      // its workers died with it (PDEATHSIG) and no report will come: as killed
      std::vector<pid_t> orphaned;
      for (const auto& [pid, handler] : handlers_) orphaned.push_back(pid);
      for (pid_t pid : orphaned) deliver(pid, SIGKILL);
    }
  }

  void release(pid_t pid) override {
    if (handlers_.erase(pid)) {
      if (watchdog_) watchdog_->forget(pid);
    } else {
      exec_->release(pid);
    }
  }

  void end_leftovers() override { exec_->end_leftovers(); }

 private:
  bool is_ours(const WorkerSpec& spec) const {
    return spec.path == config_.python && spec.argv.size() >= 3 && spec.argv[1] == "-u";
  }
  bool preloader_running() const { return pid_ > 0 && socket_; }

  // The preloader is up and ready, starting or restarting it when it may; false: use exec.
  bool usable() {
    if (!preloader_running()) {
      if (starts_ >= kPreloaderStarts) return false;
      start_preloader();
    }
    while (!ready_ && preloader_running()) {
      auto message = receive(Clock::now() + kReadyTimeout);
      if (!message) break;
      note(std::move(*message));
    }
    if (ready_ && preloader_running()) return true;
    if (preloader_running()) lost_preloader(fmt::format("not ready within {} s", kReadyTimeout.count()));
    return starts_ < kPreloaderStarts && usable();
  }

  static bool is_answer(const nlohmann::json& message) {
    return message.contains("started") || message.contains("error");
  }

  // A message that is not the answer to a start: an exit report (kept for collect()), the
  // preloader ready, or its refusal to serve.
  void note(nlohmann::json message) {
    if (message.contains("exit")) {
      exits_.push_back(std::move(message));
    } else if (message.value("ready", false)) {
      ready_ = true;
      spdlog::info("--preload: the preloader (pid {}) imported {} in {:.2f} s", pid_, config_.modules,
                   message.value("seconds", 0.0));
    } else if (message.contains("fatal")) {
      spdlog::warn("warning: {}; starting workers without it", message.value("fatal", ""));
      starts_ = kPreloaderStarts;  // it will not do better a second time
      stop_preloader();
    }
  }

  void start_preloader() {
    ++starts_;
    int pair[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0) throw_errno("socketpair");
    UniqueFd ours(pair[0]), theirs(pair[1]);
    std::vector<std::string> argv_text = {config_.python, "-u", "-c", std::string(kPreloaderSource), config_.modules};
    std::vector<char*> argv;
    for (auto& a : argv_text) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) throw_errno("fork");
    if (pid == 0) {
      ::setpgid(0, 0);  // not in the agent's group: a terminal's Ctrl-C is the agent's to handle
      if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) ::_exit(126);
      // the agent's threads block the signals its signal thread waits for; an exec keeps the
      // mask, so without this every worker forked by the preloader had SIGTERM & co. blocked
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      if (theirs.get() != 3 && ::dup2(theirs.get(), 3) < 0) ::_exit(126);
      ::fcntl(3, F_SETFD, 0);
      ::close_range(4, ~0U, 0);
      ::execve(config_.python.c_str(), argv.data(), environ);
      ::_exit(127);
    }
    pid_ = pid;
    socket_ = std::move(ours);
    ready_ = false;
    reaper_.own(pid, [this](pid_t dead, int status) {
      if (dead != pid_) return;
      spdlog::warn("warning: the preloader (pid {}) ended ({} {}){}", dead, WIFSIGNALED(status) ? "signal" : "exit",
                   WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status),
                   starts_ < kPreloaderStarts ? ": starting another for the next workers"
                                              : ": starting workers without it from now on");
      pid_ = -1;
      socket_.reset();
    });
  }

  void lost_preloader(const std::string& why) {
    spdlog::warn("warning: the preloader (pid {}): {}", pid_, why);
    stop_preloader();
  }

  // Closing the socket ends a healthy preloader; one that does not go within 2 s is killed.
  void stop_preloader() {
    if (pid_ <= 0) return;
    const pid_t pid = pid_;
    pid_ = -1;
    socket_.reset();
    reaper_.disown(pid);
    for (int i = 0; i < 200; ++i) {
      if (::waitpid(pid, nullptr, WNOHANG) != 0) return;
      ::usleep(10'000);
    }
    ::kill(pid, SIGKILL);
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
  }

  bool send_order(const std::string& text, int stdout_fd, int stderr_fd) {
    iovec iov{const_cast<char*>(text.data()), text.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(2 * sizeof(int));
    const int fds[2] = {stdout_fd, stderr_fd};
    std::memcpy(CMSG_DATA(c), fds, sizeof fds);
    ssize_t sent;
    do sent = ::sendmsg(socket_.get(), &msg, MSG_NOSIGNAL);
    while (sent < 0 && errno == EINTR);
    return sent == static_cast<ssize_t>(text.size());
  }

  // The preloader's next message before `deadline` (now: only one already there); nullopt on
  // timeout or when it is gone (then the socket is closed).
  std::optional<nlohmann::json> receive(Clock::time_point deadline) {
    while (socket_) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      pollfd p{socket_.get(), POLLIN, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(std::max<long long>(0, left)));
      if (ready < 0 && errno == EINTR) continue;
      if (ready <= 0) return std::nullopt;
      std::string buffer(1 << 16, '\0');
      const ssize_t got = ::recv(socket_.get(), buffer.data(), buffer.size(), MSG_DONTWAIT);
      if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (got <= 0) {  // gone: its exit reaches the reaper
        socket_.reset();
        return std::nullopt;
      }
      buffer.resize(static_cast<std::size_t>(got));
      auto message = nlohmann::json::parse(buffer, nullptr, false);
      if (message.is_object()) return message;
      spdlog::warn("warning: the preloader sent '{}'", buffer.substr(0, 200));
    }
    return std::nullopt;
  }

  void deliver(pid_t pid, int status) {
    const auto it = handlers_.find(pid);
    if (it == handlers_.end()) return;  // released: its owner went away
    auto handler = std::move(it->second);
    handlers_.erase(it);
    if (watchdog_) watchdog_->forget(pid);
    handler(pid, status);
  }

  Reaper& reaper_;
  Watchdog* watchdog_;
  PreloadConfig config_;
  std::unique_ptr<ProcessBackend> exec_;
  pid_t pid_ = -1;
  UniqueFd socket_;
  bool ready_ = false;
  int starts_ = 0;
  std::map<pid_t, ExitHandler> handlers_;  // live preloaded workers
  std::deque<nlohmann::json> exits_;       // reports read while waiting for another answer
};

}  // namespace

std::unique_ptr<ProcessBackend> make_preload_backend(Reaper& reaper, Watchdog* watchdog, PreloadConfig config) {
  return std::make_unique<PreloadBackend>(reaper, watchdog, std::move(config));
}

}  // namespace elastrun::launcher
