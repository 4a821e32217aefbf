#include "elastrun/ckpt/store_comm.hpp"

#include <fmt/format.h>

#include "elastrun/ckpt/errors.hpp"

namespace elastrun::ckpt {

StoreCommunicator::StoreCommunicator(KeyValueStore& store, int rank, int world_size, std::string prefix)
    : store_(store), rank_(rank), world_size_(world_size), prefix_(std::move(prefix)) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw CheckpointError(fmt::format("store communicator: rank {} of world {} is invalid", rank, world_size));
  }
}

std::string StoreCommunicator::key(std::uint64_t seq, std::string_view kind, int rank) const {
  return fmt::format("{}/{}/{}/{}", prefix_, seq, kind, rank);
}

void StoreCommunicator::fail(std::string_view what, std::uint64_t seq, const std::exception& e) const {
  throw CheckpointError(
      fmt::format("rank {}: store {} '{}' call {} failed (a peer died, fell out "
                  "of step, or the store timed out): {}",
                  rank_, what, prefix_, seq, e.what()));
}

std::vector<std::string> StoreCommunicator::gather_at(std::uint64_t seq, std::string_view mine) {
  std::vector<std::string> gathered;
  try {
    if (rank_ != 0) {
      store_.set(key(seq, "g", rank_), mine);
      return gathered;
    }
    gathered.emplace_back(mine);
    for (int r = 1; r < world_size_; ++r) {
      const std::string k = key(seq, "g", r);
      gathered.push_back(store_.get(k));
      store_.remove(k);
    }
  } catch (const std::exception& e) {
    fail("gather", seq, e);
  }
  return gathered;
}

std::string StoreCommunicator::broadcast_at(std::uint64_t seq, std::string_view mine) {
  const std::string k = key(seq, "b", 0);
  try {
    if (world_size_ == 1) return std::string(mine);
    if (rank_ == 0) {
      store_.set(k, mine);
      return std::string(mine);
    }
    std::string value = store_.get(k);
    // The last of the world-1 readers removes the value and the counter. Best effort: the
    // value is read, and the store may be gone already (it lives in rank 0's process, which
    // may exit right after its last broadcast).
    try {
      if (store_.add(k + "/read", 1) == world_size_ - 1) {
        store_.remove(k);
        store_.remove(k + "/read");
      }
    } catch (const std::exception&) {
      // leaves two keys behind; they are never read again
    }
    return value;
  } catch (const std::exception& e) {
    fail("broadcast", seq, e);
  }
}

std::vector<std::string> StoreCommunicator::gather(std::string_view mine) { return gather_at(seq_++, mine); }

std::string StoreCommunicator::broadcast(std::string_view mine) { return broadcast_at(seq_++, mine); }

std::vector<std::string> StoreCommunicator::allgather(std::string_view mine) {
  const std::uint64_t seq = seq_++;
  const std::vector<std::string> gathered = gather_at(seq, mine);
  // Rank 0 broadcasts the contributions as one length-prefixed message.
  std::string packed;
  for (const auto& part : gathered) {
    packed += fmt::format("{}:", part.size());
    packed += part;
  }
  const std::string all = broadcast_at(seq, packed);
  std::vector<std::string> result;
  std::size_t position = 0;
  while (position < all.size()) {
    const auto colon = all.find(':', position);
    const std::size_t length = std::stoull(all.substr(position, colon - position));
    result.push_back(all.substr(colon + 1, length));
    position = colon + 1 + length;
  }
  if (result.size() != static_cast<std::size_t>(world_size_)) {
    throw CheckpointError(
        fmt::format("rank {}: store all-gather '{}' call {} returned {} parts "
                    "for world {}",
                    rank_, prefix_, seq, result.size(), world_size_));
  }
  return result;
}

}  // namespace elastrun::ckpt
