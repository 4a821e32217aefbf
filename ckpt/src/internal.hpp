#pragma once
// Private helpers shared by the writer, reader and tool.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "elastrun/ckpt/tensor.hpp"

namespace elastrun::ckpt::detail {

inline constexpr std::string_view kIndexFile = "index.h5";
inline constexpr std::string_view kManifestDataset = "/_elastrun/manifest";
inline constexpr std::string_view kUserMetadataDataset = "/_elastrun/user_metadata";
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
void copy_box(const std::byte* src, const Shape& src_shape, const Shape& src_start, std::byte* dst,
              const Shape& dst_shape, const Shape& dst_start, const Shape& count, std::size_t element_size);

// The part of a replicated tensor `rank` writes: an even split along the first dimension at
// least world_size long (dimension 0 if none). nullopt if this rank writes nothing.
std::optional<Box> replicated_piece(const Shape& shape, int rank, int world_size);

std::uint64_t xxh3(const void* data, std::size_t size);

// Incremental xxh3_64: the digest of the concatenated updates equals xxh3() of all the bytes.
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;
  void update(const void* data, std::size_t size);
  std::uint64_t digest() const;

 private:
  void* state_;  // XXH3_state_t, owned
};

// Splits a C-contiguous box of shape `extent` into C-order runs of at most ~max_bytes: calls
// chunk(start, count, byte_offset, byte_count) with a sub-box (start/count relative to the
// box) whose bytes are [byte_offset, byte_offset + byte_count) of the box's bytes.
void for_each_chunk(const Shape& extent, std::size_t element_size, std::uint64_t max_bytes,
                    const std::function<void(const Shape&, const Shape&, std::uint64_t, std::uint64_t)>& chunk);

// Overflow-checked arithmetic for sizes read from files (nullopt on overflow).
std::optional<std::uint64_t> checked_add(std::uint64_t a, std::uint64_t b);
std::optional<std::uint64_t> checked_mul(std::uint64_t a, std::uint64_t b);
std::optional<std::uint64_t> checked_element_count(const Shape& shape);

// Test hooks. fault_point(name, rank) calls the installed hook (if any) at named points of the
// save protocol; a hook throws to simulate a failure there, or _exit()s to simulate a crash.
using FaultHook = std::function<void(std::string_view point, int rank)>;
// Thread-safe (the background remover calls fault_point too); a hook may still be running on
// another thread after it was replaced, so drain that work before its captures go away.
void set_fault_hook(FaultHook hook);
void fault_point(std::string_view point, int rank);
// Tests: pretend the filesystem lacks renameat2(RENAME_EXCHANGE) (use the two-rename fallback).
void set_rename_exchange_disabled(bool disabled);
bool rename_exchange_disabled();
std::string hex64(std::uint64_t value);

// Replacing an existing step directory: on filesystems without RENAME_EXCHANGE the old copy is
// first renamed to "step-<n>.replaced-<gen>"; if that is all that is left of step n (crash
// between the two renames) readers use it and the next save renames it back.
inline constexpr std::string_view kReplacedInfix = ".replaced-";

// "step-000001200"; parse returns nullopt for anything else (tmp, deleting, latest, ...).
std::string step_name(std::uint64_t step);
std::optional<std::uint64_t> parse_step_name(std::string_view name);
// True for leftovers of interrupted saves/deletions: "step-<digits>.<suffix>".
bool is_partial_name(std::string_view name);
std::string shard_file_name(int rank, int world_size);
// Random hex token distinguishing one save attempt's temporary names.
std::string generation_token();

// Background removal (remover.cpp): deleting a retired step's files can take rank 0 a large part
// of a second (ext4 with `discard`, Lustre) while every rank waits for its commit broadcast, so
// a process-wide worker thread deletes them after the save returns.
// Queues `doomed` for recursive removal. It must already carry a name readers ignore
// (is_partial_name, e.g. "step-<n>.deleting-<gen>"): rename it synchronously first, so no
// listing or restore ever sees a half-deleted step. Errors are ignored; a leftover (process
// killed first) keeps its partial name and the next save's remove_partial_directories removes
// it. At normal process exit the queued removals are finished. Never throws (falls back to
// removing synchronously). In a process forked from the one that started the worker, removes
// synchronously.
void remove_in_background(const std::filesystem::path& doomed);
// True while `path` is queued or being removed by this process's worker (compared lexically
// after making it absolute).
bool removal_pending(const std::filesystem::path& path);
// Blocks until every queued removal is done (tests; also run at process exit).
void wait_for_background_removals();

// fsync a file or directory; throws CheckpointError naming the path.
void fsync_path(const std::filesystem::path& path, bool directory);
// rename(2) with a checked, descriptive error.
void rename_path(const std::filesystem::path& from, const std::filesystem::path& to);

// "model/layer1.weight" is valid; empty components, leading '/', "." or ".." components and
// the reserved top-level group are not. Returns the reason or an empty string.
std::string invalid_name_reason(std::string_view name);

std::string shape_string(const Shape& shape);

}  // namespace elastrun::ckpt::detail
