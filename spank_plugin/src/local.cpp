// srun (local context): options are validated by their callbacks (plugin.cpp) before anything is
// submitted.
//
// --torch-env: nothing to do here. MASTER_ADDR is resolved on the compute side (remote.cpp)
// because srun cannot hand it to every task: in a heterogeneous step slurm_spank_local_user_init
// runs once, for the last component only, and with --export=NONE nothing srun adds to its
// environment reaches the tasks (both verified on Slurm 22.05).
//
// --elastic: srun hosts the rendezvous store, so no compute node is special and the store dies
// exactly when the step does. local_user_init (after the allocation, before the launch) forks
// `elastrun store-serve` (the agent binary; the plugin links no store code), waits for its port
// and publishes port, run id and a fresh token to the tasks through srun's environment (as
// SLURM_ELASTRUN_*: srun passes SLURM_* variables on even with --export=NONE, verified);
// slurm_spank_exit stops and reaps it. If srun dies without calling exit, the helper sees end of
// file on its lifeline pipe (srun holds the only write end) and exits by itself.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common.hpp"
#include "elastic.hpp"
#include "elastrun/util/random.hpp"
#include "elastrun/util/unique_fd.hpp"

extern char** environ;

namespace elastrun::spank::local {
namespace {

using Clock = std::chrono::steady_clock;

using Fd = elastrun::util::UniqueFd;

std::pair<Fd, Fd> make_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error(fmt::format("pipe2: {}", std::strerror(errno)));
  return {Fd(fds[0]), Fd(fds[1])};
}

// The store helper: `elastrun store-serve`, a child of srun in a process group of its own
// (the terminal's Ctrl-C goes to srun, which forwards it to the step, not to the store).
class StoreHelper {
 public:
  StoreHelper(const std::string& agent, const std::string& run_id, const std::string& token) {
    auto [ready_r, ready_w] = make_pipe();
    auto [life_r, life_w] = make_pipe();
    // Everything the child needs is built before fork (srun has threads).
    const std::string ready_fd = std::to_string(ready_w.get());
    const std::string life_fd = std::to_string(life_r.get());
    std::vector<std::string> args = {agent,   "store-serve", "--run-id", run_id,          "--rdzv-auth",
                                     "token", "--ready-fd",  ready_fd,   "--lifeline-fd", life_fd};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_storage;
    for (char** e = environ; e && *e; ++e)
      if (!std::string_view(*e).starts_with("ELASTRUN_RDZV_TOKEN=")) env_storage.emplace_back(*e);
    env_storage.push_back(fmt::format("{}={}", kTokenEnv, token));
    std::vector<char*> envp;
    for (auto& e : env_storage) envp.push_back(e.data());
    envp.push_back(nullptr);
    const int keep[2] = {ready_w.get(), life_r.get()};
    const std::string exec_error = fmt::format(
        "elastrun: error: --elastic: cannot run the elastrun agent '{}' for the rendezvous store "
        "(site argument agent=, or {})\n",
        agent, kAgentEnv);

    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error(fmt::format("fork: {}", std::strerror(errno)));
    if (pid_ == 0) {
      ::setpgid(0, 0);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      for (int sig = 1; sig < NSIG; ++sig)
        if (sig != SIGKILL && sig != SIGSTOP) ::signal(sig, SIG_DFL);
      if (const int null = ::open("/dev/null", O_RDONLY); null >= 0) {  // srun's stdin is the step's
        ::dup2(null, 0);
        if (null != 0) ::close(null);
      }
      ::close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);   // none of srun's descriptors leak in,
      for (int fd : keep) ::fcntl(fd, F_SETFD, 0);  // only these two survive exec
      ::execve(argv[0], argv.data(), envp.data());
      (void)!::write(2, exec_error.data(), exec_error.size());
      _exit(127);
    }
    ready_w.reset();
    life_r.reset();
    lifeline_ = std::move(life_w);
    port_ = wait_ready(ready_r.get(), agent);
  }
  ~StoreHelper() { stop(); }
  StoreHelper(const StoreHelper&) = delete;
  StoreHelper& operator=(const StoreHelper&) = delete;

  std::uint16_t port() const { return port_; }
  pid_t pid() const { return pid_; }

  // SIGTERM, up to 5 s, SIGKILL; always reaped. Safe to call twice.
  void stop() noexcept {
    lifeline_.reset();
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    bool killed = false;
    while (true) {
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_ || (r < 0 && errno == ECHILD)) break;
      if (r < 0 && errno != EINTR) break;
      if (!killed && Clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        killed = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    pid_ = -1;
  }

 private:
  std::uint16_t wait_ready(int fd, const std::string& agent) {
    std::string got;
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (got.find('\n') == std::string::npos) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) {
        stop();
        throw std::runtime_error(fmt::format("{} store-serve did not report its port within 30 s", agent));
      }
      pollfd p{fd, POLLIN, 0};
      const int rc = ::poll(&p, 1, static_cast<int>(left));
      if (rc < 0 && errno == EINTR) continue;
      if (rc < 0) throw std::runtime_error(fmt::format("poll: {}", std::strerror(errno)));
      if (rc == 0) continue;
      char buf[32];
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        stop();
        throw std::runtime_error(
            fmt::format("{} store-serve exited before reporting its port (is it an elastrun binary? set the "
                        "site argument agent= or ELASTRUN_SPANK_AGENT)",
                        agent));
      }
      got.append(buf, static_cast<std::size_t>(n));
    }
    const long port = std::strtol(got.c_str(), nullptr, 10);
    if (port <= 0 || port > 65535) {
      stop();
      throw std::runtime_error(fmt::format("{} store-serve reported '{}' as its port", agent, got));
    }
    return static_cast<std::uint16_t>(port);
  }

  pid_t pid_ = -1;
  Fd lifeline_;
  std::uint16_t port_ = 0;
};

std::optional<StoreHelper>& store() {
  static std::optional<StoreHelper> s;
  return s;
}

uint32_t get_u32(spank_t sp, spank_item_t item, const char* name) {
  uint32_t value = 0;
  const spank_err_t rc = spank_get_item(sp, item, &value);
  if (rc != ESPANK_SUCCESS) throw std::runtime_error(fmt::format("spank_get_item({}): {}", name, spank_error_text(rc)));
  return value;
}

void set_env(const char* name, const std::string& value) {
  if (::setenv(name, value.c_str(), 1) != 0)
    throw std::runtime_error(fmt::format("setenv({}): {}", name, std::strerror(errno)));
}

// srun's own command line, from /proc/self/cmdline (the plugin runs inside srun here).
std::vector<std::string> own_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> args;
  for (std::string arg; std::getline(in, arg, '\0');) args.push_back(arg);
  return args;
}

int elastic_user_init(spank_t sp) {
  const auto& s = state();
  {
    // With --multi-prog slurmstepd execs each task's own line of the config file: the agent
    // could not wrap them, and the tasks would run bare with no torch environment.
    int argc = 0;
    char** argv = nullptr;
    std::vector<std::string> program;
    if (spank_get_item(sp, S_JOB_ARGV, &argc, &argv) == ESPANK_SUCCESS && argv) program.assign(argv, argv + argc);
    if (srun_option_given(own_command_line(), program, "--multi-prog")) {
      log_error("--elastic does not support --multi-prog (each task would run without the agent); run one program");
      return -1;
    }
  }
  const uint32_t job = get_u32(sp, S_JOB_ID, "S_JOB_ID");
  const uint32_t step = get_u32(sp, S_JOB_STEPID, "S_JOB_STEPID");
  const uint32_t nnodes = get_u32(sp, S_JOB_NNODES, "S_JOB_NNODES");
  const uint32_t ntasks = get_u32(sp, S_JOB_TOTAL_TASK_COUNT, "S_JOB_TOTAL_TASK_COUNT");
  if (ntasks != nnodes) {
    log_error(
        "--elastic runs one elastrun agent per node, but step {}.{} has {} tasks on {} nodes; "
        "use srun --ntasks-per-node=1 (workers per node: --elastic-nproc=N)",
        job, step, ntasks, nnodes);
    return -1;
  }
  if (s.elastic_range.min > static_cast<int>(nnodes)) {
    log_error("--elastic={}:{}: the step has only {} node(s), fewer than MIN; use -N{} or more", s.elastic_range.min,
              s.elastic_range.max, nnodes, s.elastic_range.min);
    return -1;
  }
  const char* restarts = std::getenv("SLURM_RESTART_COUNT");
  const std::string run_id = elastic_run_id(job, step, restarts ? restarts : "");
  const std::string agent = agent_path(std::getenv(kAgentEnv));
  const std::string token = elastrun::util::random_hex(24);
  store().emplace(agent, run_id, token);
  set_env(kStorePortEnv, std::to_string(store()->port()));
  set_env(kRunIdEnv, run_id);
  set_env(kStepTokenEnv, token);
  log_verbose("step {}.{}: --elastic store (pid {}) listens on port {}, run '{}', agent {}", job, step, store()->pid(),
              store()->port(), run_id, agent);
  return 0;
}

}  // namespace

int init_post_opt(spank_t) {
  const auto& s = state();
  // Checked once every option (command line and SLURM_SPANK_* form) is in: --elastic and an
  // explicit --torch-env exclude each other (the agent gives its workers the torch variables).
  if (s.elastic && s.torch_env_option && s.torch_env) {
    log_error(
        "--elastic and --torch-env exclude each other: under --elastic the elastrun agent gives "
        "its workers RANK, WORLD_SIZE, MASTER_ADDR, ...; drop --torch-env (or --torch-env=no)");
    return -1;
  }
  log_debug("site: torch_env={} master_addr={} run_id={} agent={} tmpdir={}", s.site.torch_env ? "yes" : "no",
            to_string(s.site.master_addr), to_string(s.site.run_id), agent_path(nullptr), s.site.tmpdir);
  return 0;
}

int user_init(spank_t sp) {
  if (state().elastic) {
    try {
      return elastic_user_init(sp);
    } catch (const std::exception& e) {
      log_error("--elastic: {}", e.what());
      return -1;
    }
  }
  if (!state().torch_env) return 0;
  uint32_t job = 0, step = 0;
  spank_err_t rc = spank_get_item(sp, S_JOB_ID, &job);
  if (rc != ESPANK_SUCCESS) {
    log_error("spank_get_item(S_JOB_ID): {}", spank_error_text(rc));
    return -1;
  }
  rc = spank_get_item(sp, S_JOB_STEPID, &step);
  if (rc != ESPANK_SUCCESS) {
    log_error("spank_get_item(S_JOB_STEPID): {}", spank_error_text(rc));
    return -1;
  }
  log_verbose("step {}.{}: tasks get the torch.distributed environment (--torch-env)", job, step);
  return 0;
}

int exit(spank_t) {
  if (store()) {
    store()->stop();
    store().reset();
    log_debug("--elastic store stopped");
  }
  return 0;
}

}  // namespace elastrun::spank::local
