#include "job_status.hpp"

#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>

namespace elastrun::jobs {

namespace {

double time_of(const nlohmann::json& e) { return e.value("time", 0.0); }

std::string text_of(const nlohmann::json& e, const char* key) {
  auto it = e.find(key);
  return it != e.end() && it->is_string() ? it->get<std::string>() : std::string();
}

long long_of(const nlohmann::json& e, const char* key, long fallback) {
  auto it = e.find(key);
  return it != e.end() && it->is_number_integer() ? it->get<long>() : fallback;
}

double real_of(const nlohmann::json& e, const char* key) {
  auto it = e.find(key);
  return it != e.end() && it->is_number() ? it->get<double>() : 0.0;
}

}  // namespace

std::string app_state_of_slurm(const std::string& s) {
  if (s == "PENDING" || s == "REQUEUED" || s == "REQUEUE_HOLD" || s == "REQUEUE_FED" || s == "SUSPENDED" ||
      s == "RESV_DEL_HOLD")
    return "PENDING";
  if (s == "RUNNING" || s == "CONFIGURING" || s == "COMPLETING" || s == "RESIZING" || s == "SIGNALING" ||
      s == "STAGE_OUT" || s == "STOPPED")
    return "RUNNING";
  if (s == "COMPLETED") return "SUCCEEDED";
  if (s == "CANCELLED") return "CANCELLED";
  if (s == "FAILED" || s == "TIMEOUT" || s == "NODE_FAIL" || s == "PREEMPTED" || s == "BOOT_FAIL" || s == "DEADLINE" ||
      s == "OUT_OF_MEMORY" || s == "SPECIAL_EXIT")
    return "FAILED";
  return "UNKNOWN";
}

std::string app_state(const std::string& slurm_state, const std::string& outcome, bool cancel_requested) {
  const std::string from_slurm = slurm_state.empty() ? "" : app_state_of_slurm(slurm_state);
  if (from_slurm == "PENDING" || from_slurm == "RUNNING") return from_slurm;
  // ended (or forgotten by slurmctld): a cancel we asked for is CANCELLED whatever the batch
  // script's exit made of it (the agents checkpointed and stopped first)
  if (cancel_requested) return "CANCELLED";
  if (!from_slurm.empty() && from_slurm != "UNKNOWN") {
    // the agents know better than srun's code when a shrink made Slurm end tasks
    if (from_slurm == "FAILED" && outcome == "succeeded") return "SUCCEEDED";
    return from_slurm;
  }
  if (outcome == "succeeded") return "SUCCEEDED";
  if (outcome == "failed" || outcome == "checkpointed") return "FAILED";
  return "UNKNOWN";
}

JobSummary summarise(std::vector<nlohmann::json> events) {
  std::erase_if(events, [](const nlohmann::json& e) { return !e.is_object() || !e.contains("event"); });
  std::stable_sort(events.begin(), events.end(),
                   [](const nlohmann::json& a, const nlohmann::json& b) { return time_of(a) < time_of(b); });
  JobSummary s;
  if (events.empty()) return s;
  s.first_time = time_of(events.front());
  s.last_time = time_of(events.back());

  std::set<std::pair<std::string, long>> rounds_seen;
  std::set<std::string> lost_seen;
  std::set<std::pair<std::string, long>> requeues_seen;
  std::string newest_run;
  // an outage: from the first sign of a failure to the next training step (or, for workers that
  // write no steps, the next start of workers)
  // (plain doubles, -1 for none: GCC 12 misreads std::optional<double> here as uninitialised)
  double outage_from = -1, outage_started = -1;
  std::vector<std::pair<double, long>> round_steps;  // the newest round's (time, step)
  for (const auto& e : events) {
    const std::string kind = text_of(e, "event");
    const double t = time_of(e);
    if (kind == "round") {
      const auto key = std::make_pair(text_of(e, "run_id"), long_of(e, "generation", 0));
      if (!rounds_seen.insert(key).second) continue;
      RoundSeen r;
      r.time = t;
      r.generation = key.second;
      r.world_size = static_cast<int>(long_of(e, "world_size", 0));
      if (auto m = e.find("members"); m != e.end() && m->is_array())
        for (const auto& name : *m)
          if (name.is_string()) r.members.push_back(name.get<std::string>());
      s.rounds.push_back(std::move(r));
      s.restarts = static_cast<int>(long_of(e, "restart_count", s.restarts));
      round_steps.clear();
    } else if (kind == "member_lost" || kind == "store_lost") {
      const std::string node = text_of(e, kind == "member_lost" ? "member" : "store_node");
      if (node.empty() || !lost_seen.insert(node).second) continue;
      s.lost.push_back({t, node, kind == "store_lost" ? "with the rendezvous store" : text_of(e, "how")});
      if (s.root_cause.empty()) s.root_cause = "node " + node + " lost";
      if (outage_from < 0) outage_from = t;
    } else if (kind == "straggler") {
      const std::string node = text_of(e, "member");
      if (node.empty() ||
          std::any_of(s.stragglers.begin(), s.stragglers.end(), [&](auto& f) { return f.node == node; }))
        continue;
      s.stragglers.push_back({t, node,
                              fmt::format("{:.2f}x the median node's compute time (rank {}; {})", real_of(e, "ratio"),
                                          long_of(e, "member_rank", -1), text_of(e, "action"))});
    } else if (kind == "health_check") {
      auto ok = e.find("ok");
      if (ok == e.end() || !ok->is_boolean() || ok->get<bool>()) continue;
      const std::string node = text_of(e, "node");
      if (std::any_of(s.unhealthy.begin(), s.unhealthy.end(), [&](auto& f) { return f.node == node; })) continue;
      s.unhealthy.push_back({t, node, text_of(e, "check") + ": " + text_of(e, "what")});
    } else if (kind == "worker_exit") {
      // a worker killed by a signal has exit_code 0 and the signal's name; 85: checkpointed
      const long code = long_of(e, "exit_code", 0);
      const std::string sig = text_of(e, "signal");
      if ((code == 0 || code == 85) && sig.empty()) continue;
      // the agent stops workers with SIGTERM: after a failure (already counted) or for a planned
      // re-form (scale-up), which is no failure
      if (sig == "SIGTERM" && code == 0) continue;
      if (outage_from < 0) outage_from = t;
      if (s.root_cause.empty()) {
        s.root_cause = "rank " + std::to_string(long_of(e, "rank", -1)) + " on node " + text_of(e, "node") +
                       (sig.empty() ? " exited with code " + std::to_string(code) : " killed by " + sig);
      }
    } else if (kind == "failure_decision") {
      if (auto r = long_of(e, "restarts", -1); r >= 0) s.restarts = std::max(s.restarts, static_cast<int>(r));
      s.max_restarts = static_cast<int>(long_of(e, "max_restarts", s.max_restarts));
    } else if (kind == "requeue") {
      auto it = e.find("requeued");
      if (it != e.end() && it->is_boolean() && it->get<bool>() &&
          requeues_seen.insert({text_of(e, "run_id"), static_cast<long>(t)}).second)
        ++s.requeues;
    } else if (kind == "workers_started") {
      if (outage_from >= 0 && outage_started < 0) outage_started = t;
    } else if (kind == "step") {
      const long step = long_of(e, "step", -1);
      if (step < 0) continue;
      if (outage_from >= 0) {
        s.time_lost_s += t - outage_from;
        outage_from = outage_started = -1;
      }
      s.step = step;
      s.step_time = t;
      round_steps.emplace_back(t, step);
    } else if (kind == "checkpoint_saved") {
      CheckpointSeen c;
      c.step = long_of(e, "step", 0);
      c.tier = text_of(e, "tier");
      c.time = t;
      c.blocked_s = real_of(e, "blocked_s");
      c.durable_s = real_of(e, "durable_s");
      if (!s.checkpoint || c.step >= s.checkpoint->step) s.checkpoint = c;
    }
    if (!text_of(e, "run_id").empty()) newest_run = text_of(e, "run_id");
  }
  // an outage whose workers started but wrote no step (workers without step events)
  if (outage_from >= 0 && outage_started >= 0) s.time_lost_s += outage_started - outage_from;
  // steps per second over the newest round's last (up to) 50 steps
  if (round_steps.size() >= 2) {
    const auto first = round_steps.size() > 50 ? round_steps.end() - 50 : round_steps.begin();
    const double dt = round_steps.back().first - first->first;
    const long ds = round_steps.back().second - first->second;
    if (dt > 0 && ds > 0) s.steps_per_s = static_cast<double>(ds) / dt;
  }
  return s;
}

}  // namespace elastrun::jobs
