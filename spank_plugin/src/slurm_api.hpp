// Slurm library functions the plugin calls besides spank.h, looked up at run time in the process
// that loaded the plugin (srun, sbatch, salloc and slurmstepd all link libslurmfull, which exports
// them: verified with nm -D on Slurm 22.05). The plugin never links libslurm; a missing symbol is
// a clear error, not a failed dlopen.
#pragma once

#include <elastrun/rdzv/env.hpp>

#include <optional>
#include <string>

namespace elastrun::spank::slurm_api {

// slurm_hostlist_create/shift/destroy; std::nullopt if unparsable or the API is missing.
std::optional<std::vector<std::string>> expand_hostlist(std::string_view expression);
rdzv::HostlistExpander hostlist_expander();

// The node's NodeAddr from the slurm.conf node table of this process (slurmstepd; no RPC), or
// std::nullopt (unknown node, e.g. dynamic/cloud, or the symbol is missing).
std::optional<std::string> conf_node_addr(const std::string& node);

// The node's NodeAddr from slurmctld (slurm_load_node_single: one RPC). Throws std::runtime_error.
std::string ctld_node_addr(const std::string& node);

}  // namespace elastrun::spank::slurm_api
