// The exec process backend (process_backend.hpp): the agent forks and executes each worker.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "process_backend.hpp"
#include "reaper.hpp"
#include "watchdog.hpp"
#include "workers.hpp"

namespace elastrun::launcher {

namespace {

using util::UniqueFd;

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

class ExecBackend final : public ProcessBackend {
 public:
  ExecBackend(Reaper& reaper, Watchdog* watchdog) : reaper_(reaper), watchdog_(watchdog) {}

  std::string_view name() const override { return "exec"; }

  StartedProcess start(const WorkerSpec& spec, ExitHandler on_exit) override {
    int out[2], err[2], exec_err[2];
    if (::pipe2(out, O_CLOEXEC) != 0) throw_errno("pipe2");
    UniqueFd out_r(out[0]), out_w(out[1]);
    if (::pipe2(err, O_CLOEXEC) != 0) throw_errno("pipe2");
    UniqueFd err_r(err[0]), err_w(err[1]);
    if (::pipe2(exec_err, O_CLOEXEC) != 0) throw_errno("pipe2");
    UniqueFd exec_r(exec_err[0]), exec_w(exec_err[1]);

    // Everything the child needs is prepared before fork: after it, only async-signal-safe calls.
    std::vector<std::string> argv_text = spec.argv, env_text = spec.env;
    std::vector<char*> argv, envp;
    for (auto& a : argv_text) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env_text) envp.push_back(e.data());
    envp.push_back(nullptr);
    const pid_t parent = ::getpid();
    sigset_t empty;
    sigemptyset(&empty);
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    for (int cpu : spec.cpus)
      if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(cpu, &cpus);
    const bool bind = !spec.cpus.empty();

    const pid_t pid = ::fork();
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
      if (bind) (void)::sched_setaffinity(0, sizeof cpus, &cpus);
      if (::dup2(out_w.get(), 1) < 0 || ::dup2(err_w.get(), 2) < 0) ::_exit(126);
      if (exec_w.get() != 3 && ::dup2(exec_w.get(), 3) < 0) ::_exit(126);
      ::fcntl(3, F_SETFD, FD_CLOEXEC);
      ::close_range(4, ~0U, 0);
      ::execve(spec.path.c_str(), argv.data(), envp.data());
      int e = errno;
      [[maybe_unused]] auto ignored = ::write(3, &e, sizeof e);
      ::_exit(127);
    }
    out_w.reset();  // the child's ends: EOF on the read ends once it is gone
    err_w.reset();
    exec_w.reset();
    try {
      return after_fork(spec, pid, std::move(on_exit), std::move(out_r), std::move(err_r), std::move(exec_r));
    } catch (...) {  // nothing may outlive a start that failed: its group killed and reaped here
      ::kill(-pid, SIGKILL);
      ::kill(pid, SIGKILL);
      reaper_.disown(pid);
      while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
      }
      throw;
    }
  }

  void collect() override { reaper_.reap(); }

  void release(pid_t pid) override {
    reaper_.disown(pid);
    if (watchdog_) watchdog_->forget(pid);
  }

  void end_leftovers() override { reaper_.kill_unowned(); }

 private:
  StartedProcess after_fork(const WorkerSpec& spec, pid_t pid, ExitHandler on_exit, UniqueFd out_r, UniqueFd err_r,
                            UniqueFd exec_r) {
    // owned from here on: an exit before the first collect() is handed over, not taken for an orphan's
    reaper_.own(pid, std::move(on_exit));
    if (::setpgid(pid, pid) != 0 && errno != EACCES && errno != ESRCH)
      spdlog::warn("warning: setpgid({}): {}", pid, std::strerror(errno));
    if (watchdog_) watchdog_->watch(pid);
    StartedProcess started;
    started.pid = pid;
    int child_errno = 0;
    ssize_t got;
    do got = ::read(exec_r.get(), &child_errno, sizeof child_errno);
    while (got < 0 && errno == EINTR);
    if (got == static_cast<ssize_t>(sizeof child_errno))
      started.exec_error = fmt::format("cannot execute {}: {}", spec.path, std::strerror(child_errno));
    started.stdout_read = std::move(out_r);
    started.stderr_read = std::move(err_r);
    return started;
  }

  Reaper& reaper_;
  Watchdog* watchdog_;
};

}  // namespace

std::unique_ptr<ProcessBackend> make_exec_backend(Reaper& reaper, Watchdog* watchdog) {
  return std::make_unique<ExecBackend>(reaper, watchdog);
}

}  // namespace elastrun::launcher
