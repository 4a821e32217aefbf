#pragma once
// Private: the step directories under a checkpoint root (steps.cpp). Save commits and retires
// steps; save, restore and the tool list them (list_steps, step_directory, apply_retention and
// remove_partial_directories are public, in checkpoint.hpp).
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "elastrun/ckpt/checkpoint.hpp"

namespace elastrun::ckpt::detail {

// lstat(2) succeeds: anything by that name, a dangling symlink included.
bool path_exists(const std::filesystem::path& path);

// Rank 0: renames `directory` (step `step`) to "step-<n>.deleting-<gen>" and queues it for
// background removal. Throws if the rename fails.
void retire(const std::filesystem::path& root, std::uint64_t step, const std::filesystem::path& directory);

// Rank 0, after every rank voted yes: fsyncs and publishes `temporary` as step `step`, then
// points `latest` at it. Throws only if the step was not committed; later problems are returned
// as warnings.
std::vector<std::string> commit(const std::filesystem::path& root, const std::filesystem::path& temporary,
                                std::uint64_t step, const std::string& generation, const SaveOptions& options);

// Rank 0, just before the rename: under an elastrun agent, its round must still hold a quorum
// on the rendezvous store (fence.cpp). Returns the round's fence token ("" without an agent);
// throws CheckpointError naming why the commit may not go ahead.
std::string fence_commit(const std::filesystem::path& step_dir);

}  // namespace elastrun::ckpt::detail
