#include "node_runtime.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <stdexcept>

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

nlohmann::json NodeRuntime::answer(const nlohmann::json& request) const {
  const std::string op = request.value("op", "");
  if (op == "status") return status_reply();
  throw std::invalid_argument(fmt::format("unknown op '{}' (this agent knows: status)", op));
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
          {"job_dir", identity_.job_dir}};
}

ProcessBackend& NodeRuntime::process_backend() {
  if (!backend_) {
    watchdog_.emplace(stop_grace_);
    reaper_.own(watchdog_->pid(), [](pid_t pid, int status) {
      spdlog::error(
          "error: the worker watchdog (pid {}) ended ({} {}): workers are no longer ended if the agent is "
          "killed",
          pid, WIFSIGNALED(status) ? "signal" : "exit", WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    });
    backend_ = make_exec_backend(reaper_, &*watchdog_);
    update_status([this](Status& s) { s.process_backend = backend_->name(); });
  }
  return *backend_;
}

const std::string& NodeRuntime::agent_tag() {
  process_backend();
  return watchdog_->environment_entry();
}

}  // namespace elastrun::launcher
