#pragma once
// Private helpers shared by the writer, reader and tool.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include "elastrun/ckpt/tensor.hpp"

namespace elastrun::ckpt::detail {

inline constexpr std::string_view kIndexFile = "index.h5";
inline constexpr std::string_view kManifestDataset = "/_elastrun/manifest";
inline constexpr std::string_view kReservedGroup = "_elastrun";
inline constexpr std::string_view kHashAlgorithm = "xxh3_64";
inline constexpr std::string_view kFormatName = "elastrun-ckpt";
inline constexpr std::string_view kLatestLink = "latest";

struct Box {
  Shape offset;
  Shape extent;
};

// Intersection of two boxes of the same rank; nullopt if empty. 0-d boxes always intersect.
std::optional<Box> intersect(const Box& a, const Box& b);

// Copies the sub-box `count` starting at src_start in a C-contiguous array of shape src_shape to
// dst_start in a C-contiguous array of shape dst_shape.
void copy_box(const std::byte* src, const Shape& src_shape, const Shape& src_start,
              std::byte* dst, const Shape& dst_shape, const Shape& dst_start, const Shape& count,
              std::size_t element_size);

// The part of a replicated tensor `rank` writes: an even split along the first dimension at
// least world_size long (dimension 0 if none). nullopt if this rank writes nothing.
std::optional<Box> replicated_piece(const Shape& shape, int rank, int world_size);

std::uint64_t xxh3(const void* data, std::size_t size);
std::string hex64(std::uint64_t value);

// "step-000001200"; parse returns nullopt for anything else (tmp, deleting, latest, ...).
std::string step_name(std::uint64_t step);
std::optional<std::uint64_t> parse_step_name(std::string_view name);
// True for leftovers of interrupted saves/deletions: "step-<digits>.<suffix>".
bool is_partial_name(std::string_view name);
std::string shard_file_name(int rank, int world_size);
// Random hex token distinguishing one save attempt's temporary names.
std::string generation_token();

// fsync a file or directory; throws CheckpointError naming the path.
void fsync_path(const std::filesystem::path& path, bool directory);
// rename(2) with a checked, descriptive error.
void rename_path(const std::filesystem::path& from, const std::filesystem::path& to);

// "model/layer1.weight" is valid; empty components, leading '/', "." or ".." components and
// the reserved top-level group are not. Returns the reason or an empty string.
std::string invalid_name_reason(std::string_view name);

std::string shape_string(const Shape& shape);

}  // namespace elastrun::ckpt::detail
