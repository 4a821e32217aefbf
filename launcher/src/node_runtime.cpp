#include "node_runtime.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <stdexcept>
#include <type_traits>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "workers.hpp"

namespace elastrun::launcher {

NodeRuntime::~NodeRuntime() {
  endpoint_.reset();
  backend_.reset();
  if (watchdog_) {
    reaper_.disown(watchdog_->pid());  // ~Watchdog waits for its own process
    watchdog_.reset();
  }
}

void NodeRuntime::open_event_log(const std::string& path, const std::string& node, const std::string& run_id) {
  events_ = EventLog(path, node, run_id);
}

void NodeRuntime::start_metrics(const std::string& dir, MetricsLabels labels) {
  try {
    metrics_ = std::make_unique<MetricsWriter>(dir, events_.path(), std::move(labels), std::chrono::seconds(2));
    spdlog::info("metrics for node_exporter's textfile collector: {}", metrics_->path());
  } catch (const std::exception& e) {
    spdlog::warn("warning: no metrics file in {}: {}", dir, e.what());
  }
}

void NodeRuntime::serve_endpoint(Identity identity) {
  identity_ = std::move(identity);
  const std::string address = default_node_address(static_cast<int>(::getpid()), identity_.node);
  try {
    endpoint_ = std::make_unique<NodeEndpoint>(address, [this](const nlohmann::json& r) { return answer(r); });
    spdlog::info("node endpoint {}", address);
  } catch (const std::exception& e) {
    spdlog::warn("warning: no node endpoint ({}); status queries will not be answered", e.what());
  }
}

void NodeRuntime::enable_memory_checkpoints(std::uint64_t budget_bytes) {
  memory_ = std::make_unique<MemorySegments>(budget_bytes);
}

void NodeRuntime::enable_memory_peers(PeerCredentials credentials, const std::string& bind_address) {
  memory_peers_ = std::make_unique<MemoryPeers>(*memory_, std::move(credentials), bind_address);
}

MemorySegments& NodeRuntime::memory_or_refuse() {
  if (!memory_)
    throw std::invalid_argument("memory checkpoints are off on this node: start elastrun with --memory-checkpoints");
  return *memory_;
}

namespace {
template <class T>
T field(const nlohmann::json& request, const char* name) {
  const auto it = request.find(name);
  // an unsigned field takes the whole 64-bit range (a checksum): JSON's unsigned numbers
  if (it == request.end() || !it->is_number_integer() || (std::is_unsigned_v<T> && !it->is_number_unsigned()))
    throw std::invalid_argument(
        fmt::format("'{}' is missing or not a {}integer", name, std::is_unsigned_v<T> ? "non-negative " : ""));
  return it->get<T>();
}
}  // namespace

worker::NodeReply NodeRuntime::answer(const nlohmann::json& request) {
  namespace op = contract::node_op;
  const std::string name = request.value("op", "");
  if (name == op::kStatus) return status_reply();
  if (name == op::kMemAlloc) {
    const auto bytes = field<std::uint64_t>(request, "bytes");
    return {{{"bytes", bytes}},
            memory_or_refuse().allocate(field<std::uint64_t>(request, "step"), field<int>(request, "rank"), bytes)};
  }
  if (name == op::kMemCommit) {
    const auto step = field<std::uint64_t>(request, "step");
    const int rank = field<int>(request, "rank");
    std::uint64_t generation = 0;
    {
      std::lock_guard lock(status_mutex_);
      generation = static_cast<std::uint64_t>(std::max<std::int64_t>(status_.generation, 0));
    }
    memory_or_refuse().commit(step, rank, field<std::uint64_t>(request, "checksum"), request.value("world", 0),
                              generation);
    if (memory_peers_) memory_peers_->committed(step, rank);
    return {};
  }
  // a restore's requests: after this round's fetch from the peers (a bounded wait)
  if (memory_peers_ && (name == op::kMemGet || name == op::kMemList))
    memory_peers_->wait_for_fetch(std::chrono::seconds(30));
  if (name == op::kMemGet) {
    const int rank = field<int>(request, "rank");
    std::optional<std::uint64_t> step;
    if (request.contains("step")) step = field<std::uint64_t>(request, "step");
    if (request.value("refetch", false)) {  // the copy here failed its checksum: a peer's instead
      if (!step) throw std::invalid_argument("refetch needs the step");
      if (!memory_peers_) throw std::invalid_argument("this agent has no partner copies to fetch from");
      memory_peers_->refetch(*step, rank);
    }
    auto found = memory_or_refuse().find(rank, step);
    if (!found)
      throw std::invalid_argument(step ? fmt::format("no committed memory snapshot of step {} rank {}", *step, rank)
                                       : fmt::format("no committed memory snapshot of rank {}", rank));
    return {{{"step", found->step}, {"bytes", found->bytes}, {"checksum", found->checksum}}, std::move(found->fd)};
  }
  if (name == op::kCommitFence) {
    const auto what = request.value("what", std::string());
    if (what.empty()) throw std::invalid_argument("'what' (the step directory to commit) is missing");
    CommitFenceCheck check;
    {
      std::lock_guard lock(status_mutex_);
      check = commit_fence_;
    }
    if (!check) throw std::invalid_argument("this agent has no rendezvous round to check commits against");
    return {{{"token", check(what)}}};
  }
  if (name == op::kMemList) return memory_or_refuse().list();
  if (name == op::kMemForget)
    return {{{"dropped", memory_or_refuse().forget_after(field<std::uint64_t>(request, "after_step"))}}};
  throw std::invalid_argument(fmt::format("unknown op '{}' (this agent knows: {}, {}, {}, {}, {}, {}, {})", name,
                                          op::kStatus, op::kMemAlloc, op::kMemCommit, op::kMemGet, op::kMemList,
                                          op::kMemForget, op::kCommitFence));
}

nlohmann::json NodeRuntime::status_reply() const {
  std::lock_guard lock(status_mutex_);
  return {{"node", identity_.node},
          {"run_id", identity_.run_id},
          {"pid", ::getpid()},
          {"state", status_.state},
          {"generation", status_.generation},
          {"world_size", status_.world_size},
          {"group_rank", status_.group_rank},
          {"group_world_size", status_.group_world_size},
          {"restart_count", status_.restart_count},
          {"attempt", status_.attempt},
          {"worker_pids", status_.worker_pids},
          {"process_backend", status_.process_backend},
          {"job_dir", identity_.job_dir},
          {"memory_checkpoints", memory_status()}};
}

nlohmann::json NodeRuntime::memory_status() const {
  if (!memory_) return nullptr;
  nlohmann::json j{{"budget", memory_->budget()}, {"used", memory_->used()}, {"spare", memory_->spare()}};
  if (memory_peers_) {
    const auto c = memory_peers_->counts();
    j["partner_copies"] = {{"address", memory_peers_->address()},
                           {"sent", c.pushed},
                           {"received", c.received},
                           {"fetched", c.fetched},
                           {"adopted", c.adopted},
                           {"send_failures", c.push_failures}};
  }
  return j;
}

ProcessBackend& NodeRuntime::process_backend() {
  if (!backend_) {
    watchdog_.emplace(stop_grace_, metrics_ ? metrics_->path() : std::string());
    reaper_.own(watchdog_->pid(), [](pid_t pid, int status) {
      spdlog::error(
          "error: the worker watchdog (pid {}) ended ({} {}): workers are no longer ended if the agent is "
          "killed",
          pid, WIFSIGNALED(status) ? "signal" : "exit", WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    });
    backend_ =
        preload_ ? make_preload_backend(reaper_, &*watchdog_, *preload_) : make_exec_backend(reaper_, &*watchdog_);
    update_status([this](Status& s) { s.process_backend = backend_->name(); });
  }
  return *backend_;
}

const std::string& NodeRuntime::agent_tag() {
  process_backend();
  return watchdog_->environment_entry();
}

}  // namespace elastrun::launcher
