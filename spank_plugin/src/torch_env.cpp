#include "torch_env.hpp"

#include <fmt/format.h>

namespace elastrun::spank {

const std::vector<std::string>& torch_variable_names() {
  static const std::vector<std::string> names = {"RANK",
                                                 "LOCAL_RANK",
                                                 "WORLD_SIZE",
                                                 "LOCAL_WORLD_SIZE",
                                                 "GROUP_RANK",
                                                 "NODE_RANK",
                                                 "GROUP_WORLD_SIZE",
                                                 "ROLE_RANK",
                                                 "ROLE_NAME",
                                                 "ROLE_WORLD_SIZE",
                                                 "MASTER_ADDR",
                                                 "MASTER_PORT",
                                                 "TORCHELASTIC_RUN_ID",
                                                 "TORCHELASTIC_RESTART_COUNT",
                                                 "TORCHELASTIC_MAX_RESTARTS"};
  return names;
}

rdzv::EnvMap slurm_view(rdzv::EnvMap env) {
  for (const auto& name : torch_variable_names()) env.erase(name);
  for (auto it = env.begin(); it != env.end();) {
    // mpirun variables would take precedence over the step (an srun inside mpirun is not ours).
    if (it->first.starts_with("OMPI_COMM_WORLD_"))
      it = env.erase(it);
    else
      ++it;
  }
  return env;
}

rdzv::DetectedEnv detect_step(const rdzv::EnvMap& env, const rdzv::HostlistExpander& expand) {
  auto d = rdzv::detect_environment(slurm_view(env), expand);
  if (!d.slurm || !d.slurm->step_id || d.placement.source != rdzv::RankSource::Slurm)
    throw OptionError(
        "--torch-env needs a Slurm job step (SLURM_STEP_ID and SLURM_PROCID are missing); use "
        "it with srun");
  if (!d.rdzv_endpoint) throw OptionError("no rendezvous endpoint could be derived for the step");
  return d;
}

std::string master_node(const rdzv::DetectedEnv& step) { return step.rdzv_endpoint->host; }

std::string run_id(const rdzv::DetectedEnv& step, RunIdMode mode) {
  const auto& s = *step.slurm;
  if (mode == RunIdMode::Job) return fmt::format("{}.r{}", s.job_id, s.restart_count);
  return fmt::format("{}.{}.r{}", s.job_id, s.step_id.value_or("0"), s.restart_count);
}

EnvVars torch_environment(const rdzv::DetectedEnv& task, const std::string& master_addr, RunIdMode mode) {
  const auto& p = task.placement;
  const auto& endpoint = *task.rdzv_endpoint;
  auto str = [](int v) { return std::to_string(v); };
  return {
      {"RANK", str(p.rank)},
      {"LOCAL_RANK", str(p.local_rank)},
      {"WORLD_SIZE", str(p.world_size)},
      {"LOCAL_WORLD_SIZE", str(p.local_world_size)},
      {"GROUP_RANK", str(p.node_rank)},
      {"NODE_RANK", str(p.node_rank)},
      {"GROUP_WORLD_SIZE", str(p.num_nodes)},
      {"ROLE_RANK", str(p.rank)},
      {"ROLE_NAME", "default"},
      {"ROLE_WORLD_SIZE", str(p.world_size)},
      {"MASTER_ADDR", master_addr},
      {"MASTER_PORT", std::to_string(endpoint.port)},
      {"TORCHELASTIC_RUN_ID", run_id(task, mode)},
      {"TORCHELASTIC_RESTART_COUNT", "0"},
      {"TORCHELASTIC_MAX_RESTARTS", "0"},
  };
}

}  // namespace elastrun::spank
