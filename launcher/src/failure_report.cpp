#include "failure_report.hpp"

#include <algorithm>

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "elastrun/rdzv/rendezvous.hpp"

namespace elastrun::launcher {

std::string Failure::how() const {
  return signal ? fmt::format("killed by {} ({})", signal_name(signal), signal)
                : fmt::format("exited with code {}", exit_code);
}

std::string Failure::one_line() const {
  if (!lost.empty()) return fmt::format("node {} lost: {}", node, lost);
  std::string line = fmt::format("rank {} (local rank {}, node {}) {}", rank, local_rank, node, how());
  if (!watchdog.empty()) line += fmt::format(" by the agent: {}", watchdog);
  if (!exec_error.empty())
    line += ": " + exec_error;
  else if (error && !error->message.empty())
    line += ": " + error->message;
  return line;
}

nlohmann::json Failure::to_json() const {
  nlohmann::json j = {
      {"time_ms", std::chrono::duration_cast<std::chrono::milliseconds>(when.time_since_epoch()).count()},
      {"node", node},
      {"rank", rank},
      {"local_rank", local_rank},
      {"exit_code", exit_code},
      {"signal", signal},
      {"restart_count", restart_count},
      {"error_file", error_file},
      {"exec_error", exec_error}};
  if (!watchdog.empty()) j["watchdog"] = watchdog;
  if (!lost.empty()) j["lost"] = lost;
  if (!stacks.empty()) j["stacks"] = stacks.substr(0, 16384);
  if (error) j["error"] = {{"message", error->message}, {"traceback", error->traceback.substr(0, 4096)}};
  return j;
}

std::optional<Failure> Failure::from_json(const std::string& text) {
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
  f.watchdog = j.value("watchdog", std::string());
  f.lost = j.value("lost", std::string());
  f.stacks = j.value("stacks", std::string());
  if (j.contains("error") && j["error"].is_object())
    f.error =
        ErrorFileInfo{j["error"].value("message", std::string()), j["error"].value("traceback", std::string()), {}};
  return f;
}

Failure failure_from_exit(const WorkerExit& e, const std::string& node, int restart_count,
                          const std::string& error_file) {
  Failure f;
  f.when = e.when;
  f.node = node;
  f.rank = e.global_rank;
  f.local_rank = e.local_rank;
  f.exit_code = e.exit_code;
  f.signal = e.signal;
  f.restart_count = restart_count;
  f.exec_error = e.exec_error;
  f.error_file = error_file;
  if (!f.error_file.empty()) f.error = read_error_file(f.error_file);
  return f;
}

std::string iso_time(std::chrono::system_clock::time_point t) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count() % 1000;
  return fmt::format("{:%Y-%m-%dT%H:%M:%S}.{:03}Z", fmt::gmtime(std::chrono::system_clock::to_time_t(t)), ms);
}

std::vector<std::string> summary_lines(const std::string& run_id, const std::vector<Failure>& failures, bool job_wide,
                                       int max_restarts) {
  if (failures.empty()) return {};
  const auto by_time = [](const Failure& a, const Failure& b) { return a.when < b.when; };
  const auto root = std::min_element(failures.begin(), failures.end(), by_time);
  std::vector<std::string> out;
  out.push_back(fmt::format("================ elastrun: job failed (run '{}') ================", run_id));
  out.push_back("root cause (first failure):");
  out.push_back(fmt::format("  time       : {}", iso_time(root->when)));
  out.push_back(fmt::format("  node       : {}", root->node));
  if (!root->lost.empty()) {
    out.push_back(fmt::format("  lost       : {}", root->lost));
  } else {
    out.push_back(fmt::format("  rank       : {} (local rank {})", root->rank, root->local_rank));
    out.push_back(fmt::format("  {:<11}: {}", root->signal ? "signal" : "exit code",
                              root->signal ? fmt::format("{} ({})", signal_name(root->signal), root->signal)
                                           : std::to_string(root->exit_code)));
  }
  out.push_back(fmt::format("  restart    : {} of {}", root->restart_count, max_restarts));
  if (!root->exec_error.empty()) out.push_back(fmt::format("  error      : {}", root->exec_error));
  if (!root->watchdog.empty()) out.push_back(fmt::format("  killed     : by the agent: {}", root->watchdog));
  if (!root->stacks.empty()) {
    out.push_back("  stacks     :");
    std::string_view st = root->stacks;
    for (int n = 0; !st.empty() && n < 200; ++n) {
      auto nl = st.find('\n');
      out.push_back(fmt::format("    {}", st.substr(0, nl)));
      st = nl == std::string_view::npos ? std::string_view{} : st.substr(nl + 1);
    }
  }
  if (root->error) {
    out.push_back(fmt::format("  error file : {}", root->error_file));
    out.push_back(fmt::format("  message    : {}", root->error->message));
    if (!root->error->traceback.empty()) {
      out.push_back("  traceback  :");
      std::string_view tb = root->error->traceback;
      while (!tb.empty()) {
        auto nl = tb.find('\n');
        out.push_back(fmt::format("    {}", tb.substr(0, nl)));
        tb = nl == std::string_view::npos ? std::string_view{} : tb.substr(nl + 1);
      }
    }
  } else if (!root->error_file.empty()) {
    out.push_back(
        fmt::format("  error file : {} (not written; decorate main with "
                    "torch.distributed.elastic.multiprocessing.errors.record)",
                    root->error_file));
  }
  if (failures.size() > 1) {
    out.push_back(job_wide ? "other failures (all nodes, by time):" : "other failures on this node:");
    std::vector<const Failure*> others;
    for (const auto& f : failures) {
      // every survivor records the same lost node: list it once
      const auto same_loss = [&](const Failure* o) { return !f.lost.empty() && !o->lost.empty() && o->node == f.node; };
      if (&f != &*root && !same_loss(&*root) && std::none_of(others.begin(), others.end(), same_loss))
        others.push_back(&f);
    }
    std::stable_sort(others.begin(), others.end(), [&](const Failure* a, const Failure* b) { return by_time(*a, *b); });
    for (const auto* f : others) out.push_back(fmt::format("  {} {}", iso_time(f->when), f->one_line()));
  }
  out.push_back("=================================================================");
  return out;
}

void FailureReport::add(Failure f, rdzv::Rendezvous& rdzv, const std::string& agent_key, pid_t pid) {
  spdlog::warn("worker {} (pid {}) failed: {}", f.rank, pid, f.one_line());
  try {
    rdzv.publish(fmt::format("failures/{}/{:06}", agent_key, failures_.size()), f.to_json().dump());
  } catch (const std::exception& ex) {
    spdlog::warn("warning: publishing the failure for the job-wide summary: {}", ex.what());
  }
  failures_.push_back(std::move(f));
}

void FailureReport::add_loss(const std::string& node, const std::string& how,
                             std::chrono::system_clock::time_point when, rdzv::Rendezvous& rdzv,
                             const std::string& agent_key) {
  Failure f;
  f.when = when;
  f.node = node;
  f.rank = -1;
  f.lost = how;
  f.restart_count = failures_.empty() ? 0 : failures_.back().restart_count;
  spdlog::warn("{}", f.one_line());
  try {
    rdzv.publish(fmt::format("failures/{}/{:06}", agent_key, failures_.size()), f.to_json().dump());
  } catch (const std::exception& ex) {
    spdlog::warn("warning: publishing the failure for the job-wide summary: {}", ex.what());
  }
  failures_.push_back(std::move(f));
}

// Every agent's published failures (ours included); ours alone if the store cannot be read.
std::vector<Failure> FailureReport::job_failures(rdzv::Rendezvous& rdzv) const {
  std::vector<Failure> all;
  try {
    for (const auto& [key, value] : rdzv.read_prefix("failures/"))
      if (auto f = Failure::from_json(value)) all.push_back(std::move(*f));
  } catch (const std::exception& e) {
    spdlog::warn("warning: reading the other agents' failures: {}; summary of this node only", e.what());
    return failures_;
  }
  if (all.size() < failures_.size()) return failures_;  // e.g. after a failover to a standby store
  return all;
}

void FailureReport::print_summary(rdzv::Rendezvous* rdzv, const std::string& run_id, int max_restarts) {
  if (printed_) return;
  const bool job_wide = rdzv && rdzv->current().group_world_size > 0 && rdzv->current().group_rank == 0;
  const auto lines = summary_lines(run_id, job_wide ? job_failures(*rdzv) : failures_, job_wide, max_restarts);
  if (lines.empty()) return;
  printed_ = true;
  for (const auto& line : lines) spdlog::error("{}", line);
}

}  // namespace elastrun::launcher
