// The node's health checks (--health-check, health_check.hpp): when they run, and what a node
// that fails one does -- it does not join, says why, and leaves the job to the others.
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "agent.hpp"
#include "health_check.hpp"

namespace elastrun::launcher {

namespace {
// pub/unhealthy/<node> = why: the nodes that failed their own checks (excluded on requeue)
constexpr std::string_view kUnhealthyKeys = "unhealthy/";
}  // namespace

std::optional<int> Agent::check_node_health() {
  if (!health_checks_on() || !health_due_) return std::nullopt;
  health_due_ = false;
  const std::string when = health_checked_once_ ? "after a failure" : "first join";
  health_checked_once_ = true;
  HealthContext context{.commands = o_.health_check_commands,
                        .builtin = o_.health_check_builtin,
                        .command_timeout = o_.health_check_timeout,
                        .gpus = gpus_,
                        .memory_budget = o_.memory_checkpoints,
                        .checkpoint_dir = o_.checkpoint_dir,
                        .node = plan_.me.node_name,
                        .run_id = plan_.run_id,
                        .store_node = rdzv_->store_node().empty() ? plan_.store_host : rdzv_->store_node(),
                        .rdzv = rdzv_.get()};
  const auto t0 = Clock::now();
  const auto verdicts = run_health_checks(context, health_marker_);
  const auto ms = std::chrono::duration_cast<Millis>(Clock::now() - t0).count();
  nlohmann::json checks = nlohmann::json::array();
  for (const auto& v : verdicts) checks.push_back({{"check", v.check}, {"ok", v.ok}, {"what", v.what}});
  if (verdicts.empty() || verdicts.back().ok) {
    std::vector<std::string> said;
    for (const auto& v : verdicts) said.push_back(fmt::format("{}: {}", v.check, v.what));
    spdlog::info("health check ({}) passed in {} ms: {}", when, ms, fmt::join(said, "; "));
    events().emit(contract::event::kHealthCheck,
                  {{"ok", true}, {"when", when}, {"duration_ms", ms}, {"checks", std::move(checks)}});
    return std::nullopt;
  }
  const auto& failed = verdicts.back();
  spdlog::error("error: node {} failed its health check ({}, {}): {}; it does not join; exiting {}", plan_.me.node_name,
                when, failed.check, failed.what, contract::kUnhealthyExitCode);
  events().emit(contract::event::kHealthCheck, {{"ok", false},
                                                {"when", when},
                                                {"check", failed.check},
                                                {"what", failed.what},
                                                {"duration_ms", ms},
                                                {"checks", std::move(checks)}});
  leave_unhealthy(fmt::format("failed its health check ({}, {}): {}", when, failed.check, failed.what));
  return contract::kUnhealthyExitCode;
}

void Agent::leave_unhealthy(const std::string& reason) {
  const auto agent_key = fmt::format("{}.{}", plan_.me.node_name, plan_.me.pid);
  try {
    rdzv_->publish(fmt::format("{}{}", kUnhealthyKeys, plan_.me.node_name), reason);
  } catch (const std::exception& e) {
    spdlog::warn("warning: marking this node unhealthy in the store: {}", e.what());
  }
  failures_.add_loss(plan_.me.node_name, reason, std::chrono::system_clock::now(), *rdzv_, agent_key);
  if (!stores_.primary || max_nodes_ <= 1) return;
  // This agent hosts the job's store: it keeps serving it (without joining) until the job ends,
  // or the other agents would lose their rendezvous with it. Ends early when nobody else has
  // been connected for 30 s (the others gave up: nothing would ever close the rendezvous).
  spdlog::info("this node hosts the rendezvous store: serving it, without joining, until the job ends");
  constexpr std::size_t kOwnConnections = 2;  // our rendezvous client and its heartbeat connection
  auto alone_since = Clock::now();
  while (!signals_.stop_signal()) {
    try {
      if (rdzv_->closed_reason()) break;
    } catch (const std::exception& e) {
      spdlog::warn("warning: waiting for the end of the job: {}", e.what());
      break;
    }
    if (stores_.primary->stats().connections > kOwnConnections)
      alone_since = Clock::now();
    else if (Clock::now() - alone_since > std::chrono::seconds(30)) {
      spdlog::info("no other agent has been connected to the store for 30 s: leaving");
      break;
    }
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
}

void Agent::refresh_unhealthy_nodes() {
  if (!health_checks_on()) return;
  std::vector<std::string> nodes;
  try {
    for (const auto& [key, why] : rdzv_->read_prefix(kUnhealthyKeys))
      nodes.push_back(key.substr(kUnhealthyKeys.size()));
  } catch (const std::exception& e) {
    spdlog::warn("warning: reading the nodes that failed their health checks: {}", e.what());
    return;
  }
  std::lock_guard lock(unhealthy_mutex_);
  unhealthy_ = std::move(nodes);
}

std::vector<std::string> Agent::unhealthy_nodes() {
  std::lock_guard lock(unhealthy_mutex_);
  return unhealthy_;
}

void Agent::report_unhealthy_nodes() {
  if (!health_checks_on()) return;
  try {
    for (const auto& [key, why] : rdzv_->read_prefix(kUnhealthyKeys))
      spdlog::warn("node {} left the job: {}", key.substr(kUnhealthyKeys.size()), why);
  } catch (const std::exception&) {
    // the store may be gone at the end
  }
}

}  // namespace elastrun::launcher
