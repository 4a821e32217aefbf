#include "torch_env.hpp"

#include <fmt/format.h>

#include "collective_env.hpp"
#include "elastrun/util/parse.hpp"
#include "elastrun/worker/contract.hpp"
#include "gpu_binding.hpp"

namespace elastrun::spank {

const std::vector<std::string>& torch_variable_names() {
  static const std::vector<std::string> names(contract::env::kTorch.begin(), contract::env::kTorch.end());
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
  const std::string restarts = std::to_string(s.restart_count);
  if (mode == RunIdMode::Job) return rdzv::format_run_id(s.job_id, std::nullopt, restarts);
  return rdzv::format_run_id(s.job_id, s.step_id.value_or("0"), restarts);
}

EnvVars torch_environment(const rdzv::DetectedEnv& task, const std::string& master_addr, RunIdMode mode) {
  const auto& p = task.placement;
  const auto& endpoint = *task.rdzv_endpoint;
  auto str = [](int v) { return std::to_string(v); };
  return {
      {std::string(contract::env::kRank), str(p.rank)},
      {std::string(contract::env::kLocalRank), str(p.local_rank)},
      {std::string(contract::env::kWorldSize), str(p.world_size)},
      {std::string(contract::env::kLocalWorldSize), str(p.local_world_size)},
      {std::string(contract::env::kGroupRank), str(p.node_rank)},
      {std::string(contract::env::kNodeRank), str(p.node_rank)},
      {std::string(contract::env::kGroupWorldSize), str(p.num_nodes)},
      {std::string(contract::env::kRoleRank), str(p.rank)},
      {std::string(contract::env::kRoleName), "default"},
      {std::string(contract::env::kRoleWorldSize), str(p.world_size)},
      {std::string(contract::env::kMasterAddr), master_addr},
      {std::string(contract::env::kMasterPort), std::to_string(endpoint.port)},
      {std::string(contract::env::kRunId), run_id(task, mode)},
      {std::string(contract::env::kRestartCount), "0"},
      {std::string(contract::env::kMaxRestarts), "0"},
  };
}

EnvVars task_device_environment(const rdzv::EnvMap& task_env, int local_rank, const std::string& socket_ifname) {
  auto value = [&](const char* name) -> std::optional<std::string> {
    const auto it = task_env.find(name);
    if (it == task_env.end()) return std::nullopt;
    return it->second;
  };
  std::optional<int> gpus_on_node;
  if (auto text = value("SLURM_GPUS_ON_NODE")) gpus_on_node = util::parse_integer<int>(*text);
  EnvVars vars;
  if (auto device = launcher::task_device(value("CUDA_VISIBLE_DEVICES"), gpus_on_node, local_rank))
    vars.emplace_back(std::string(contract::env::kDevice), std::to_string(*device));
  std::vector<std::string> inherited;
  for (const auto& [name, v] : task_env) inherited.push_back(name + "=" + v);
  for (auto& kv : launcher::collective_defaults(socket_ifname, inherited)) vars.push_back(std::move(kv));
  return vars;
}

}  // namespace elastrun::spank
