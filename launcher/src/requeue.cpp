#include "requeue.hpp"

#include <slurm/slurm.h>
#include <slurm/slurm_errno.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace elastrun::launcher {
namespace {

void slurm_init_once() {
  static std::once_flag once;
  std::call_once(once, [] { slurm_init(nullptr); });  // $SLURM_CONF or the default; idempotent
}

std::optional<std::uint32_t> numeric_job_id(const std::string& job_id) {
  char* end = nullptr;
  unsigned long id = std::strtoul(job_id.c_str(), &end, 10);
  if (job_id.empty() || *end != '\0' || id == 0 || id > 0xfffffff0UL) return std::nullopt;
  return static_cast<std::uint32_t>(id);
}

std::string last_slurm_error() { return slurm_strerror(slurm_get_errno()); }

struct JobInfoDeleter {
  void operator()(job_info_msg_t* m) const { slurm_free_job_info_msg(m); }
};

}  // namespace

std::optional<SlurmJobView> load_slurm_job(const std::string& job_id) {
  auto id = numeric_job_id(job_id);
  if (!id) return std::nullopt;
  slurm_init_once();
  job_info_msg_t* raw = nullptr;
  if (slurm_load_job(&raw, *id, SHOW_ALL) != SLURM_SUCCESS || !raw) return std::nullopt;
  std::unique_ptr<job_info_msg_t, JobInfoDeleter> info(raw);
  if (info->record_count < 1) return std::nullopt;
  const auto& job = info->job_array[0];
  SlurmJobView view;
  const auto base = job.job_state & JOB_STATE_BASE;
  view.cancelled = base == JOB_CANCELLED;
  view.timed_out = base == JOB_TIMEOUT;
  view.preempted = base == JOB_PREEMPTED || job.preempt_time != 0;
  view.restart_count = job.restart_cnt;
  return view;
}

std::string requeue_slurm_job(const std::string& job_id) {
  auto id = numeric_job_id(job_id);
  if (!id) return fmt::format("'{}' is not a numeric job id", job_id);
  slurm_init_once();
  if (slurm_requeue(*id, 0) != SLURM_SUCCESS) return last_slurm_error();
  return {};
}

std::string exclude_nodes_from_job(const std::string& job_id, const std::vector<std::string>& nodes) {
  auto id = numeric_job_id(job_id);
  if (!id) return fmt::format("'{}' is not a numeric job id", job_id);
  if (nodes.empty()) return {};
  slurm_init_once();
  std::string list;
  for (const auto& n : nodes) list += (list.empty() ? "" : ",") + n;
  std::string error;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  do {
    job_desc_msg_t desc;
    slurm_init_job_desc_msg(&desc);
    desc.job_id = *id;
    desc.exc_nodes = list.data();
    if (slurm_update_job(&desc) == SLURM_SUCCESS) return {};
    error = last_slurm_error();
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  } while (std::chrono::steady_clock::now() < deadline);
  return error;
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

std::string RequeueLedger::charge(FailureClass c) {
  ++used_[static_cast<int>(c)];
  if (path_.empty()) return {};
  nlohmann::json j;
  j["job_id"] = job_id_;
  for (int k = 0; k < kFailureClasses; ++k) j[std::string(to_string(static_cast<FailureClass>(k)))] = used_[k];
  const std::string tmp = path_ + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << j.dump() << "\n";
    if (!out) return fmt::format("cannot write {}", tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path_, ec);
  if (ec) return fmt::format("cannot rename {} to {}: {}", tmp, path_, ec.message());
  return {};
}

}  // namespace elastrun::launcher
