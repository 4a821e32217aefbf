#pragma once
// Communicator over a c10d::Store (the TCPStore workers already share via MASTER_ADDR/PORT, or
// a HashStore/FileStore). Part of elastrun_ckpt_torch.
// Every collective call is numbered (the same sequence on every rank, advanced even when a call
// fails) and its keys are "<prefix>/<seq>/<kind>/<rank>": a call never reads another call's
// keys, so a rank that fell out of step times out with an error naming the call instead of
// using stale data. gather: each rank sets one key, rank 0 reads and deletes them (O(world)
// store operations); broadcast: rank 0 sets one key, every rank reads it and the last reader
// deletes it; allgather = gather + broadcast. No key outlives a completed call. Still use a
// prefix unique per job generation (e.g. include TORCHELASTIC_RESTART_COUNT).
#include <cstdint>
#include <string>

#include "elastrun/ckpt/comm.hpp"

namespace c10d {
class Store;
}

namespace elastrun::ckpt {

class C10dStoreCommunicator final : public Communicator {
 public:
  // `store` must outlive this object. Waits use the store's timeout.
  C10dStoreCommunicator(c10d::Store& store, int rank, int world_size, std::string prefix);
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

  c10d::Store& store_;
  int rank_;
  int world_size_;
  std::string prefix_;
  std::uint64_t seq_ = 0;
};

}  // namespace elastrun::ckpt
