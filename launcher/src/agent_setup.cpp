// The agent's set-up and tear-down: the command to run, the bootstrap (who we are, which stores
// we host, the rendezvous), the event log, the exit, and run_agent(), the binary's entry point.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <thread>

#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "agent.hpp"
#include "job_dir.hpp"
#include "elastrun/rdzv/etcd.hpp"
#include "elastrun/rdzv/hostlist.hpp"
#include "elastrun/rdzv/net.hpp"
#include "elastrun/rdzv/store.hpp"
#include "elastrun/slurm/api.hpp"

namespace elastrun::launcher {

namespace {

// Slurm's word on a member this side cannot reach (the quorum rule, docs/rendezvous.md
// "Partitions"): its node is DOWN, NOT_RESPONDING or FAILED, or no longer in the job.
std::function<bool(const rdzv::MemberInfo&)> slurm_confirms_gone(const std::string& job_id) {
  return [job_id](const rdzv::MemberInfo& m) {
    if (slurm::node_is_down(m.node_name).value_or(false)) return true;
    const auto id = slurm::numeric_job_id(job_id);
    const auto job = id ? slurm::load_job(*id) : std::nullopt;
    if (!job || job->nodes.empty()) return false;
    const auto nodes = rdzv::expand_hostlist(job->nodes);
    return nodes && std::find(nodes->begin(), nodes->end(), m.node_name) == nodes->end();
  };
}

}  // namespace

namespace fs = std::filesystem;
using namespace elastrun::rdzv;

namespace {

// memory-peer/<member key> = host:port of that agent's MemoryPeers (under the store's pub/)
const std::string kMemoryPeerKeys = "memory-peer/";

void ensure_std_fds() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) >= 0 || errno != EBADF) continue;
    int null = ::open("/dev/null", O_RDWR);  // takes the lowest free number, i.e. `fd`
    if (null < 0) throw std::system_error(errno, std::generic_category(), "open /dev/null");
  }
}

}  // namespace

TempDir::TempDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = fmt::format("{}/elastrun-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!::mkdtemp(pattern.data())) throw std::system_error(errno, std::generic_category(), "mkdtemp " + pattern);
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

void Agent::resolve_command() {
  const bool python = !o_.no_python && (o_.module || o_.run_path || o_.program.ends_with(".py"));
  if (python) {
    auto interp = find_executable(o_.python);
    if (!interp) throw UsageError(fmt::format("python interpreter '{}' not found (set ELASTRUN_PYTHON)", o_.python));
    command_path_ = *interp;
    command_argv_ = {o_.python, "-u"};
    if (o_.module) command_argv_.push_back("-m");
    // A missing script is a usage error now, not a worker failure after the rendezvous (every
    // agent of the job starts the same script; each checks its own view of the filesystem).
    std::error_code ec;
    if (!o_.module && !fs::is_regular_file(o_.program, ec))
      throw UsageError(
          fmt::format("script '{}' not found (or not a file); give a path to a Python script", o_.program));
  } else {
    auto exe = find_executable(o_.program);
    if (!exe) throw UsageError(fmt::format("program '{}' not found or not executable", o_.program));
    command_path_ = *exe;
  }
  command_argv_.push_back(o_.program);
  command_argv_program_end_ = command_argv_.size();  // --local-rank-arg goes here, before the program's own
  command_argv_.insert(command_argv_.end(), o_.program_args.begin(), o_.program_args.end());
}

void Agent::bootstrap() {
  const bool etcd = uses_etcd(o_.rdzv_backend);
  const bool standalone = o_.standalone || (!etcd && !env_.slurm && o_.rdzv_endpoint.empty() &&
                                            o_.master_addr.empty() && o_.max_nodes.value_or(1) == 1);
  std::string endpoint = o_.rdzv_endpoint;
  if (o_.static_form()) endpoint = fmt::format("{}:{}", o_.master_addr, o_.static_store_port());
  const BootstrapOverrides overrides{.endpoint = endpoint,
                                     .run_id = o_.rdzv_id,
                                     .is_host = o_.is_host,
                                     .nproc = o_.nproc_per_node,
                                     .role = o_.role,
                                     .local_addr = o_.local_addr};
  if (standalone) {
    plan_ = plan_standalone(env_, overrides);
  } else {
    try {
      plan_ = plan_bootstrap(env_, overrides);
    } catch (const RendezvousError& e) {
      throw UsageError(e.what());  // no endpoint, an endpoint that does not resolve: fix the line (exit 2)
    }
    const int step_nodes = env_.slurm ? env_.placement.num_nodes : 1;
    min_nodes_ = o_.min_nodes.value_or(step_nodes);
    max_nodes_ = o_.max_nodes.value_or(std::max(step_nodes, min_nodes_));
    if (!o_.het_nnodes.empty()) {
      const int het_size = env_.slurm ? env_.slurm->het_size : 0;
      if (het_size < 2)
        throw UsageError("--het-nnodes needs a heterogeneous Slurm step (srun ... : ...); use --nnodes otherwise");
      if (static_cast<int>(o_.het_nnodes.size()) != het_size)
        throw UsageError(fmt::format("--het-nnodes gives {} bound(s) but the job has {} het components; give one each",
                                     o_.het_nnodes.size(), het_size));
      min_nodes_ = max_nodes_ = 0;
      for (auto [lo, hi] : o_.het_nnodes) {
        min_nodes_ += lo;
        max_nodes_ += hi;
        component_bounds_.push_back({lo, hi});
      }
    }
    if (env_.slurm && env_.placement.local_world_size > 1)
      spdlog::warn("warning: {} Slurm tasks on this node; run one agent per node (srun --ntasks-per-node=1)",
                   env_.placement.local_world_size);
  }
  if (o_.node_rank) plan_.me.node_index = *o_.node_rank;
  if (!o_.local_addr.empty()) plan_.me.address = o_.local_addr;
  spdlog::set_pattern(fmt::format("[elastrun node {}] %v", plan_.me.node_name));
  use_job_dir();
  open_event_log();
  start_metrics();
  if (!etcd) choose_auth(standalone);
  if (!plan_.bind_note.empty() && !etcd) spdlog::warn("warning: {}", plan_.bind_note);
  if (o_.memory_checkpoints) {  // before the endpoint that serves it
    runtime_.enable_memory_checkpoints(*o_.memory_checkpoints);
    spdlog::info("memory checkpoints: up to {:.1f} MiB of segments held by this agent (--memory-checkpoints)",
                 static_cast<double>(*o_.memory_checkpoints) / (1 << 20));
  }
  if (!o_.preload.empty()) {
    if (command_argv_.size() >= 2 && command_argv_[1] == "-u") {
      runtime_.enable_preload({.python = command_path_, .modules = o_.preload});
      runtime_.process_backend().prepare();  // its imports run while we wait in the rendezvous
    } else {
      spdlog::info("note: --preload={} applies to Python workers only; {} is started as is", o_.preload, o_.program);
    }
  }
  // the node's endpoint, for the whole job: after the usage errors (one line each), before any
  // wait for the store; @elastrun-node-<pid>-<node>, nothing on disk, our workers get its address
  runtime_.serve_endpoint({.node = plan_.me.node_name, .run_id = plan_.run_id, .job_dir = job_dir_});

  std::unique_ptr<KvBackend> kv, hb;
  StoreConnector connector;
  if (etcd) {
    kv = std::make_unique<EtcdKv>(endpoint);
    hb = std::make_unique<EtcdKv>(endpoint);
  } else {
    stores_ = start_agent_stores(plan_, auth_);
    if (stores_.primary && !standalone)
      spdlog::info("hosting the rendezvous store on port {}", stores_.primary->port());
    if (standalone) plan_.store_port = stores_.primary->port();
    connector = store_connector(auth_, plan_.run_id);
    kv = connect_store(plan_, auth_, o_.join_timeout);
    hb = connect_store(plan_, auth_, o_.join_timeout);
  }
  RendezvousConfig config{.run_id = plan_.run_id,
                          .min_nodes = min_nodes_,
                          .max_nodes = max_nodes_,
                          .join_timeout = o_.join_timeout,
                          .last_call_timeout = o_.last_call_timeout,
                          .heartbeat_timeout = o_.heartbeat_timeout,
                          .component_bounds = component_bounds_,
                          .confirmed_gone = {},
                          .partition_timeout = o_.partition_timeout,
                          .on_quorum_wait = {},
                          .primary_address = plan_.store_address,
                          .primary_port = etcd ? std::uint16_t(0) : plan_.store_port};
  if (env_.slurm && slurm::config_available()) config.confirmed_gone = slurm_confirms_gone(env_.slurm->job_id);
  config.on_quorum_wait = [this](const QuorumWait& w) {
    events().emit(contract::event::kPartitioned, {{"waiting", w.waiting},
                                                  {"members", w.members},
                                                  {"present", w.present},
                                                  {"unreachable", w.unreachable},
                                                  {"store_node", w.store_node},
                                                  {"waited_ms", w.waited_ms}});
  };
  rdzv_ = std::make_unique<Rendezvous>(std::move(kv), std::move(hb), config, plan_.me, connector);
  etcd_endpoint_ = etcd ? endpoint : std::string();
  runtime_.set_commit_fence([this](const std::string& what) { return check_commit(what); });
  if (runtime_.memory()) start_memory_peers(etcd);
  spdlog::info("run '{}', backend {}{}, store {}:{}, nodes {}:{}, {} worker(s) per node", plan_.run_id,
               standalone ? "standalone" : to_string(o_.rdzv_backend),
               plan_.host_store && !etcd ? " (hosted here)" : "", etcd ? endpoint : plan_.store_address,
               etcd ? 0 : plan_.store_port, min_nodes_, max_nodes_, o_.nproc_per_node);
}

// The memory tier's partner copies (memory_peers.hpp): a job of two or more nodes on the embedded
// store (its authentication is theirs). The address goes into the store before we join, so every
// member of a round has published its own by the time the round forms.
void Agent::start_memory_peers(bool etcd) {
  if (max_nodes_ < 2) {
    spdlog::warn(
        "warning: memory checkpoints on one node: no partner holds copies, so they survive a worker's "
        "crash but not this node's loss");
    return;
  }
  if (etcd) {
    spdlog::warn(
        "warning: memory checkpoints with --rdzv-backend=etcd: no partner copies (they authenticate "
        "like the embedded store); each node keeps its own snapshots");
    return;
  }
  const auto bind = rdzv::ipv4_address(plan_.me.address);
  try {
    if (!bind) throw std::runtime_error(fmt::format("'{}' does not resolve to an IPv4 address", plan_.me.address));
    runtime_.enable_memory_peers({.auth = auth_, .run_id = plan_.run_id}, *bind);
    rdzv_->publish(kMemoryPeerKeys + plan_.me.sort_key(), runtime_.memory_peers()->address());
    spdlog::info("memory checkpoints: partner copies served on {}", runtime_.memory_peers()->address());
  } catch (const std::exception& e) {
    spdlog::warn("warning: memory checkpoints without partner copies (this node's loss loses its snapshots): {}",
                 e.what());
  }
}

// After a round formed: the partner is the next member in round order; the fetch for our new
// ranks starts now, while the workers start.
void Agent::memory_peers_round(const RoundResult& round) {
  auto* peers = runtime_.memory_peers();
  if (peers == nullptr) return;
  const auto mine = kMemoryPeerKeys + plan_.me.sort_key();
  if (!rdzv_->read(mine)) rdzv_->publish(mine, peers->address());  // a store we failed over to
  std::map<std::string, std::string> address_of;
  for (auto& [key, value] : rdzv_->read_prefix(kMemoryPeerKeys)) address_of[key.substr(kMemoryPeerKeys.size())] = value;
  const auto& members = round.members();
  MemoryPeers::Round next{
      .generation = round.generation, .peers = {}, .local_ranks = {}, .world_size = round.world_size};
  const auto n = members.size();
  for (std::size_t i = 1; i < n; ++i) {
    const auto& m = members[(static_cast<std::size_t>(round.group_rank) + i) % n];
    const auto it = address_of.find(m.sort_key());
    next.peers.push_back(it == address_of.end() ? std::string() : it->second);
  }
  for (int r = 0; r < o_.nproc_per_node; ++r) next.local_ranks.push_back(round.rank_offset + r);
  if (!next.peers.empty() && next.peers.front().empty())
    spdlog::warn("warning: memory checkpoints: the partner {} published no address: no partner copies this round",
                 members[(static_cast<std::size_t>(round.group_rank) + 1) % n].node_name);
  peers->new_round(std::move(next));
}

// A worker's commit_fence request (the endpoint's thread): the round's fence, checked on the
// store the round formed on, over a connection of its own (the Rendezvous is the main thread's).
std::string Agent::check_commit(const std::string& what) {
  std::optional<CommitFence> fence;
  {
    std::lock_guard lock(fence_mutex_);
    fence = fence_;
  }
  if (!fence) throw std::invalid_argument("this node is between rounds: no commit now");
  std::string why;
  try {
    std::unique_ptr<KvBackend> kv;
    if (!etcd_endpoint_.empty()) {
      kv = std::make_unique<EtcdKv>(etcd_endpoint_, o_.heartbeat_timeout);
    } else {
      kv = std::make_unique<StoreClient>(fence->store_port ? fence->store_address : plan_.store_address,
                                         fence->store_port ? fence->store_port : plan_.store_port, auth_, plan_.run_id,
                                         Millis(1000));
      kv->set_reply_timeout(o_.heartbeat_timeout);
    }
    why = fence_commit(*kv, *fence, what);
  } catch (const StoreError& e) {
    why = fmt::format("the rendezvous store cannot confirm the round: {}", e.what());
  }
  if (!why.empty()) {
    spdlog::warn("checkpoint commit of {} refused: {}", what, why);
    throw std::invalid_argument(fmt::format("commit of {} refused by the rendezvous: {}", what, why));
  }
  return fence->token;
}

Agent::~Agent() {
  if (plan_.host_store && !auth_.token_file.empty()) ::unlink(auth_.token_file.c_str());
}

// --rdzv-auth for the embedded store. "auto" never means none: a token on one host (standalone,
// a loopback endpoint, a one-node job), munge across hosts, or an error saying how to choose.
void Agent::choose_auth(bool standalone) {
  const bool one_node_job = !standalone && max_nodes_ == 1;
  const bool one_host = standalone || one_node_job ||
                        (o_.rdzv_endpoint.empty() && o_.master_addr.empty()
                             ? env_.slurm && env_.placement.num_nodes == 1 && max_nodes_ == 1
                             : is_loopback_host(plan_.store_host));
  try {
    auth_ = resolve_auth(o_.rdzv_auth, {.run_id = plan_.run_id, .one_host = one_host});
  } catch (const AuthError& e) {
    throw UsageError(e.what());
  }
  if (auth_.kind == AuthKind::None)
    spdlog::warn("warning: --rdzv-auth=none: anyone who can reach this run's rendezvous stores may join or change it");
  else
    spdlog::debug("rendezvous auth: {}{}", to_string(auth_.kind),
                  auth_.token_file.empty() ? "" : " (generated, " + auth_.token_file + ")");
}

// Under Slurm every agent of the job writes into one job directory without flags (job_dir.hpp):
// the outcome file always (unless --outcome-file/ELASTRUN_OUTCOME_FILE names one), and the event
// log and the per-rank logs (tee'd: files and console) unless --events or --log-dir says where.
void Agent::use_job_dir() {
  const auto environment = current_environment();
  const auto job = plan_job_dir(environment);
  if (!job) return;
  job_dir_ = make_job_dir(*job, environment);
  if (job_dir_.empty()) return;
  if (o_.outcome_file.empty()) o_.outcome_file = (fs::path(job_dir_) / kOutcomeFileName).string();
  if (!o_.events.empty() || !o_.log_dir.empty()) return;
  o_.log_dir = job_dir_;
  log_dir_per_node_ = true;
  const bool streams_chosen =
      o_.redirects.all != 0 || !o_.redirects.per_rank.empty() || o_.tee.all != 0 || !o_.tee.per_rank.empty();
  if (!streams_chosen) o_.tee.all = 3;  // every rank's stdout and stderr in files, and on the console as before
  spdlog::info("job directory {} (events, logs, outcome)", job_dir_);
}

// --events, or <--log-dir>/events-<node>.jsonl: opened before anything else happens, so a path
// that cannot be written is a usage error (exit 2) rather than a silent gap in the log.
void Agent::open_event_log() {
  std::string path = o_.events;
  if (path.empty() && !o_.log_dir.empty())
    path = (fs::path(o_.log_dir) / fmt::format("events-{}.jsonl", plan_.me.node_name)).string();
  if (path.empty()) return;
  try {
    runtime_.open_event_log(fs::absolute(path).string(), plan_.me.node_name, plan_.run_id);
  } catch (const std::system_error& e) {
    throw UsageError(fmt::format("--events: {} ({}); give a writable path", e.what(),
                                 o_.events.empty() ? "from --log-dir" : "--events"));
  }
}

// --metrics-dir: the textfile says what the event log says (metrics.hpp), so it needs one.
void Agent::start_metrics() {
  if (o_.metrics_dir.empty()) return;
  if (!events().enabled()) {
    spdlog::warn(
        "warning: --metrics-dir: no event log to read the metrics from (give --events or --log-dir, or "
        "keep the Slurm job directory); no metrics file");
    return;
  }
  const char* job = std::getenv("SLURM_JOB_ID");
  runtime_.start_metrics(fs::absolute(o_.metrics_dir).string(),
                         {job && *job ? job : plan_.run_id, plan_.me.node_name, plan_.run_id});
}

// The store (or a standby we failed over to) lives in this process: keep it up until the
// other agents have left (they need it to see the close / pass the exit barrier), bounded.
void Agent::linger_for_peers() {
  rdzv_.reset();  // revokes our lease, closes our connections
  for (auto* s : {stores_.primary.get(), stores_.standby.get()}) {
    if (!s) continue;
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (s->stats().connections > 0 && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

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
    if (parse_agent_options(argc, argv, env ? env->pet_overrides : std::map<std::string, std::string>{}, options) ==
        ParseOutcome::Exit0)
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
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    if (::sigaction(SIGPIPE, &ign, nullptr) != 0) throw std::system_error(errno, std::generic_category(), "sigaction");
    // orphaned grandchildren of workers are reparented to us, so we can reap and kill them
    if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) throw std::system_error(errno, std::generic_category(), "prctl");
    static AgentSignals signals;  // static: its sigwait thread is detached and outlives this frame
    signals.start();
    Agent agent(options, *env, signals);
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
