#include "agent.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "elastrun/rdzv/auth.hpp"
#include "elastrun/rdzv/bootstrap.hpp"
#include "elastrun/rdzv/env.hpp"
#include "elastrun/rdzv/etcd.hpp"
#include "elastrun/rdzv/hostlist.hpp"
#include "elastrun/rdzv/rendezvous.hpp"
#include "elastrun/rdzv/store.hpp"
#include "error_file.hpp"
#include "options.hpp"
#include "workers.hpp"

extern char** environ;

namespace elastrun::launcher {
namespace {

namespace fs = std::filesystem;
using namespace elastrun::rdzv;
using Clock = std::chrono::steady_clock;

// After a local worker failure: how long to look for a membership change that explains it.
constexpr Millis kFailureSettle{300};

// ---- agent signals: SIGTERM/SIGINT/SIGHUP/SIGQUIT ------------------------------------------
// Blocked in every thread (set before any thread starts) and taken by one thread with sigwait.
// While workers run, the monitor loop stops them (SIGTERM, grace, SIGKILL) and exits 128+sig;
// with no workers (rendezvous, exit barrier) the agent exits at once.
std::atomic<int> g_signal{0};
std::atomic<bool> g_workers_active{false};

sigset_t stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT}) sigaddset(&set, sig);
  return set;
}

void start_signal_thread() {
  sigset_t set = stop_signals();
  if (int rc = pthread_sigmask(SIG_BLOCK, &set, nullptr); rc != 0)
    throw std::system_error(rc, std::generic_category(), "pthread_sigmask");
  std::thread([set] {
    while (true) {
      int sig = 0;
      if (sigwait(&set, &sig) != 0) continue;
      g_signal = sig;
      if (!g_workers_active) {
        spdlog::info("received {}: no workers running; exiting {}", signal_name(sig), 128 + sig);
        spdlog::default_logger()->flush();
        ::_exit(128 + sig);
      }
      spdlog::info("received {}: stopping workers", signal_name(sig));
    }
  }).detach();
}

void ensure_std_fds() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) >= 0 || errno != EBADF) continue;
    int null = ::open("/dev/null", O_RDWR);  // takes the lowest free number, i.e. `fd`
    if (null < 0) throw std::system_error(errno, std::generic_category(), "open /dev/null");
  }
}

enum class State { Rendezvous, StartWorkers, Monitor, Succeeded, Failed, Restart, MembershipChanged };
std::string_view to_string(State s) {
  switch (s) {
    case State::Rendezvous: return "RENDEZVOUS";
    case State::StartWorkers: return "START_WORKERS";
    case State::Monitor: return "MONITOR";
    case State::Succeeded: return "SUCCEEDED";
    case State::Failed: return "FAILED";
    case State::Restart: return "RESTART";
    case State::MembershipChanged: return "MEMBERSHIP_CHANGED";
  }
  return "?";
}

// A directory removed with everything in it when the agent ends (error files without --log-dir).
class TempDir {
 public:
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = fmt::format("{}/elastrun-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!::mkdtemp(pattern.data())) throw std::system_error(errno, std::generic_category(), "mkdtemp " + pattern);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

struct Failure {
  std::chrono::system_clock::time_point when;
  std::string node;
  int rank = 0;
  int local_rank = 0;
  int exit_code = 0;
  int signal = 0;
  int restart_count = 0;
  std::string error_file;
  std::optional<ErrorFileInfo> error;
  std::string exec_error;

  std::string how() const {
    return signal ? fmt::format("killed by {} ({})", signal_name(signal), signal)
                  : fmt::format("exited with code {}", exit_code);
  }
  std::string one_line() const {
    std::string line = fmt::format("rank {} (local rank {}, node {}) {}", rank, local_rank, node, how());
    if (!exec_error.empty()) line += ": " + exec_error;
    else if (error && !error->message.empty()) line += ": " + error->message;
    return line;
  }
};

std::string iso_time(std::chrono::system_clock::time_point t) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count() % 1000;
  return fmt::format("{:%Y-%m-%dT%H:%M:%S}.{:03}Z", fmt::gmtime(std::chrono::system_clock::to_time_t(t)), ms);
}

class Agent {
 public:
  Agent(const AgentOptions& o, const DetectedEnv& env) : o_(o), env_(env) {}
  int run();

 private:
  void bootstrap();
  std::vector<WorkerSpec> worker_specs(const RoundResult& round);
  void record(const WorkerExit& e);
  void print_summary() const;
  int closed_exit(const std::string& what);
  void linger_for_peers();
  void state(State s, const std::string& what) {
    spdlog::info("state {}{}{}", to_string(s), what.empty() ? "" : " ", what);
  }

  const AgentOptions& o_;
  const DetectedEnv& env_;
  BootstrapPlan plan_;
  AuthConfig auth_;
  std::unique_ptr<StoreServer> server_, standby_;
  std::unique_ptr<Rendezvous> rdzv_;
  int min_nodes_ = 1, max_nodes_ = 1;
  std::string command_path_;
  std::vector<std::string> command_argv_;
  std::optional<TempDir> tmp_;
  fs::path attempt_base_;
  int attempt_ = 0;  // local starts of the workers, for per-attempt files
  std::int64_t restart_count_ = 0;
  std::vector<Failure> failures_;
  std::vector<WorkerSpec> current_specs_;
};

void Agent::bootstrap() {
  const bool etcd = o_.rdzv_backend == "etcd" || o_.rdzv_backend == "etcd-v2";
  const bool standalone =
      o_.standalone || (!etcd && !env_.slurm && o_.rdzv_endpoint.empty() && o_.master_addr.empty() &&
                        o_.max_nodes.value_or(1) == 1);
  std::string endpoint = o_.rdzv_endpoint;
  if (endpoint.empty() && !o_.master_addr.empty())
    endpoint = fmt::format("{}:{}", o_.master_addr, o_.master_port.value_or(29500));

  if (standalone) {
    auth_ = o_.rdzv_auth == "auto" ? AuthConfig{} : auth_from_option(o_.rdzv_auth);
    plan_.run_id = o_.rdzv_id.empty() ? fmt::format("standalone-{}", ::getpid()) : o_.rdzv_id;
    plan_.me.node_name = env_.hostname.empty() ? "localhost" : env_.hostname;
    plan_.me.address = "127.0.0.1";
    plan_.me.pid = ::getpid();
    plan_.me.nproc = o_.nproc_per_node;
    plan_.me.role = o_.role;
    plan_.store_host = plan_.store_address = "127.0.0.1";
    plan_.host_store = true;
    StoreServerOptions so;
    so.bind_address = "127.0.0.1";
    so.run_id = plan_.run_id;
    so.auth = auth_;
    server_ = std::make_unique<StoreServer>(so);
    plan_.store_port = server_->port();
    min_nodes_ = max_nodes_ = 1;
  } else {
    auth_ = auth_from_option(o_.rdzv_auth);
    plan_ = plan_bootstrap(env_, {.endpoint = endpoint, .run_id = o_.rdzv_id, .is_host = o_.is_host,
                                  .nproc = o_.nproc_per_node, .role = o_.role});
    const int step_nodes = env_.slurm ? env_.placement.num_nodes : 1;
    min_nodes_ = o_.min_nodes.value_or(step_nodes);
    max_nodes_ = o_.max_nodes.value_or(std::max(step_nodes, min_nodes_));
    if (env_.slurm && env_.placement.local_world_size > 1)
      spdlog::warn("warning: {} Slurm tasks on this node; run one agent per node (srun --ntasks-per-node=1)",
                   env_.placement.local_world_size);
  }
  if (o_.node_rank) plan_.me.node_index = *o_.node_rank;
  if (!o_.local_addr.empty()) plan_.me.address = o_.local_addr;
  spdlog::set_pattern(fmt::format("[elastrun node {}] %v", plan_.me.node_name));

  std::unique_ptr<KvBackend> kv, hb;
  StoreConnector connector;
  if (etcd) {
    kv = std::make_unique<EtcdKv>(endpoint);
    hb = std::make_unique<EtcdKv>(endpoint);
  } else {
    if (plan_.host_store && !server_) {
      StoreServerOptions so;
      so.port = plan_.store_port;
      so.fallback_ports = plan_.fallback_ports;
      so.run_id = plan_.run_id;
      so.auth = auth_;
      server_ = std::make_unique<StoreServer>(so);
      spdlog::info("hosting the rendezvous store on port {}", server_->port());
    }
    if (!server_) {
      // a standby store on every other agent: survivors fail over to it if the store host dies
      StoreServerOptions so;
      so.run_id = plan_.run_id;
      so.auth = auth_;
      standby_ = std::make_unique<StoreServer>(so);
    }
    plan_.me.store_port = server_ ? server_->port() : standby_->port();
    connector = [auth = auth_, run_id = plan_.run_id](const std::string& address,
                                                       std::uint16_t port) -> std::unique_ptr<KvBackend> {
      return std::make_unique<StoreClient>(address, port, auth, run_id, Millis(1000));
    };
    kv = connect_store(plan_, auth_, o_.join_timeout);
    hb = connect_store(plan_, auth_, o_.join_timeout);
  }
  RendezvousConfig config{.run_id = plan_.run_id, .min_nodes = min_nodes_, .max_nodes = max_nodes_,
                          .join_timeout = o_.join_timeout, .last_call_timeout = o_.last_call_timeout,
                          .heartbeat_timeout = o_.heartbeat_timeout};
  rdzv_ = std::make_unique<Rendezvous>(std::move(kv), std::move(hb), config, plan_.me, connector);
  spdlog::info("run '{}', backend {}{}, store {}:{}, nodes {}:{}, {} worker(s) per node", plan_.run_id,
               standalone ? "standalone" : o_.rdzv_backend, plan_.host_store ? " (hosted here)" : "",
               etcd ? endpoint : plan_.store_address, etcd ? 0 : plan_.store_port, min_nodes_,
               max_nodes_, o_.nproc_per_node);
}

std::vector<WorkerSpec> Agent::worker_specs(const RoundResult& r) {
  static const std::vector<std::string> kSetByUs = {
      "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
      "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
      "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
      "TORCHELASTIC_USE_AGENT_STORE", "ELASTRUN_GENERATION", "ELASTRUN_NODE", "NODE_RANK"};
  std::vector<std::string> base;
  bool omp_set = false;
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv(*e);
    auto name = kv.substr(0, kv.find('='));
    if (name == "OMP_NUM_THREADS") omp_set = true;
    if (std::find(kSetByUs.begin(), kSetByUs.end(), name) == kSetByUs.end()) base.emplace_back(kv);
  }
  const int k = o_.nproc_per_node;
  const fs::path attempt_dir = attempt_base_ / fmt::format("attempt_{}", attempt_);
  std::vector<WorkerSpec> specs;
  for (int local = 0; local < k; ++local) {
    WorkerSpec s;
    s.local_rank = local;
    s.global_rank = r.rank_offset + local;
    s.path = command_path_;
    s.argv = command_argv_;
    const fs::path dir = attempt_dir / std::to_string(local);
    fs::create_directories(dir);
    const std::string error_file = (dir / "error.json").string();
    std::error_code ec;
    fs::remove(error_file, ec);
    s.env = base;
    auto set = [&](std::string_view key, const auto& value) { s.env.push_back(fmt::format("{}={}", key, value)); };
    set("RANK", s.global_rank);
    set("LOCAL_RANK", local);
    set("GROUP_RANK", r.group_rank);
    set("ROLE_RANK", r.role_rank_offset + local);
    set("ROLE_NAME", o_.role);
    set("LOCAL_WORLD_SIZE", k);
    set("WORLD_SIZE", r.world_size);
    set("GROUP_WORLD_SIZE", r.group_world_size);
    set("ROLE_WORLD_SIZE", r.role_world_size);
    set("MASTER_ADDR", r.master_addr);
    set("MASTER_PORT", r.master_port);
    set("TORCHELASTIC_RESTART_COUNT", restart_count_);
    set("TORCHELASTIC_MAX_RESTARTS", o_.max_restarts);
    set("TORCHELASTIC_RUN_ID", plan_.run_id);
    set("TORCHELASTIC_ERROR_FILE", error_file);
    set("TORCHELASTIC_USE_AGENT_STORE", "False");
    set("ELASTRUN_GENERATION", r.generation);
    set("ELASTRUN_NODE", plan_.me.node_name);
    if (!omp_set && k > 1) set("OMP_NUM_THREADS", 1);

    const bool shown = !o_.local_ranks_filter || o_.local_ranks_filter->contains(local);
    const int redirect = o_.log_dir.empty() ? 0 : o_.redirects.for_rank(local);
    const int tee = o_.log_dir.empty() ? 0 : o_.tee.for_rank(local);
    s.console_stdout = shown && (!(redirect & 1) || (tee & 1));
    s.console_stderr = shown && (!(redirect & 2) || (tee & 2));
    if ((redirect | tee) & 1) s.stdout_file = (dir / "stdout.log").string();
    if ((redirect | tee) & 2) s.stderr_file = (dir / "stderr.log").string();
    specs.push_back(std::move(s));
  }
  return specs;
}

void Agent::record(const WorkerExit& e) {
  Failure f;
  f.when = e.when;
  f.node = plan_.me.node_name;
  f.rank = e.global_rank;
  f.local_rank = e.local_rank;
  f.exit_code = e.exit_code;
  f.signal = e.signal;
  f.restart_count = static_cast<int>(restart_count_);
  f.exec_error = e.exec_error;
  for (const auto& s : current_specs_)
    if (s.local_rank == e.local_rank)
      for (const auto& kv : s.env)
        if (kv.starts_with("TORCHELASTIC_ERROR_FILE=")) f.error_file = kv.substr(24);
  if (!f.error_file.empty()) f.error = read_error_file(f.error_file);
  spdlog::warn("worker {} (pid {}) failed: {}", f.rank, e.pid, f.one_line());
  failures_.push_back(std::move(f));
}

void Agent::print_summary() const {
  if (failures_.empty()) return;
  auto root = std::min_element(failures_.begin(), failures_.end(),
                               [](const Failure& a, const Failure& b) { return a.when < b.when; });
  std::string out = fmt::format(
      "================ elastrun: job failed (run '{}') ================\n"
      "root cause (first failure):\n"
      "  time       : {}\n  node       : {}\n  rank       : {} (local rank {})\n  {:<11}: {}\n"
      "  restart    : {} of {}\n",
      plan_.run_id, iso_time(root->when), root->node, root->rank, root->local_rank,
      root->signal ? "signal" : "exit code",
      root->signal ? fmt::format("{} ({})", signal_name(root->signal), root->signal) : std::to_string(root->exit_code),
      root->restart_count, o_.max_restarts);
  if (!root->exec_error.empty()) out += fmt::format("  error      : {}\n", root->exec_error);
  if (root->error) {
    out += fmt::format("  error file : {}\n  message    : {}\n", root->error_file, root->error->message);
    if (!root->error->traceback.empty()) {
      out += "  traceback  :\n";
      std::string_view tb = root->error->traceback;
      while (!tb.empty()) {
        auto nl = tb.find('\n');
        out += fmt::format("    {}\n", tb.substr(0, nl));
        tb = nl == std::string_view::npos ? std::string_view{} : tb.substr(nl + 1);
      }
    }
  } else if (!root->error_file.empty()) {
    out += fmt::format("  error file : {} (not written; decorate main with torch.distributed.elastic.multiprocessing.errors.record)\n", root->error_file);
  }
  if (failures_.size() > 1) {
    out += "other failures on this node:\n";
    for (const auto& f : failures_)
      if (&f != &*root) out += fmt::format("  {} {}\n", iso_time(f.when), f.one_line());
  }
  out += "=================================================================";
  std::string_view rest = out;
  while (!rest.empty()) {
    auto nl = rest.find('\n');
    spdlog::error("{}", rest.substr(0, nl));
    rest = nl == std::string_view::npos ? std::string_view{} : rest.substr(nl + 1);
  }
}

int Agent::closed_exit(const std::string& what) {
  const bool ok = what.ends_with(": succeeded");
  spdlog::info("{}; exiting {}", what, ok ? 0 : 1);
  return ok ? 0 : 1;
}

// The store (or a standby we failed over to) lives in this process: keep it up until the
// other agents have left (they need it to see the close / pass the exit barrier), bounded.
void Agent::linger_for_peers() {
  rdzv_.reset();  // revokes our lease, closes our connections
  for (auto* s : {server_.get(), standby_.get()}) {
    if (!s) continue;
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (s->stats().connections > 0 && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int Agent::run() {
  // the command, resolved once (a missing program is a usage error, before any rendezvous)
  const bool python = !o_.no_python && (o_.module || o_.run_path || o_.program.ends_with(".py"));
  if (python) {
    auto interp = find_executable(o_.python);
    if (!interp) throw UsageError(fmt::format("python interpreter '{}' not found (set ELASTRUN_PYTHON)", o_.python));
    command_path_ = *interp;
    command_argv_ = {o_.python, "-u"};
    if (o_.module) command_argv_.push_back("-m");
  } else {
    auto exe = find_executable(o_.program);
    if (!exe) throw UsageError(fmt::format("program '{}' not found or not executable", o_.program));
    command_path_ = *exe;
  }
  command_argv_.push_back(o_.program);
  command_argv_.insert(command_argv_.end(), o_.program_args.begin(), o_.program_args.end());

  bootstrap();
  if (o_.log_dir.empty()) {
    tmp_.emplace();
    attempt_base_ = tmp_->path();
  } else {
    attempt_base_ = fs::path(o_.log_dir) / plan_.run_id;
  }
  for (const auto& key : o_.ignored_rdzv_conf) spdlog::info("--rdzv-conf {}: accepted, no effect here", key);

  int rc = 1;
  {
    std::optional<WorkerGroup> group;
    State st = State::Rendezvous;
    Change change = Change::None;
    bool done = false;
    while (!done) {
      switch (st) {
        case State::Rendezvous: {
          if (int sig = g_signal.load()) {
            spdlog::info("stopped by {}; exiting {}", signal_name(sig), 128 + sig);
            rc = 128 + sig;
            done = true;
            break;
          }
          state(st, fmt::format("run '{}' nodes {}:{}", plan_.run_id, min_nodes_, max_nodes_));
          const auto t0 = Clock::now();
          try {
            const auto& r = rdzv_->next_round();
            restart_count_ = rdzv_->add_to_counter("restarts", 0);
            state(st, fmt::format(
                          "round {} formed in {} ms: group rank {} of {}, ranks {}..{} of {}, master {}:{}",
                          r.generation,
                          std::chrono::duration_cast<Millis>(Clock::now() - t0).count(), r.group_rank,
                          r.group_world_size, r.rank_offset, r.rank_offset + o_.nproc_per_node - 1,
                          r.world_size, r.master_addr, r.master_port));
            st = State::StartWorkers;
          } catch (const RendezvousClosed& e) {
            rc = closed_exit(e.what());
            done = true;
          }
          break;
        }
        case State::StartWorkers: {
          current_specs_ = worker_specs(rdzv_->current());
          g_workers_active = true;
          group.emplace(current_specs_);
          std::string pids;
          for (auto p : group->pids()) pids += fmt::format("{}{}", pids.empty() ? "" : ",", p);
          state(st, fmt::format("attempt {} restart {}: {} worker(s) pids {} ({})", attempt_, restart_count_,
                                o_.nproc_per_node, pids, command_path_));
          ++attempt_;
          st = State::Monitor;
          break;
        }
        case State::Monitor: {
          state(st, "");
          bool failed = false;
          change = Change::None;
          while (true) {
            if (int sig = g_signal.load()) {
              spdlog::info("stopping workers on {} (grace {} ms)", signal_name(sig), o_.stop_grace.count());
              group->stop(o_.stop_grace);
              group.reset();
              g_workers_active = false;
              rc = 128 + sig;
              done = true;
              break;
            }
            for (const auto& e : group->poll_exits()) {
              if (e.ok()) {
                spdlog::info("worker {} exited 0", e.global_rank);
              } else {
                record(e);
                failed = true;
              }
            }
            if (failed) {
              st = State::Failed;
              break;
            }
            if (group->all_exited()) {
              st = State::Succeeded;
              break;
            }
            change = rdzv_->wait_for_change(o_.monitor_interval);
            if (change != Change::None) {
              st = State::MembershipChanged;
              break;
            }
          }
          break;
        }
        case State::Failed: {
          state(st, failures_.back().one_line());
          // A failure caused by a lost peer or by another node's failure (a collective broke)
          // is a membership change, not a restart of ours: look for one during a short settle
          // window before counting. The other local workers keep running meanwhile.
          change = rdzv_->wait_for_change(kFailureSettle);
          for (const auto& e : group->poll_exits())
            if (!e.ok()) record(e);
          if (change == Change::Closed) {
            // someone gave up: stop, report, exit with the close reason (below)
          } else if (change == Change::MemberLost || change == Change::Fenced || change == Change::StoreLost ||
                     change == Change::Reform) {
            spdlog::info("the failure coincides with a membership change ({}): not counted against --max-restarts",
                         to_string(change));
          } else {
            const auto restarts = rdzv_->add_to_counter("restarts", 1);
            if (restarts > o_.max_restarts) {
              // tell the other agents first, then stop our workers
              const auto reason = fmt::format("failed: {} (--max-restarts={} used up)",
                                              failures_.front().one_line(), o_.max_restarts);
              rdzv_->close(reason);
              spdlog::info("stopping local workers (grace {} ms)", o_.stop_grace.count());
              group->stop(o_.stop_grace);
              group.reset();
              g_workers_active = false;
              print_summary();
              spdlog::error("error: giving up after {} restart(s): {}", restarts - 1, failures_.back().one_line());
              rc = 1;
              done = true;
              break;
            }
            rdzv_->request_new_round();  // everyone else sees Reform at once
            state(State::Restart, fmt::format("restart {} of {} (job-wide)", restarts, o_.max_restarts));
          }
          spdlog::info("stopping local workers (grace {} ms)", o_.stop_grace.count());
          group->stop(o_.stop_grace);
          group.reset();
          g_workers_active = false;
          if (change == Change::Closed) {
            try {
              rdzv_->next_round();
            } catch (const RendezvousClosed& e) {
              print_summary();
              rc = closed_exit(e.what());
              done = true;
              break;
            }
          }
          st = State::Rendezvous;
          break;
        }
        case State::MembershipChanged: {
          state(st, change == Change::Closed
                        ? std::string("rendezvous closed by another agent: stopping workers")
                        : fmt::format("{}: stopping workers, re-forming (no restart counted)", to_string(change)));
          group->stop(o_.stop_grace);
          group.reset();
          g_workers_active = false;
          st = State::Rendezvous;
          break;
        }
        case State::Succeeded: {
          group->stop(Millis(0));  // all exited; drains the output relay
          group.reset();
          g_workers_active = false;
          state(st, fmt::format("all {} local worker(s) exited 0; exit barrier", o_.nproc_per_node));
          bool passed = false;
          try {
            passed = rdzv_->barrier("exit", o_.exit_barrier_timeout);
          } catch (const std::exception& e) {
            spdlog::warn("warning: exit barrier: {}", e.what());
          }
          if (!passed)
            spdlog::warn("warning: not every node reached the exit barrier within {} s",
                         o_.exit_barrier_timeout.count() / 1000);
          if (rdzv_->current().group_rank == 0) {
            try {
              rdzv_->close("succeeded");
            } catch (const std::exception& e) {
              spdlog::warn("warning: closing the rendezvous: {}", e.what());
            }
          }
          spdlog::info("done; exiting 0");
          rc = 0;
          done = true;
          break;
        }
        case State::Restart:
          st = State::Rendezvous;
          break;
      }
    }
  }
  linger_for_peers();
  return rc;
}

}  // namespace

int run_agent(int argc, char** argv) {
  spdlog::set_default_logger(spdlog::stderr_color_mt("elastrun"));
  spdlog::set_pattern("[elastrun] %v");
  std::optional<DetectedEnv> env;
  std::string env_error;
  try {
    env = detect_environment(current_environment(), expand_hostlist);
  } catch (const EnvError& e) {
    env_error = e.what();
  }
  AgentOptions options;
  try {
    if (parse_agent_options(argc, argv, env ? env->pet_overrides : std::map<std::string, std::string>{},
                            options) == ParseOutcome::Exit0)
      return 0;
  } catch (const UsageError& e) {
    fmt::print(stderr, "elastrun: error: {}; run 'elastrun --help'\n", e.what());
    return 2;
  }
  if (!env) {
    fmt::print(stderr, "elastrun: error: {}\n", env_error);
    return 1;
  }
  try {
    ensure_std_fds();
    struct sigaction ign{};
    ign.sa_handler = SIG_IGN;
    if (::sigaction(SIGPIPE, &ign, nullptr) != 0) throw std::system_error(errno, std::generic_category(), "sigaction");
    // orphaned grandchildren of workers are reparented to us, so we can reap and kill them
    if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) throw std::system_error(errno, std::generic_category(), "prctl");
    start_signal_thread();
    Agent agent(options, *env);
    return agent.run();
  } catch (const UsageError& e) {
    fmt::print(stderr, "elastrun: error: {}; run 'elastrun --help'\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    spdlog::error("error: {}", e.what());
    return 1;
  }
}

}  // namespace elastrun::launcher
