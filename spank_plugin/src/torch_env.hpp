// Pure computation of the torch.distributed environment of one task of a Slurm step
// (RANK, LOCAL_RANK, WORLD_SIZE, ..., MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID) from the
// task's Slurm environment, through elastrun_env's detect_environment. Unit-tested directly.
#pragma once

#include <elastrun/rdzv/env.hpp>

#include <string>
#include <utility>
#include <vector>

#include "options.hpp"

namespace elastrun::spank {

using EnvVars = std::vector<std::pair<std::string, std::string>>;

// The variables --torch-env sets (every one of them, always, overwriting inherited values).
const std::vector<std::string>& torch_variable_names();

// The task environment with inherited torch/launcher variables removed (RANK, MASTER_ADDR, ...,
// OMPI_COMM_WORLD_*), so that detection describes the Slurm step and not, say, a stale RANK
// exported in the submitting shell.
rdzv::EnvMap slurm_view(rdzv::EnvMap env);

// Detects the step from a task's (or the step's) environment; throws rdzv::EnvError /
// OptionError with a one-line message if it is not a parallel Slurm step.
rdzv::DetectedEnv detect_step(const rdzv::EnvMap& env, const rdzv::HostlistExpander& expand);

// Name of the step's first node (of the first component taking part, in a het step).
std::string master_node(const rdzv::DetectedEnv& step);

// TORCHELASTIC_RUN_ID for the step.
std::string run_id(const rdzv::DetectedEnv& step, RunIdMode mode);

// The variables for one task. `master_addr` is the resolved address of master_node().
EnvVars torch_environment(const rdzv::DetectedEnv& task, const std::string& master_addr, RunIdMode mode);

// What the agent gives its workers besides the torch variables, for one task from its own
// environment (`task_env`, as Slurm set it): ELASTRUN_DEVICE, the index to pass to set_device
// (gpu_binding.hpp: task_device; none without GPUs), and the collective libraries' defaults
// (collective_env.hpp: NCCL's async error handling; with `socket_ifname`, NCCL_SOCKET_IFNAME and
// GLOO_SOCKET_IFNAME), each of those unless the task's environment sets it.
EnvVars task_device_environment(const rdzv::EnvMap& task_env, int local_rank, const std::string& socket_ifname);

}  // namespace elastrun::spank
