#pragma once
// Communicator over a c10d::Store (the TCPStore workers already share via MASTER_ADDR/PORT, or
// a HashStore/FileStore): StoreCommunicator's protocol (store_comm.hpp) over c10d. Part of
// elastrun_ckpt_torch. Waits use the store's timeout. Use a prefix unique per job generation
// (e.g. include TORCHELASTIC_RESTART_COUNT).
#include <memory>
#include <string>

#include "elastrun/ckpt/store_comm.hpp"

namespace c10d {
class Store;
}

namespace elastrun::ckpt {

class C10dStoreCommunicator final : public Communicator {
 public:
  // `store` must outlive this object.
  C10dStoreCommunicator(c10d::Store& store, int rank, int world_size, std::string prefix);
  ~C10dStoreCommunicator() override;
  int rank() const override { return communicator_->rank(); }
  int size() const override { return communicator_->size(); }
  std::vector<std::string> allgather(std::string_view mine) override { return communicator_->allgather(mine); }
  std::vector<std::string> gather(std::string_view mine) override { return communicator_->gather(mine); }
  std::string broadcast(std::string_view mine) override { return communicator_->broadcast(mine); }

 private:
  std::unique_ptr<KeyValueStore> store_;  // c10d_store_comm.cpp: the c10d::Store as a KeyValueStore
  std::unique_ptr<StoreCommunicator> communicator_;
};

}  // namespace elastrun::ckpt
