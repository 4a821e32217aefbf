#pragma once
// The collectives the checkpoint protocol needs, over small byte strings (shard manifests,
// votes): all-gather, plus gather-to-rank-0 and broadcast-from-rank-0, which the save/restore
// votes use so that their traffic grows with the world size, not its square. Implement
// allgather (and override gather/broadcast for O(world) traffic) over c10d, MPI or the
// rendezvous store.
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace elastrun::ckpt {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank contributes `mine`; every rank receives all contributions indexed by rank.
  // Must be called by all ranks in the same order (it is also the barrier).
  virtual std::vector<std::string> allgather(std::string_view mine) = 0;
  // Every rank contributes `mine`; rank 0 receives all contributions indexed by rank, the other
  // ranks an empty vector. Same ordering rule as allgather. The default uses allgather.
  virtual std::vector<std::string> gather(std::string_view mine);
  // Every rank receives rank 0's `mine` (the other ranks' arguments are ignored). The default
  // uses allgather.
  virtual std::string broadcast(std::string_view mine);
  void barrier() { (void)allgather({}); }
};

// World of one process.
class SingleProcessCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::vector<std::string> allgather(std::string_view mine) override { return {std::string(mine)}; }
};

// Threads of one process acting as ranks (tests, single-node tools).
class InProcessGroup {
 public:
  explicit InProcessGroup(int world_size);
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;
  int size() const { return world_size_; }
  // The communicator thread-rank `rank` uses; lives as long as the group.
  Communicator& communicator(int rank);

 private:
  class Member;
  std::vector<std::string> exchange(int rank, std::string_view mine);

  int world_size_;
  std::mutex mutex_;
  std::condition_variable round_done_;
  std::uint64_t round_ = 0;
  int arrived_ = 0;
  std::vector<std::string> slots_;
  std::vector<std::string> published_;
  std::vector<std::unique_ptr<Member>> members_;
};

}  // namespace elastrun::ckpt
