#pragma once
// Memory-tier snapshots (elastrun.checkpoint, tier="memory"): the tensors are copied into the
// agent's segment and hashed in the same pass, so that a snapshot blocks training for about one
// memcpy rather than a copy plus a second read of every byte for its checksum.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace elastrun::python {

struct SegmentPiece {
  const std::byte* data = nullptr;
  std::size_t bytes = 0;
  std::size_t offset = 0;  // where it goes in the segment
};

// Copies every piece to dst + offset and returns the XXH3-64 of all `size` bytes of dst (what lies
// between and after the pieces included), each MiB hashed right after it was written, while it is
// still in cache. Pieces must not overlap and must lie inside [0, size) (std::invalid_argument).
// With hash=false only the copy (returns 0): AsyncSaver hashes on its thread, after training resumed.
std::uint64_t copy_and_hash(std::byte* dst, std::size_t size, std::vector<SegmentPiece> pieces, bool hash = true);

// XXH3-64 of `size` bytes: what copy_and_hash returned for a segment, checked before a restore.
std::uint64_t hash_bytes(const std::byte* data, std::size_t size);

// The restore side reads the segment's descriptor with pread rather than through a mapping: a new
// mapping pays a fault per page at its first touch (10x the copy on a VM), pread copies from the
// kernel's own mapping. XXH3-64 of the first `size` bytes of `fd`, read a MiB at a time into a
// buffer that stays in cache; std::system_error on a read error or a short segment.
std::uint64_t hash_fd(int fd, std::size_t size);

struct SegmentRead {
  std::byte* into = nullptr;
  std::size_t bytes = 0;
  std::size_t offset = 0;  // where it is in the segment
};
// Reads each piece from `fd` at its offset into its destination; std::system_error as above.
void read_pieces(int fd, const std::vector<SegmentRead>& pieces);

}  // namespace elastrun::python
