#include "requeue.hpp"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "elastrun/rdzv/hostlist.hpp"
#include "elastrun/slurm/api.hpp"

namespace elastrun::launcher {

std::optional<SlurmJobView> load_slurm_job(const std::string& job_id) {
  const auto id = slurm::numeric_job_id(job_id);
  if (!id) return std::nullopt;
  const auto job = slurm::load_job(*id);
  if (!job) return std::nullopt;
  SlurmJobView view;
  view.cancelled = job->cancelled;
  view.timed_out = job->timed_out;
  view.preempted = job->preempted;
  view.restart_count = job->restart_count;
  if (!job->batch_host.empty()) {
    view.batch_host = job->batch_host;
    // a node that failed is excised from the job's node list, but BatchHost stays
    const auto nodes = rdzv::expand_hostlist(job->nodes);
    view.batch_host_left = nodes && std::find(nodes->begin(), nodes->end(), view.batch_host) == nodes->end();
  }
  return view;
}

namespace {
CallResult result_of(const std::string& error) { return error.empty() ? CallResult{} : CallResult::failed(error); }
std::string not_numeric(const std::string& job_id) { return fmt::format("'{}' is not a numeric job id", job_id); }
}  // namespace

CallResult requeue_slurm_job(const std::string& job_id) {
  const auto id = slurm::numeric_job_id(job_id);
  return id ? result_of(slurm::requeue_job(*id)) : CallResult::failed(not_numeric(job_id));
}

CallResult complete_slurm_job(const std::string& job_id, int exit_code) {
  const auto id = slurm::numeric_job_id(job_id);
  return id ? result_of(slurm::complete_job(*id, exit_code)) : CallResult::failed(not_numeric(job_id));
}

std::optional<std::chrono::seconds> slurmd_timeout() { return slurm::slurmd_timeout(); }

CallResult exclude_nodes_from_job(const std::string& job_id, const std::vector<std::string>& nodes) {
  const auto id = slurm::numeric_job_id(job_id);
  if (!id) return CallResult::failed(not_numeric(job_id));
  if (nodes.empty()) return {};
  std::string list;
  for (const auto& n : nodes) list += (list.empty() ? "" : ",") + n;
  std::string error;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  do {  // slurmctld may refuse while the job is being requeued: retry briefly
    error = slurm::exclude_nodes(*id, list);
    if (error.empty()) return {};
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  } while (std::chrono::steady_clock::now() < deadline);
  return CallResult::failed(error);
}

RequeueLedger::RequeueLedger(std::string checkpoint_dir, std::string job_id, int slurm_restart_count)
    : job_id_(std::move(job_id)), restart_count_(slurm_restart_count) {
  if (checkpoint_dir.empty()) {
    for (auto& u : used_) u = restart_count_;
    return;
  }
  path_ = (std::filesystem::path(checkpoint_dir) / "elastrun-requeue.json").string();
  std::ifstream in(path_);
  if (!in) return;
  auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || j.value("job_id", std::string()) != job_id_) return;  // another job's
  for (int c = 0; c < kFailureClasses; ++c)
    used_[c] = j.value(std::string(to_string(static_cast<FailureClass>(c))), std::int64_t{0});
}

std::int64_t RequeueLedger::used(FailureClass c) const { return used_[static_cast<int>(c)]; }

CallResult RequeueLedger::charge(FailureClass c) {
  ++used_[static_cast<int>(c)];
  if (path_.empty()) return {};
  nlohmann::json j;
  j["job_id"] = job_id_;
  for (int k = 0; k < kFailureClasses; ++k) j[std::string(to_string(static_cast<FailureClass>(k)))] = used_[k];
  const std::string tmp = path_ + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << j.dump() << "\n";
    if (!out) return CallResult::failed(fmt::format("cannot write {}", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path_, ec);
  if (ec) return CallResult::failed(fmt::format("cannot rename {} to {}: {}", tmp, path_, ec.message()));
  return {};
}

RequeueDecision decide_requeue(FailureClass cls, int signal, bool under_slurm, const std::optional<SlurmJobView>& job,
                               const RequeueLedger& ledger, const std::array<std::int64_t, kFailureClasses>& budgets) {
  using Verdict = RequeueDecision::Verdict;
  RequeueDecision d;
  d.cls = cls;
  if (!under_slurm) {
    d.verdict = Verdict::NotSlurm;
    return d;
  }
  if (signal == SIGTERM) {
    if (!job) {
      d.slurmctld_unreachable = true;
    } else if (job->cancelled) {
      d.verdict = Verdict::Cancelled;
      return d;
    } else if (job->timed_out) {
      d.cls = FailureClass::TimeLimit;
    } else if (!job->preempted) {
      d.verdict = Verdict::NotPreempted;
      return d;
    }
  }
  d.budget = budgets[static_cast<std::size_t>(d.cls)];
  d.used = ledger.used(d.cls);
  if (d.budget != kUnlimited && d.used >= d.budget) d.verdict = Verdict::BudgetUsedUp;
  return d;
}

bool requeue_job(const rdzv::SlurmEnv* slurm, const AgentOptions& options, FailureClass cls,
                 const std::vector<std::string>& exclude, int signal) {
  using Verdict = RequeueDecision::Verdict;
  const std::string job_id = slurm ? slurm->job_id : std::string();
  const RequeueLedger ledger_view(options.checkpoint_dir, job_id, slurm ? slurm->restart_count : 0);
  const std::optional<SlurmJobView> job = slurm && signal == SIGTERM ? load_slurm_job(job_id) : std::nullopt;
  const auto d = decide_requeue(cls, signal, slurm != nullptr, job, ledger_view, options.requeue_budget);
  if (d.slurmctld_unreachable)
    spdlog::warn("warning: cannot ask slurmctld about job {}; treating SIGTERM as preemption", job_id);
  const auto budget_text = d.budget == kUnlimited ? std::string("inf") : std::to_string(d.budget);
  switch (d.verdict) {
    case Verdict::NotSlurm:
      spdlog::info(
          "requeue ({}): not running under Slurm, so the job cannot be requeued; the exit code tells the caller",
          to_string(cls));
      return false;
    case Verdict::Cancelled: spdlog::info("job {} was cancelled (scancel): not requeueing", job_id); return false;
    case Verdict::NotPreempted:
      spdlog::info("SIGTERM, but job {} is neither preempted nor out of time (kill? scancel --signal?): not requeueing",
                   job_id);
      return false;
    case Verdict::BudgetUsedUp:
      spdlog::info("requeue budget for class {} used up ({} of {}{}): job {} is not requeued", to_string(d.cls), d.used,
                   budget_text, ledger_view.path().empty() ? ", counted by SLURM_RESTART_COUNT" : "", job_id);
      return false;
    case Verdict::Requeue: break;
  }
  RequeueLedger ledger = ledger_view;
  if (auto r = ledger.charge(d.cls); !r.ok) spdlog::warn("warning: requeue ledger: {}", r.error);
  if (auto r = requeue_slurm_job(job_id); !r.ok) {
    spdlog::error("error: slurm_requeue({}): {} (submit with sbatch --requeue; needs a batch job)", job_id, r.error);
    return false;
  }
  spdlog::info("requeued job {} (class {}, requeue {} of {})", job_id, to_string(d.cls), d.used + 1, budget_text);
  if (!exclude.empty()) {
    std::string list;
    for (const auto& n : exclude) list += (list.empty() ? "" : ",") + n;
    // Slurm's SIGTERM/SIGKILL for the requeue may end us before the outcome is logged
    spdlog::info("excluding node(s) {} from requeued job {} (best effort)", list, job_id);
    spdlog::default_logger()->flush();
    if (auto r = exclude_nodes_from_job(job_id, exclude); !r.ok)
      spdlog::warn("warning: could not exclude node(s) {} from requeued job {}: {}", list, job_id, r.error);
    else
      spdlog::info("requeued job {} excludes node(s) {}", job_id, list);
  }
  return true;
}

}  // namespace elastrun::launcher
