#include "elastrun/ckpt/comm.hpp"

#include <stdexcept>
#include <string>

namespace elastrun::ckpt {

class InProcessGroup::Member final : public Communicator {
 public:
  Member(InProcessGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }
  std::vector<std::string> allgather(std::string_view mine) override { return group_.exchange(rank_, mine); }

 private:
  InProcessGroup& group_;
  int rank_;
};

std::vector<std::string> Communicator::gather(std::string_view mine) {
  std::vector<std::string> all = allgather(mine);
  if (rank() != 0) all.clear();
  return all;
}

std::string Communicator::broadcast(std::string_view mine) {
  return std::move(allgather(rank() == 0 ? mine : std::string_view()).at(0));
}

InProcessGroup::InProcessGroup(int world_size) : world_size_(world_size), slots_(static_cast<std::size_t>(world_size)) {
  if (world_size < 1) throw std::invalid_argument("InProcessGroup: world size must be >= 1");
  for (int rank = 0; rank < world_size; ++rank) {
    members_.push_back(std::make_unique<Member>(*this, rank));
  }
}

InProcessGroup::~InProcessGroup() = default;

Communicator& InProcessGroup::communicator(int rank) {
  if (rank < 0 || rank >= world_size_) {
    throw std::out_of_range("InProcessGroup: rank " + std::to_string(rank) + " out of range");
  }
  return *members_[static_cast<std::size_t>(rank)];
}

std::vector<std::string> InProcessGroup::exchange(int rank, std::string_view mine) {
  std::unique_lock lock(mutex_);
  const std::uint64_t my_round = round_;
  slots_[static_cast<std::size_t>(rank)] = std::string(mine);
  if (++arrived_ == world_size_) {
    // Last arrival publishes; slots_ may be refilled by fast ranks of the next round while slow
    // ones still copy published_, which only the next round's last arrival overwrites.
    published_ = slots_;
    arrived_ = 0;
    ++round_;
    round_done_.notify_all();
    return published_;
  }
  round_done_.wait(lock, [&] { return round_ != my_round; });
  return published_;
}

}  // namespace elastrun::ckpt
