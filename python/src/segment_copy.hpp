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
std::uint64_t copy_and_hash(std::byte* dst, std::size_t size, std::vector<SegmentPiece> pieces);

// XXH3-64 of `size` bytes: what copy_and_hash returned for a segment, checked before a restore.
std::uint64_t hash_bytes(const std::byte* data, std::size_t size);

}  // namespace elastrun::python
