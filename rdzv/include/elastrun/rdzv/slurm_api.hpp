// How the rendezvous finds a node's address (DNS, else Slurm's NodeAddr through the libslurm
// adapter, elastrun/slurm/api.hpp; not for the SPANK plugin).
#pragma once

#include <optional>
#include <string>

namespace elastrun::rdzv {

// How peers reach `node_name`: its DNS address if it resolves, else Slurm's NodeAddr for it
// (clusters, and our testbed, where node names are not host names). std::nullopt if neither.
std::optional<std::string> resolve_node_address(const std::string& node_name);

}  // namespace elastrun::rdzv
