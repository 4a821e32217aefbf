#include "elastrun/ckpt/c10d_store_comm.hpp"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fmt/format.h>

#include "elastrun/ckpt/errors.hpp"

namespace elastrun::ckpt {

C10dStoreCommunicator::C10dStoreCommunicator(c10d::Store& store, int rank, int world_size,
                                             std::string prefix)
    : store_(store), rank_(rank), world_size_(world_size), prefix_(std::move(prefix)) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw CheckpointError(fmt::format("C10dStoreCommunicator: rank {} of world {} is invalid",
                                      rank, world_size));
  }
}

std::string C10dStoreCommunicator::key(std::uint64_t round, int rank) const {
  return fmt::format("{}/{}/{}", prefix_, round, rank);
}

std::vector<std::string> C10dStoreCommunicator::allgather(std::string_view mine) {
  std::vector<std::string> keys;
  for (int r = 0; r < world_size_; ++r) keys.push_back(key(round_, r));
  std::vector<std::string> gathered;
  try {
    store_.set(keys[static_cast<std::size_t>(rank_)],
               std::vector<std::uint8_t>(mine.begin(), mine.end()));
    store_.wait(keys);
    for (const auto& k : keys) {
      const std::vector<std::uint8_t> value = store_.get(k);
      gathered.emplace_back(value.begin(), value.end());
    }
    // Everyone has set round_'s key, so everyone finished reading round_-1: drop ours.
    if (round_ > 0) store_.deleteKey(key(round_ - 1, rank_));
  } catch (const std::exception& e) {
    throw CheckpointError(fmt::format("rank {}: store all-gather '{}' round {} failed (a peer "
                                      "died or the store timed out): {}",
                                      rank_, prefix_, round_, e.what()));
  }
  ++round_;
  return gathered;
}

}  // namespace elastrun::ckpt
