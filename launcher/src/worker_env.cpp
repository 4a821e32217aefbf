#include "worker_env.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "elastrun/control.hpp"

namespace elastrun::launcher {

namespace fs = std::filesystem;

const std::vector<std::string>& worker_variable_names() {
  static const std::vector<std::string> names = {"RANK",
                                                 "LOCAL_RANK",
                                                 "GROUP_RANK",
                                                 "ROLE_RANK",
                                                 "ROLE_NAME",
                                                 "LOCAL_WORLD_SIZE",
                                                 "WORLD_SIZE",
                                                 "GROUP_WORLD_SIZE",
                                                 "ROLE_WORLD_SIZE",
                                                 "MASTER_ADDR",
                                                 "MASTER_PORT",
                                                 "TORCHELASTIC_RESTART_COUNT",
                                                 "TORCHELASTIC_MAX_RESTARTS",
                                                 "TORCHELASTIC_RUN_ID",
                                                 "ELASTRUN_AGENT_TAG",
                                                 "TORCHELASTIC_ERROR_FILE",
                                                 "TORCHELASTIC_USE_AGENT_STORE",
                                                 "ELASTRUN_GENERATION",
                                                 "ELASTRUN_NODE",
                                                 "NODE_RANK",
                                                 "ELASTRUN_CONTROL_FILE",
                                                 "ELASTRUN_CHECKPOINT_DIR",
                                                 "ELASTRUN_CHECKPOINTED_EXIT_CODE"};
  return names;
}

std::vector<std::string> inherited_environment(char** entries) {
  const auto& ours = worker_variable_names();
  std::vector<std::string> kept;
  for (char** e = entries; e && *e; ++e) {
    std::string_view kv(*e);
    auto name = kv.substr(0, kv.find('='));
    if (std::find(ours.begin(), ours.end(), name) == ours.end()) kept.emplace_back(kv);
  }
  return kept;
}

std::vector<std::string> worker_variables(const AttemptContext& a, int local, const std::string& error_file,
                                          const std::vector<std::string>& inherited) {
  const auto& o = a.options;
  const auto& r = a.round;
  std::vector<std::string> env;
  auto set = [&](std::string_view key, const auto& value) { env.push_back(fmt::format("{}={}", key, value)); };
  set("RANK", r.rank_offset + local);
  set("LOCAL_RANK", local);
  set("GROUP_RANK", r.group_rank);
  set("ROLE_RANK", r.role_rank_offset + local);
  set("ROLE_NAME", o.role);
  set("LOCAL_WORLD_SIZE", o.nproc_per_node);
  set("WORLD_SIZE", r.world_size);
  set("GROUP_WORLD_SIZE", r.group_world_size);
  set("ROLE_WORLD_SIZE", r.role_world_size);
  set("MASTER_ADDR", r.master_addr);
  // the static form keeps the user's port for the workers (Options::static_form)
  set("MASTER_PORT", o.static_form() ? o.static_master_port() : r.master_port);
  set("TORCHELASTIC_RESTART_COUNT", a.restart_count);
  set("TORCHELASTIC_MAX_RESTARTS", o.max_restarts);
  set("TORCHELASTIC_RUN_ID", a.run_id);
  set("TORCHELASTIC_ERROR_FILE", error_file);
  set("TORCHELASTIC_USE_AGENT_STORE", "False");
  set("ELASTRUN_GENERATION", r.generation);
  set("ELASTRUN_NODE", a.node_name);
  set("ELASTRUN_CONTROL_FILE", a.control_file);
  set("ELASTRUN_CHECKPOINTED_EXIT_CODE", elastrun::control::kCheckpointedExitCode);
  if (!o.checkpoint_dir.empty()) set("ELASTRUN_CHECKPOINT_DIR", o.checkpoint_dir);
  if (!a.agent_tag.empty()) env.push_back(a.agent_tag);  // the watchdog finds the workers' descendants by it
  if (!a.events_file.empty()) set("ELASTRUN_EVENTS_FILE", a.events_file);
  const bool omp_set = std::any_of(inherited.begin(), inherited.end(),
                                   [](const std::string& kv) { return kv.starts_with("OMP_NUM_THREADS="); });
  if (!omp_set && o.nproc_per_node > 1) set("OMP_NUM_THREADS", 1);
  return env;
}

std::vector<WorkerSpec> worker_specs(const AttemptContext& a, const std::vector<std::string>& inherited) {
  const auto& o = a.options;
  std::vector<WorkerSpec> specs;
  for (int local = 0; local < o.nproc_per_node; ++local) {
    WorkerSpec s;
    s.local_rank = local;
    s.global_rank = a.round.rank_offset + local;
    s.path = a.program_path;
    s.argv = a.argv;
    const fs::path dir = a.attempt_dir / std::to_string(local);
    fs::create_directories(dir);
    s.error_file = (dir / "error.json").string();
    std::error_code ec;
    fs::remove(s.error_file, ec);
    s.env = inherited;
    if (!a.events_file.empty())  // ours replaces one the user exported; without ours, the user's stays
      std::erase_if(s.env, [](const std::string& kv) { return kv.starts_with("ELASTRUN_EVENTS_FILE="); });
    auto ours = worker_variables(a, local, s.error_file, inherited);
    s.env.insert(s.env.end(), std::make_move_iterator(ours.begin()), std::make_move_iterator(ours.end()));

    const bool shown = !o.local_ranks_filter || o.local_ranks_filter->contains(local);
    const int redirect = o.log_dir.empty() ? 0 : o.redirects.for_rank(local);
    const int tee = o.log_dir.empty() ? 0 : o.tee.for_rank(local);
    s.console_stdout = shown && (!(redirect & 1) || (tee & 1));
    s.console_stderr = shown && (!(redirect & 2) || (tee & 2));
    if ((redirect | tee) & 1) s.stdout_file = (dir / "stdout.log").string();
    if ((redirect | tee) & 2) s.stderr_file = (dir / "stderr.log").string();
    specs.push_back(std::move(s));
  }
  return specs;
}

}  // namespace elastrun::launcher
