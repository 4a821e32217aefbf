// The few libslurm calls the rendezvous needs (slurmctld RPCs; not for the SPANK plugin).
#pragma once

#include <optional>
#include <string>

namespace elastrun::rdzv {

// How peers reach `node_name`: its DNS address if it resolves, else Slurm's NodeAddr for it
// (clusters, and our testbed, where node names are not host names). std::nullopt if neither.
std::optional<std::string> resolve_node_address(const std::string& node_name);

// Slurm's view of a node: "down" (DOWN, NOT_RESPONDING, FAIL...), "up", or std::nullopt when
// slurmctld cannot be asked. Used to confirm a silent member before declaring it dead.
std::optional<bool> slurm_node_is_down(const std::string& node_name);

// Slurm's NodeAddr for `node_name` (slurmctld's view: the address the node is reached at), or
// std::nullopt if slurmctld does not answer or does not know the node.
std::optional<std::string> slurm_node_addr(const std::string& node_name);

}  // namespace elastrun::rdzv
