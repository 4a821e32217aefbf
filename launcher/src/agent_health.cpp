// The node's health: its checks before it joins (--health-check, health_check.hpp) and its
// compute time while it trains (--straggler-action, straggler_watch.hpp). A node that fails a
// check, or that group rank 0 excludes as a straggler, leaves the job to the others the same way:
// it says why, is recorded for the job-wide summary and excluded on every requeue.
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "agent.hpp"
#include "health_check.hpp"
#include "worker_env.hpp"

namespace elastrun::launcher {

namespace {
// pub/unhealthy/<node> = why: the nodes that left the job (a failed check, a straggler excluded):
// excluded on requeue
constexpr std::string_view kUnhealthyKeys = "unhealthy/";
// pub/stragglers/<node> = what group rank 0 found (the report at the end);
// pub/straggler-exclude/<node> = why it must leave (--straggler-action=exclude)
constexpr std::string_view kStragglerKeys = "stragglers/";
constexpr std::string_view kStragglerExcludeKeys = "straggler-exclude/";
// pub/straggler/<generation>/<node> = the node's latest window (straggler_watch.hpp: to_store_value)
std::string window_prefix(std::uint64_t generation) { return fmt::format("straggler/{}/", generation); }
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
  return fail_health_check(when, verdicts.back(), ms, std::move(checks));
}

int Agent::fail_health_check(const std::string& when, const HealthVerdict& failed, long long ms,
                             nlohmann::json checks) {
  spdlog::error("error: node {} failed its health check ({}, {}): {}; it {}; exiting {}", plan_.me.node_name, when,
                failed.check, failed.what, group_ ? "stops its workers and leaves the job" : "does not join",
                contract::kUnhealthyExitCode);
  events().emit(contract::event::kHealthCheck, {{"ok", false},
                                                {"when", when},
                                                {"check", failed.check},
                                                {"what", failed.what},
                                                {"duration_ms", ms},
                                                {"checks", std::move(checks)}});
  background_check_.reset();
  if (group_) stop_workers(o_.stop_grace);
  leave_job(fmt::format("failed its health check ({}, {}): {}", when, failed.check, failed.what));
  return contract::kUnhealthyExitCode;
}

// MONITOR, every tick: with --health-check-interval the node-local builtin checks at once and the
// site's commands one after the other in the background (the reaper reaps them), then a pause of
// the interval. A pass says nothing (it would every few seconds); a failure ends this node's part.
std::optional<int> Agent::watch_node_health() {
  if (o_.health_check_interval.count() <= 0 || !health_checks_on() || !group_) return std::nullopt;
  const auto now = Clock::now();
  const std::string when = "while training";
  if (!background_check_) {
    if (now < next_health_check_) return std::nullopt;
    if (o_.health_check_builtin) {
      HealthContext context;
      context.gpus = gpus_;
      context.memory_budget = o_.memory_checkpoints;
      const auto verdicts = run_node_local_checks(context);
      if (!verdicts.back().ok) return fail_health_check(when, verdicts.back(), 0, nlohmann::json::array());
    }
    background_command_ = 0;
    if (o_.health_check_commands.empty()) {
      next_health_check_ = now + o_.health_check_interval;
      return std::nullopt;
    }
    background_check_.emplace(std::vector<std::string>{"/bin/sh", "-c", o_.health_check_commands[0]},
                              o_.health_check_timeout, runtime_.reaper());
    background_check_started_ = now;
    return std::nullopt;
  }
  const auto out = background_check_->poll();
  if (!out) return std::nullopt;
  const auto& command = o_.health_check_commands[background_command_];
  const auto verdict = judge_command(command, *out, o_.health_check_timeout);
  const auto ms = std::chrono::duration_cast<Millis>(now - background_check_started_).count();
  if (!verdict.ok)
    return fail_health_check(
        when, verdict, ms, nlohmann::json::array({{{"check", verdict.check}, {"ok", false}, {"what", verdict.what}}}));
  background_check_.reset();
  if (++background_command_ < o_.health_check_commands.size()) {
    background_check_.emplace(std::vector<std::string>{"/bin/sh", "-c", o_.health_check_commands[background_command_]},
                              o_.health_check_timeout, runtime_.reaper());
    background_check_started_ = now;
  } else {
    next_health_check_ = now + o_.health_check_interval;
  }
  return std::nullopt;
}

std::optional<int> Agent::leave_if_excluded() {
  if (o_.straggler_action != "exclude" || rdzv_->current().group_world_size == 0) return std::nullopt;
  std::optional<std::string> why;
  try {
    why = rdzv_->read(fmt::format("{}{}", kStragglerExcludeKeys, plan_.me.node_name));
  } catch (const std::exception& e) {
    spdlog::warn("warning: reading the straggler exclusions: {}", e.what());
  }
  if (!why) return std::nullopt;
  spdlog::error(
      "error: node {} was excluded as a straggler (--straggler-action=exclude): {}; it leaves the job; "
      "exiting {}",
      plan_.me.node_name, *why, contract::kUnhealthyExitCode);
  leave_job(fmt::format("excluded as a straggler: {}", *why));
  return contract::kUnhealthyExitCode;
}

void Agent::leave_job(const std::string& reason) {
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
  if (!health_checks_on() && o_.straggler_action != "exclude") return;
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

void Agent::report_node_verdicts() {
  if (!health_checks_on() && o_.straggler_action == "off") return;
  try {
    for (const auto& [key, why] : rdzv_->read_prefix(kStragglerKeys))
      spdlog::warn("node {} was a straggler: {}", key.substr(kStragglerKeys.size()), why);
    for (const auto& [key, why] : rdzv_->read_prefix(kUnhealthyKeys))
      spdlog::warn("node {} left the job: {}", key.substr(kUnhealthyKeys.size()), why);
  } catch (const std::exception&) {
    // the store may be gone at the end
  }
}

void Agent::start_straggler_watch() {
  compute_windows_.assign(static_cast<std::size_t>(o_.nproc_per_node), ComputeWindows(o_.straggler_window));
  rank_windows_.assign(static_cast<std::size_t>(o_.nproc_per_node), std::nullopt);
  published_window_ = -1;
  straggler_score_.reset();
  if (o_.straggler_action != "off" && rdzv_->current().group_rank == 0)
    straggler_score_.emplace(StragglerConfig{o_.straggler_threshold, o_.straggler_window, o_.straggler_windows});
}

// MONITOR, every tick: this node's windows into the store; on group rank 0, every second, the
// scores of every node's latest window.
void Agent::watch_stragglers() {
  if (o_.straggler_action == "off" || !group_) return;
  const auto& round = rdzv_->current();
  for (std::size_t local = 0; local < compute_windows_.size(); ++local) {
    const auto r = read_progress(progress_file(attempt_dir_, static_cast<int>(local)).string());
    if (!r || !r->compute_us) continue;
    if (auto w = compute_windows_[local].observe(r->step, *r->compute_us)) rank_windows_[local] = w;
  }
  // the node's value once every local rank has a window newer than the one published: its slowest rank's
  if (!rank_windows_.empty() && std::all_of(rank_windows_.begin(), rank_windows_.end(),
                                            [&](const auto& w) { return w && w->index > published_window_; })) {
    NodeCompute mine{plan_.me.node_name, round.rank_offset, rank_windows_[0]->index, rank_windows_[0]->compute_ms};
    for (std::size_t local = 0; local < rank_windows_.size(); ++local) {
      mine.index = std::min(mine.index, rank_windows_[local]->index);
      if (rank_windows_[local]->compute_ms > mine.compute_ms) {
        mine.compute_ms = rank_windows_[local]->compute_ms;
        mine.rank = round.rank_offset + static_cast<int>(local);
      }
    }
    try {
      rdzv_->publish(window_prefix(round.generation) + plan_.me.node_name, to_store_value(mine));
      published_window_ = mine.index;
    } catch (const std::exception& e) {
      spdlog::warn("warning: publishing this node's compute time: {}", e.what());
    }
  }
  if (!straggler_score_ || Clock::now() < next_straggler_score_) return;
  next_straggler_score_ = Clock::now() + std::chrono::seconds(1);
  std::vector<NodeCompute> latest;
  std::vector<std::string> members;
  for (const auto& m : round.members()) members.push_back(m.node_name);
  try {
    const auto prefix = window_prefix(round.generation);
    for (const auto& [key, value] : rdzv_->read_prefix(prefix))
      if (auto c = node_compute_from(key.substr(prefix.size()), value)) latest.push_back(std::move(*c));
  } catch (const std::exception& e) {
    spdlog::warn("warning: reading the nodes' compute times: {}", e.what());
    return;
  }
  for (const auto& n : straggler_score_->score(latest, members)) {
    const auto what = fmt::format(
        "its compute time is {:.2f}x the median node's ({:.1f} ms a step against {:.1f} ms; rank {}) "
        "for {} window(s) of {} steps in a row (--straggler-threshold {:g})",
        n.ratio, n.compute_ms, n.median_ms, n.rank, n.windows, o_.straggler_window, o_.straggler_threshold);
    spdlog::warn("straggler: node {}: {}{}", n.node, what,
                 o_.straggler_action == "exclude" ? "; excluding it (--straggler-action=exclude)" : "");
    // `member`, `member_rank`: the envelope's own node and rank are the emitter's (events.md)
    events().emit(contract::event::kStraggler, {{"member", n.node},
                                                {"member_rank", n.rank},
                                                {"ratio", n.ratio},
                                                {"compute_ms", n.compute_ms},
                                                {"median_ms", n.median_ms},
                                                {"windows", n.windows},
                                                {"window_steps", o_.straggler_window},
                                                {"action", o_.straggler_action}});
    try {
      rdzv_->publish(fmt::format("{}{}", kStragglerKeys, n.node), what);
      if (o_.straggler_action == "exclude") {
        rdzv_->publish(fmt::format("{}{}", kStragglerExcludeKeys, n.node), what);
        rdzv_->request_new_round();  // everyone re-forms; the straggler leaves at its next RENDEZVOUS
      }
    } catch (const std::exception& e) {
      spdlog::warn("warning: publishing straggler {}: {}", n.node, e.what());
    }
  }
}

}  // namespace elastrun::launcher
