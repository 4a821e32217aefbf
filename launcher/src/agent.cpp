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
#include <functional>
#include <optional>
#include <thread>

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <nlohmann/json.hpp>

#include "elastrun/control.hpp"
#include "elastrun/rdzv/auth.hpp"
#include "elastrun/rdzv/bootstrap.hpp"
#include "elastrun/rdzv/env.hpp"
#include "elastrun/rdzv/etcd.hpp"
#include "elastrun/rdzv/hostlist.hpp"
#include "elastrun/rdzv/rendezvous.hpp"
#include "elastrun/rdzv/slurm_api.hpp"
#include "elastrun/rdzv/store.hpp"
#include "error_file.hpp"
#include "options.hpp"
#include "requeue.hpp"
#include "workers.hpp"

extern char** environ;

namespace elastrun::launcher {
namespace {

namespace fs = std::filesystem;
using namespace elastrun::rdzv;
using Clock = std::chrono::steady_clock;

// After a local worker failure: how long to look for a membership change that explains it.
constexpr Millis kFailureSettle{300};
// How often a multi-node agent looks for another agent's checkpoint-and-stop request.
constexpr Millis kStopRequestPoll{1000};
// Beyond --checkpoint-timeout: how long agents wait for each other after checkpointing.
constexpr Millis kCheckpointBarrierSlack{30'000};

// ---- agent signals -------------------------------------------------------------------------
// Blocked in every thread (set before any thread starts) and taken by one thread with sigwait.
// SIGINT/SIGHUP/SIGQUIT stop: while workers run, the monitor loop stops them (SIGTERM, grace,
// SIGKILL) and exits 128+sig; with no workers (rendezvous, exit barrier) the agent exits at once.
// SIGUSR1/SIGUSR2 (Slurm's --signal time-limit warning) and SIGTERM (preemption) ask the workers
// to checkpoint and stop through the control channel (state CHECKPOINT_STOP); once that is under
// way, further ones (e.g. Slurm's SIGTERM after our own requeue) are only logged.
std::atomic<int> g_signal{0};             // a stop signal
std::atomic<int> g_checkpoint_signal{0};  // a checkpoint-and-stop signal
std::atomic<bool> g_workers_active{false};
std::atomic<bool> g_checkpoint_stopping{false};
// While group rank 0 of the last round re-forms (no workers run), a time-limit or preemption
// signal cannot reach any worker: the newest checkpoint stands, so that agent requeues the job
// from the signal thread before exiting. The main thread sets the hook once, before the flag.
std::function<void(int)> g_requeue_in_rendezvous;
std::atomic<bool> g_requeuer_in_rendezvous{false};

bool is_checkpoint_signal(int sig) { return sig == SIGUSR1 || sig == SIGUSR2 || sig == SIGTERM; }

sigset_t agent_signals() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2}) sigaddset(&set, sig);
  return set;
}

void start_signal_thread() {
  sigset_t set = agent_signals();
  if (int rc = pthread_sigmask(SIG_BLOCK, &set, nullptr); rc != 0)
    throw std::system_error(rc, std::generic_category(), "pthread_sigmask");
  std::thread([set] {
    while (true) {
      int sig = 0;
      if (sigwait(&set, &sig) != 0) continue;
      if (is_checkpoint_signal(sig) && g_checkpoint_stopping) {
        spdlog::info("received {}: already stopping for a checkpoint; ignored", signal_name(sig));
        continue;
      }
      if (!g_workers_active) {
        if (is_checkpoint_signal(sig) && g_requeuer_in_rendezvous.load(std::memory_order_acquire)) {
          g_checkpoint_stopping = true;
          spdlog::info("received {} during the rendezvous (no workers running): the last checkpoint stands",
                       signal_name(sig));
          g_requeue_in_rendezvous(sig);
        }
        spdlog::info("received {}: no workers running; exiting {}", signal_name(sig), 128 + sig);
        spdlog::default_logger()->flush();
        ::_exit(128 + sig);
      }
      if (is_checkpoint_signal(sig)) {
        int none = 0;
        g_checkpoint_signal.compare_exchange_strong(none, sig);
        spdlog::info("received {}: asking workers to checkpoint and stop", signal_name(sig));
      } else {
        g_signal = sig;
        spdlog::info("received {}: stopping workers", signal_name(sig));
      }
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

enum class State { Rendezvous, StartWorkers, Monitor, Succeeded, Failed, Restart, MembershipChanged, CheckpointStop };
std::string_view to_string(State s) {
  switch (s) {
    case State::Rendezvous: return "RENDEZVOUS";
    case State::StartWorkers: return "START_WORKERS";
    case State::Monitor: return "MONITOR";
    case State::Succeeded: return "SUCCEEDED";
    case State::Failed: return "FAILED";
    case State::Restart: return "RESTART";
    case State::MembershipChanged: return "MEMBERSHIP_CHANGED";
    case State::CheckpointStop: return "CHECKPOINT_STOP";
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
  nlohmann::json to_json() const {
    nlohmann::json j = {
        {"time_ms", std::chrono::duration_cast<std::chrono::milliseconds>(when.time_since_epoch()).count()},
        {"node", node}, {"rank", rank}, {"local_rank", local_rank}, {"exit_code", exit_code},
        {"signal", signal}, {"restart_count", restart_count}, {"error_file", error_file},
        {"exec_error", exec_error}};
    if (error) j["error"] = {{"message", error->message}, {"traceback", error->traceback.substr(0, 4096)}};
    return j;
  }
  static std::optional<Failure> from_json(const std::string& text) {
    auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) return std::nullopt;
    Failure f;
    f.when = std::chrono::system_clock::time_point(std::chrono::milliseconds(j.value("time_ms", std::int64_t{0})));
    f.node = j.value("node", std::string());
    f.rank = j.value("rank", 0);
    f.local_rank = j.value("local_rank", 0);
    f.exit_code = j.value("exit_code", 0);
    f.signal = j.value("signal", 0);
    f.restart_count = j.value("restart_count", 0);
    f.error_file = j.value("error_file", std::string());
    f.exec_error = j.value("exec_error", std::string());
    if (j.contains("error") && j["error"].is_object())
      f.error = ErrorFileInfo{j["error"].value("message", std::string()), j["error"].value("traceback", std::string()), {}};
    return f;
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
  void print_summary();
  std::vector<Failure> job_failures();
  std::optional<State> checkpoint_stop(std::optional<WorkerGroup>& group, int& rc);
  Change checkpoint_before_scale_up(WorkerGroup& group);
  bool stop_requested_elsewhere();
  // `signal`: the stop signal behind the request (SIGTERM is checked with slurmctld), or 0.
  bool request_requeue(FailureClass cls, const std::vector<std::string>& exclude, int signal);
  void write_control(elastrun::control::Request request);
  void requeue_failed_job();
  bool killed_by_slurm_stop_signal(const std::vector<WorkerExit>& exits);
  void requeue_after_node_loss();
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
  bool summary_printed_ = false;
  // checkpoint-and-stop (state CHECKPOINT_STOP)
  std::string control_path_;      // this attempt's control file (ELASTRUN_CONTROL_FILE)
  std::uint64_t control_sequence_ = 0;
  FailureClass stop_class_ = FailureClass::TimeLimit;
  int stop_signal_ = 0;           // the signal that asked for it, 0 if a worker or a peer did
  std::string stop_reason_;
  std::vector<WorkerExit> attempt_exits_;  // this attempt's exits seen in MONITOR
  Clock::time_point next_stop_poll_{};
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
      "TORCHELASTIC_USE_AGENT_STORE", "ELASTRUN_GENERATION", "ELASTRUN_NODE", "NODE_RANK",
      "ELASTRUN_CONTROL_FILE", "ELASTRUN_CHECKPOINT_DIR", "ELASTRUN_CHECKPOINTED_EXIT_CODE"};
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
  // a fresh control channel per attempt: a new attempt never sees an old request
  fs::create_directories(attempt_dir);
  control_path_ = (attempt_dir / "control").string();
  control_sequence_ = 0;
  std::error_code ec;
  fs::remove(control_path_ + elastrun::control::kSeenSuffix, ec);
  write_control(elastrun::control::Request::None);
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
    set("ELASTRUN_CONTROL_FILE", control_path_);
    set("ELASTRUN_CHECKPOINTED_EXIT_CODE", elastrun::control::kCheckpointedExitCode);
    if (!o_.checkpoint_dir.empty()) set("ELASTRUN_CHECKPOINT_DIR", o_.checkpoint_dir);
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
  // for the job-wide summary on group rank 0; best effort (the store may be gone)
  try {
    rdzv_->publish(fmt::format("failures/{}.{}/{:06}", plan_.me.node_name, plan_.me.pid, failures_.size()),
                   f.to_json().dump());
  } catch (const std::exception& ex) {
    spdlog::warn("warning: publishing the failure for the job-wide summary: {}", ex.what());
  }
  failures_.push_back(std::move(f));
}

// Every agent's published failures (ours included); ours alone if the store cannot be read.
std::vector<Failure> Agent::job_failures() {
  std::vector<Failure> all;
  try {
    for (const auto& [key, value] : rdzv_->read_prefix("failures/"))
      if (auto f = Failure::from_json(value)) all.push_back(std::move(*f));
  } catch (const std::exception& e) {
    spdlog::warn("warning: reading the other agents' failures: {}; summary of this node only", e.what());
    return failures_;
  }
  if (all.size() < failures_.size()) return failures_;  // e.g. after a failover to a standby store
  return all;
}

// Group rank 0 reports every agent's failures (published to the store), the others their own.
void Agent::print_summary() {
  if (summary_printed_) return;
  const bool job_wide = rdzv_ && rdzv_->current().group_world_size > 0 && rdzv_->current().group_rank == 0;
  const std::vector<Failure> failures = job_wide ? job_failures() : failures_;
  if (failures.empty()) return;
  summary_printed_ = true;
  auto root = std::min_element(failures.begin(), failures.end(),
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
  if (failures.size() > 1) {
    out += job_wide ? "other failures (all nodes, by time):\n" : "other failures on this node:\n";
    std::vector<const Failure*> others;
    for (const auto& f : failures)
      if (&f != &*root) others.push_back(&f);
    std::sort(others.begin(), others.end(), [](const Failure* a, const Failure* b) { return a->when < b->when; });
    for (const auto* f : others) out += fmt::format("  {} {}\n", iso_time(f->when), f->one_line());
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
  const int rc = ok ? 0 : what.find(": checkpointed") != std::string::npos ? elastrun::control::kCheckpointedExitCode : 1;
  spdlog::info("{}; exiting {}", what, rc);
  return rc;
}

void Agent::write_control(elastrun::control::Request request) {
  const elastrun::control::Status status{request, request == elastrun::control::Request::None ? 0 : ++control_sequence_};
  if (!elastrun::control::write_file(control_path_, status))
    throw std::system_error(errno, std::generic_category(), "writing the control file " + control_path_);
}

// Another agent's checkpoint-and-stop request (published in the store), looked for once per
// kStopRequestPoll: a node whose agent got no signal (or whose worker asked) stops with the rest.
bool Agent::stop_requested_elsewhere() {
  if (rdzv_->current().group_world_size <= 1) return false;
  const auto now = Clock::now();
  if (now < next_stop_poll_) return false;
  next_stop_poll_ = now + kStopRequestPoll;
  std::optional<std::string> request;
  try {
    request = rdzv_->read("stop-request");
  } catch (const std::exception&) {
    return false;  // the store is changing hands; the membership change will tell
  }
  if (!request) return false;
  auto j = nlohmann::json::parse(*request, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return false;
  const auto cls = j.value("class", std::string());
  stop_class_ = cls == "preempt" ? FailureClass::Preempt : FailureClass::TimeLimit;
  stop_signal_ = j.value("signal", 0);
  stop_reason_ = fmt::format("requested by node {} ({})", j.value("node", std::string("?")), j.value("reason", std::string("?")));
  return true;
}

// Brings the job back through Slurm (group rank 0 only). False when it will not come back.
bool Agent::request_requeue(FailureClass cls, const std::vector<std::string>& exclude, int signal) {
  if (!env_.slurm) {
    spdlog::info("requeue ({}): not running under Slurm, so the job cannot be requeued; the exit code tells the caller",
                 to_string(cls));
    return false;
  }
  const auto& job_id = env_.slurm->job_id;
  if (signal == SIGTERM) {
    // SIGTERM also comes from scancel and from reaching the time limit: ask slurmctld which
    auto job = load_slurm_job(job_id);
    if (!job) {
      spdlog::warn("warning: cannot ask slurmctld about job {}; treating SIGTERM as preemption", job_id);
    } else if (job->cancelled) {
      spdlog::info("job {} was cancelled (scancel): not requeueing", job_id);
      return false;
    } else if (job->timed_out) {
      cls = FailureClass::TimeLimit;
    } else if (!job->preempted) {
      spdlog::info("SIGTERM, but job {} is neither preempted nor out of time (kill? scancel --signal?): not requeueing",
                   job_id);
      return false;
    }
  }
  RequeueLedger ledger(o_.checkpoint_dir, job_id, env_.slurm->restart_count);
  const auto budget = o_.requeue_budget[static_cast<std::size_t>(cls)];
  const auto used = ledger.used(cls);
  const auto budget_text = budget == kUnlimited ? std::string("inf") : std::to_string(budget);
  if (budget != kUnlimited && used >= budget) {
    spdlog::info("requeue budget for class {} used up ({} of {}{}): job {} is not requeued", to_string(cls), used,
                 budget_text, ledger.path().empty() ? ", counted by SLURM_RESTART_COUNT" : "", job_id);
    return false;
  }
  if (auto err = ledger.charge(cls); !err.empty()) spdlog::warn("warning: requeue ledger: {}", err);
  if (auto err = requeue_slurm_job(job_id); !err.empty()) {
    spdlog::error("error: slurm_requeue({}): {} (submit with sbatch --requeue; needs a batch job)", job_id, err);
    return false;
  }
  spdlog::info("requeued job {} (class {}, requeue {} of {})", job_id, to_string(cls), used + 1, budget_text);
  if (!exclude.empty()) {
    std::string list;
    for (const auto& n : exclude) list += (list.empty() ? "" : ",") + n;
    // Slurm's SIGTERM/SIGKILL for the requeue may end us before the outcome is logged
    spdlog::info("excluding node(s) {} from requeued job {} (best effort)", list, job_id);
    spdlog::default_logger()->flush();
    if (auto err = exclude_nodes_from_job(job_id, exclude); !err.empty())
      spdlog::warn("warning: could not exclude node(s) {} from requeued job {}: {}", list, job_id, err);
    else
      spdlog::info("requeued job {} excludes node(s) {}", job_id, list);
  }
  return true;
}

// True if every exit in `exits` is a death by SIGUSR1/SIGUSR2/SIGTERM and the agent itself
// receives such a signal within kFailureSettle (then the stop is Slurm's, not a failure). Sets
// the stop's class and reason.
bool Agent::killed_by_slurm_stop_signal(const std::vector<WorkerExit>& exits) {
  for (const auto& e : exits)
    if (!is_checkpoint_signal(e.signal)) return false;
  const auto deadline = Clock::now() + kFailureSettle;
  int sig = 0;
  while ((sig = g_checkpoint_signal.load()) == 0 && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (sig == 0) return false;
  stop_signal_ = sig;
  stop_class_ = sig == SIGTERM ? FailureClass::Preempt : FailureClass::TimeLimit;
  stop_reason_ = fmt::format("{} ({}; it also killed {} worker(s) without a handler)", signal_name(sig),
                             sig == SIGTERM ? "preemption or cancellation" : "time limit warning", exits.size());
  return true;
}

// Group rank 0, after the job failed for good: requeue when the agent that gave up asked for it
// (class app: --max-restarts used up) and the class budget allows.
void Agent::requeue_failed_job() {
  if (!env_.slurm || rdzv_->current().group_world_size == 0 || rdzv_->current().group_rank != 0) return;
  std::optional<std::string> request;
  try {
    request = rdzv_->read("requeue-request");
  } catch (const std::exception& e) {
    spdlog::warn("warning: reading the requeue request: {}", e.what());
    return;
  }
  if (!request) return;
  g_checkpoint_stopping = true;  // Slurm's SIGTERM after our requeue must not cut the exclusion short
  request_requeue(FailureClass::App, {}, 0);
}

// The survivors of a node loss could not form a round of --nnodes MIN: one of them (the first
// to claim it in the store) requeues the job, excluding the members Slurm reports down.
void Agent::requeue_after_node_loss() {
  if (!env_.slurm) return;
  std::vector<std::string> lost;
  for (const auto& m : rdzv_->current().members())
    if (m.node_name != plan_.me.node_name && slurm_node_is_down(m.node_name).value_or(false)) lost.push_back(m.node_name);
  bool mine = false;
  try {
    mine = rdzv_->publish("requeue-claim", plan_.me.node_name, /*only_if_absent=*/true);
  } catch (const std::exception& e) {
    spdlog::warn("warning: claiming the requeue: {}", e.what());
  }
  if (!mine) {
    spdlog::info("another survivor handles the requeue");
    return;
  }
  g_checkpoint_stopping = true;
  request_requeue(FailureClass::Node, lost, 0);
}

// CHECKPOINT_STOP: ask the local workers to checkpoint and stop (control channel; the signal
// too with --forward-signals), wait up to --checkpoint-timeout, meet the other agents, and on
// group rank 0 requeue the job. Returns the next state, or nullopt when the agent is done (rc).
std::optional<State> Agent::checkpoint_stop(std::optional<WorkerGroup>& group, int& rc) {
  using elastrun::control::kCheckpointedExitCode;
  g_checkpoint_stopping = true;
  const bool channel_read = fs::exists(control_path_ + elastrun::control::kSeenSuffix);
  state(State::CheckpointStop, fmt::format("class {}: {}", to_string(stop_class_), stop_reason_));
  try {
    nlohmann::json request = {{"class", std::string(to_string(stop_class_))}, {"node", plan_.me.node_name},
                              {"reason", stop_reason_}, {"signal", stop_signal_}};
    rdzv_->publish("stop-request", request.dump(), /*only_if_absent=*/true);
  } catch (const std::exception& e) {
    spdlog::warn("warning: publishing the stop request to the other agents: {}", e.what());
  }
  bool written = true;
  try {
    write_control(elastrun::control::Request::CheckpointAndStop);
  } catch (const std::exception& e) {
    spdlog::error("error: {}; the workers cannot be asked to checkpoint", e.what());
    written = false;
  }
  if (o_.forward_signals && stop_signal_) {
    spdlog::info("forwarding {} to the workers (--forward-signals)", signal_name(stop_signal_));
    group->signal_all(stop_signal_);
  }
  std::vector<WorkerExit> exits = std::move(attempt_exits_);
  attempt_exits_.clear();
  if (((!channel_read || !written) && !o_.forward_signals) && !group->all_exited()) {
    spdlog::info("the workers never polled {} (elastrun/control.hpp, elastrun_control.py): stopping them without "
                 "a checkpoint (grace {} ms)", control_path_, o_.stop_grace.count());
  } else {
    spdlog::info("wrote checkpoint-and-stop to {}; waiting up to {} s for the workers to exit {}", control_path_,
                 o_.checkpoint_timeout.count() / 1000, kCheckpointedExitCode);
    const auto deadline = Clock::now() + o_.checkpoint_timeout;
    while (true) {
      for (auto& e : group->poll_exits()) {
        if (e.signal == 0 && e.exit_code == kCheckpointedExitCode) spdlog::info("worker {} checkpointed (exit {})", e.global_rank, e.exit_code);
        else if (e.ok()) spdlog::info("worker {} exited 0", e.global_rank);
        else record(e);
        exits.push_back(std::move(e));
      }
      if (group->all_exited()) break;
      if (int sig = g_signal.load()) {
        spdlog::info("received {} while waiting for the checkpoint: stopping the workers now", signal_name(sig));
        break;
      }
      if (Clock::now() >= deadline) {
        spdlog::warn("warning: the workers did not all exit within --checkpoint-timeout={} s: stopping them",
                     o_.checkpoint_timeout.count() / 1000);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  int checkpointed = 0, succeeded = 0;
  for (auto& e : group->stop(o_.stop_grace)) exits.push_back(std::move(e));
  for (const auto& e : exits) {
    if (e.signal == 0 && e.exit_code == kCheckpointedExitCode) ++checkpointed;
    else if (e.ok()) ++succeeded;
  }
  const int local = o_.nproc_per_node;
  if (succeeded == local) {
    spdlog::info("every local worker finished (exit 0) instead of checkpointing: the job succeeded");
    g_checkpoint_stopping = false;
    return State::Succeeded;
  }
  group.reset();
  g_workers_active = false;
  const bool local_ok = checkpointed > 0 && checkpointed + succeeded == local;
  spdlog::info("{} of {} local worker(s) checkpointed (exit {}), {} finished (exit 0)", checkpointed, local,
               kCheckpointedExitCode, succeeded);
  // group rank 0 requeues only when every node is done: a requeue kills the job's steps
  const auto& round = rdzv_->current();
  if (round.group_world_size > 1) {
    bool everyone = false;
    try {
      everyone = rdzv_->barrier("checkpoint-stop", o_.checkpoint_timeout + kCheckpointBarrierSlack);
    } catch (const std::exception& e) {
      spdlog::warn("warning: checkpoint barrier: {}", e.what());
    }
    if (!everyone) spdlog::warn("warning: not every node reported its checkpoint done in time");
  }
  rc = local_ok ? kCheckpointedExitCode : stop_signal_ ? 128 + stop_signal_ : 1;
  if (round.group_rank == 0) {
    request_requeue(stop_class_, {}, stop_signal_);
    try {
      rdzv_->close(fmt::format("checkpointed and stopped ({})", to_string(stop_class_)));
    } catch (const std::exception& e) {
      spdlog::warn("warning: closing the rendezvous: {}", e.what());
    }
  }
  spdlog::info("{}; exiting {}", local_ok ? "checkpointed and stopped" : "stopped without a complete checkpoint", rc);
  return std::nullopt;
}

// A node waits to join and every member is alive: the re-forming is planned, so workers that read
// the control channel checkpoint and stop first (exit 85), and the larger round resumes from now
// rather than from the last periodic checkpoint. Every agent of the round sees the same waiting
// node and asks its own workers, so a collective save finds all ranks. Any other change meanwhile
// (a member lost: a collective would hang; a new round; a close) stops the workers at once.
// Returns the change to act on.
Change Agent::checkpoint_before_scale_up(WorkerGroup& group) {
  if (!fs::exists(control_path_ + elastrun::control::kSeenSuffix)) {
    spdlog::info("scale-up: the workers never polled {}: re-forming without a checkpoint", control_path_);
    return Change::MemberWaiting;
  }
  try {
    write_control(elastrun::control::Request::CheckpointAndStop);
  } catch (const std::exception& e) {
    spdlog::warn("warning: {}; re-forming without a checkpoint", e.what());
    return Change::MemberWaiting;
  }
  spdlog::info("scale-up: asked the workers to checkpoint and stop before re-forming (up to {} s)",
               o_.checkpoint_timeout.count() / 1000);
  const auto deadline = Clock::now() + o_.checkpoint_timeout;
  int checkpointed = 0;
  while (true) {
    for (const auto& e : group.poll_exits()) {
      if (e.signal == 0 && e.exit_code == elastrun::control::kCheckpointedExitCode) {
        ++checkpointed;
        spdlog::info("worker {} checkpointed (exit {})", e.global_rank, e.exit_code);
      } else if (e.ok()) {
        spdlog::info("worker {} exited 0", e.global_rank);
      } else {
        // not counted against --max-restarts: the round is being re-formed anyway
        spdlog::warn("warning: worker {} {} during the scale-up checkpoint", e.global_rank,
                     e.signal ? fmt::format("died of {}", signal_name(e.signal)) : fmt::format("exited {}", e.exit_code));
      }
    }
    if (group.all_exited()) {
      spdlog::info("scale-up: {} of {} local worker(s) checkpointed", checkpointed, o_.nproc_per_node);
      break;
    }
    if (g_signal.load() || g_checkpoint_signal.load()) return Change::MemberWaiting;  // the next state handles it
    if (Clock::now() >= deadline) {
      spdlog::warn("warning: the workers did not all checkpoint within --checkpoint-timeout={} s: stopping them",
                   o_.checkpoint_timeout.count() / 1000);
      return Change::MemberWaiting;
    }
    if (const Change c = rdzv_->wait_for_change(Millis(50)); c != Change::None && c != Change::MemberWaiting) {
      spdlog::info("scale-up: {} during the checkpoint: stopping the workers now", to_string(c));
      return c;
    }
  }
  // Wait for the other nodes' workers too: the first agent to re-form would otherwise start the
  // next round and make the others stop workers that are still saving.
  const auto& round = rdzv_->current();
  if (round.group_world_size <= 1) return Change::MemberWaiting;
  try {
    const auto key = fmt::format("scale-up-checkpoint/{}", round.generation);
    auto done = rdzv_->add_to_counter(key, 1);
    for (; done < round.group_world_size; done = rdzv_->add_to_counter(key, 0)) {
      if (Clock::now() >= deadline) {
        spdlog::warn("warning: {} of {} node(s) finished the scale-up checkpoint within --checkpoint-timeout; re-forming",
                     done, round.group_world_size);
        break;
      }
      if (const Change c = rdzv_->wait_for_change(Millis(50)); c != Change::None && c != Change::MemberWaiting) {
        // a node that saw everyone done first starts the next round (Reform): not an interruption
        if (rdzv_->add_to_counter(key, 0) >= round.group_world_size) {
          spdlog::info("scale-up: every node checkpointed; re-forming");
        } else {
          spdlog::info("scale-up: {} while waiting for the other nodes' checkpoint", to_string(c));
        }
        return c;
      }
    }
    if (done >= round.group_world_size) spdlog::info("scale-up: every node checkpointed; re-forming");
  } catch (const std::exception& e) {
    spdlog::warn("warning: waiting for the other nodes' scale-up checkpoint: {}", e.what());
  }
  return Change::MemberWaiting;
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

  g_requeue_in_rendezvous = [this](int sig) {
    request_requeue(sig == SIGTERM ? FailureClass::Preempt : FailureClass::TimeLimit, {}, sig);
    spdlog::default_logger()->flush();
  };
  struct RequeuerInRendezvous {  // armed only around next_round, on group rank 0 of the last round
    explicit RequeuerInRendezvous(bool on) { g_requeuer_in_rendezvous.store(on, std::memory_order_release); }
    ~RequeuerInRendezvous() { g_requeuer_in_rendezvous.store(false, std::memory_order_release); }
    RequeuerInRendezvous(const RequeuerInRendezvous&) = delete;
    RequeuerInRendezvous& operator=(const RequeuerInRendezvous&) = delete;
  };
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
            const auto& last = rdzv_->current();
            std::optional<RequeuerInRendezvous> requeuer(std::in_place, last.group_world_size > 0 && last.group_rank == 0);
            const auto& r = rdzv_->next_round();
            requeuer.reset();
            restart_count_ = rdzv_->add_to_counter("restarts", 0);
            state(st, fmt::format(
                          "round {} formed in {} ms: group rank {} of {}, ranks {}..{} of {}, master {}:{}",
                          r.generation,
                          std::chrono::duration_cast<Millis>(Clock::now() - t0).count(), r.group_rank,
                          r.group_world_size, r.rank_offset, r.rank_offset + o_.nproc_per_node - 1,
                          r.world_size, r.master_addr, r.master_port));
            st = State::StartWorkers;
          } catch (const RendezvousClosed& e) {
            if (rdzv_->current().group_world_size > 0 && !std::string_view(e.what()).ends_with(": succeeded")) {
              print_summary();  // group rank 0 of the last round: the job-wide one
              requeue_failed_job();
            }
            rc = closed_exit(e.what());
            done = true;
          } catch (const RendezvousError& e) {
            if (rdzv_->current().group_world_size == 0) throw;  // no round ever formed: as before
            // fewer nodes than --nnodes MIN came back after a loss: class "node"
            spdlog::error("error: {}", e.what());
            print_summary();
            requeue_after_node_loss();
            rc = 1;
            done = true;
          }
          break;
        }
        case State::StartWorkers: {
          current_specs_ = worker_specs(rdzv_->current());
          attempt_exits_.clear();
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
          bool checkpointed = false;
          change = Change::None;
          while (true) {
            if (int sig = g_checkpoint_signal.load(); sig && !g_signal.load()) {
              stop_signal_ = sig;
              stop_class_ = sig == SIGTERM ? FailureClass::Preempt : FailureClass::TimeLimit;
              stop_reason_ = fmt::format("{} ({})", signal_name(sig),
                                         sig == SIGTERM ? "preemption or cancellation" : "time limit warning");
              st = State::CheckpointStop;
              break;
            }
            if (int sig = g_signal.load()) {
              spdlog::info("stopping workers on {} (grace {} ms)", signal_name(sig), o_.stop_grace.count());
              group->stop(o_.stop_grace);
              group.reset();
              g_workers_active = false;
              rc = 128 + sig;
              done = true;
              break;
            }
            std::vector<WorkerExit> failures;
            for (const auto& e : group->poll_exits()) {
              attempt_exits_.push_back(e);
              if (e.ok()) {
                spdlog::info("worker {} exited 0", e.global_rank);
              } else if (e.signal == 0 && e.exit_code == elastrun::control::kCheckpointedExitCode) {
                spdlog::info("worker {} exited {}: checkpointed, asks to be requeued", e.global_rank, e.exit_code);
                checkpointed = true;
              } else {
                failures.push_back(e);
              }
            }
            if (!failures.empty() && killed_by_slurm_stop_signal(failures)) {
              // Slurm signals every process of the step: a worker without a handler dies of the
              // SIGUSR1/SIGTERM that is also on its way to us. Not an application failure.
              spdlog::info("worker(s) killed by {}: waiting for the agent's own copy of the signal",
                           signal_name(failures.front().signal));
              st = State::CheckpointStop;
              break;
            }
            for (const auto& e : failures) record(e);
            if (!failures.empty()) {
              st = State::Failed;
              break;
            }
            if (checkpointed) {
              stop_signal_ = 0;
              stop_class_ = FailureClass::TimeLimit;
              stop_reason_ = fmt::format("a worker exited {} (checkpointed)", elastrun::control::kCheckpointedExitCode);
              st = State::CheckpointStop;
              break;
            }
            if (group->all_exited()) {
              st = State::Succeeded;
              break;
            }
            if (stop_requested_elsewhere()) {
              st = State::CheckpointStop;
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
          } else if (rdzv_->add_to_counter(fmt::format("restart-claim/{}", rdzv_->current().generation), 1) > 1) {
            // Workers failed on several nodes in this round at once (one crash breaks the others'
            // collectives): one restart per round, counted by the agent that claimed it first.
            // Wait for its decision: a new round (Reform) or the budget used up (Closed).
            spdlog::info("the failure coincides with a restart of this round counted by another agent: not counted again");
            change = rdzv_->wait_for_change(Millis(10000));
          } else {
            const auto restarts = rdzv_->add_to_counter("restarts", 1);
            if (restarts > o_.max_restarts) {
              // tell the other agents first, then stop our workers
              const auto reason = fmt::format("failed: {} (--max-restarts={} used up)",
                                              failures_.front().one_line(), o_.max_restarts);
              try {
                rdzv_->publish("requeue-request", to_string(FailureClass::App));  // for group rank 0
              } catch (const std::exception& e) {
                spdlog::warn("warning: publishing the requeue request: {}", e.what());
              }
              rdzv_->close(reason);
              spdlog::info("stopping local workers (grace {} ms)", o_.stop_grace.count());
              group->stop(o_.stop_grace);
              group.reset();
              g_workers_active = false;
              print_summary();
              requeue_failed_job();
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
              requeue_failed_job();
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
          if (change == Change::MemberWaiting && o_.scale_up_checkpoint) change = checkpoint_before_scale_up(*group);
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
        case State::CheckpointStop: {
          if (auto next = checkpoint_stop(group, rc)) st = *next;
          else done = true;
          break;
        }
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
