// Slurm hostlist expressions through libslurm's own parser (never a hand-written one).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace elastrun::rdzv {

// "n[1-3],gpu[01-02]" -> {"n1","n2","n3","gpu01","gpu02"}; std::nullopt if libslurm rejects it.
std::optional<std::vector<std::string>> expand_hostlist(std::string_view expression);

// The inverse: a compressed, sorted-by-appearance expression ("n[1-3]").
std::string compress_hostlist(const std::vector<std::string>& hosts);

}  // namespace elastrun::rdzv
