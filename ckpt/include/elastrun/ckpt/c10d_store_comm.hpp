#pragma once
// Communicator over a c10d::Store (the TCPStore workers already share via MASTER_ADDR/PORT, or
// a HashStore/FileStore). Part of elastrun_ckpt_torch. Each allgather round writes one key per
// rank under `prefix`; a rank deletes its key of round r once round r+1 completed (by then every
// rank has read it). Use a prefix unique per job generation (e.g. include
// TORCHELASTIC_RESTART_COUNT): a restarted group must not see the previous group's keys.
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

 private:
  std::string key(std::uint64_t round, int rank) const;

  c10d::Store& store_;
  int rank_;
  int world_size_;
  std::string prefix_;
  std::uint64_t round_ = 0;
};

}  // namespace elastrun::ckpt
