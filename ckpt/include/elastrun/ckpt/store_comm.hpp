#pragma once
// Communicator over a key-value store with blocking reads: the c10d store the workers already
// share (C10dStoreCommunicator, libtorch), the same store reached through Python (the elastrun
// Python package), or any other store with these four operations.
// Every collective call is numbered (the same sequence on every rank, advanced even when a call
// fails) and its keys are "<prefix>/<seq>/<kind>/<rank>": a call never reads another call's
// keys, so a rank that fell out of step times out with an error naming the call instead of
// using stale data. gather: each rank sets one key, rank 0 reads and deletes them (O(world)
// store operations); broadcast: rank 0 sets one key, every rank reads it and the last reader
// deletes it; allgather = gather + broadcast. No key outlives a completed call. Still use a
// prefix unique per job generation (e.g. include TORCHELASTIC_RESTART_COUNT).
#include <cstdint>
#include <exception>
#include <string>
#include <string_view>

#include "elastrun/ckpt/comm.hpp"

namespace elastrun::ckpt {

class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  virtual void set(const std::string& key, std::string_view value) = 0;
  // Waits until `key` exists (up to the store's own timeout, then throws) and returns its value.
  virtual std::string get(const std::string& key) = 0;
  // Atomically adds `delta` to the integer at `key` (0 if absent); returns the new value.
  virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;
  // Deletes `key`. Stores that cannot delete keys keep it (it is never read again); never throws.
  virtual void remove(const std::string& key) noexcept = 0;
};

class StoreCommunicator final : public Communicator {
 public:
  // `store` must outlive this object. Throws CheckpointError for an invalid rank or world.
  StoreCommunicator(KeyValueStore& store, int rank, int world_size, std::string prefix);
  int rank() const override { return rank_; }
  int size() const override { return world_size_; }
  std::vector<std::string> allgather(std::string_view mine) override;
  std::vector<std::string> gather(std::string_view mine) override;
  std::string broadcast(std::string_view mine) override;

 private:
  std::string key(std::uint64_t seq, std::string_view kind, int rank) const;
  std::vector<std::string> gather_at(std::uint64_t seq, std::string_view mine);
  std::string broadcast_at(std::uint64_t seq, std::string_view mine);
  [[noreturn]] void fail(std::string_view what, std::uint64_t seq, const std::exception& e) const;

  KeyValueStore& store_;
  int rank_;
  int world_size_;
  std::string prefix_;
  std::uint64_t seq_ = 0;
};

}  // namespace elastrun::ckpt
