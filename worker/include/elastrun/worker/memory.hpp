// elastrun/worker/memory.hpp: the worker side of the memory checkpoint tier. A rank's snapshot
// goes into a segment its node's agent owns -- a memfd the agent creates and passes over the node
// endpoint (node.hpp) -- so it outlives the worker that wrote it (a crash, a restart) and goes
// with the agent (its exit, kill -9: nothing is left in /dev/shm). Header only.
//
//   elastrun::worker::MemoryTier tier;  // on when the agent runs with --memory-checkpoints
//   if (tier.enabled()) {
//     auto segment = tier.allocate(step, rank, bytes);  // a writable mapping
//     std::memcpy(segment.data(), state, bytes);
//     tier.commit(std::move(segment), checksum);        // unmapped; the agent keeps it
//   }
//   if (auto s = tier.newest(rank)) use(s->step(), s->data(), s->size(), s->checksum());  // read-only
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "elastrun/worker/node.hpp"

namespace elastrun::worker {

// A segment mapped into this process: writable between allocate() and commit(), read-only once
// fetched. Unmapped by its destructor (the agent keeps the segment).
class MemorySegment {
 public:
  MemorySegment() = default;
  MemorySegment(std::uint64_t step, int rank, void* data, std::size_t size, std::uint64_t checksum)
      : step_(step), rank_(rank), data_(data), size_(size), checksum_(checksum) {}
  ~MemorySegment() { unmap(); }
  MemorySegment(MemorySegment&& o) noexcept { *this = std::move(o); }
  MemorySegment& operator=(MemorySegment&& o) noexcept {
    if (this != &o) {
      unmap();
      step_ = o.step_;
      rank_ = o.rank_;
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      checksum_ = o.checksum_;
    }
    return *this;
  }
  MemorySegment(const MemorySegment&) = delete;
  MemorySegment& operator=(const MemorySegment&) = delete;

  std::uint64_t step() const { return step_; }
  int rank() const { return rank_; }
  std::byte* data() const { return static_cast<std::byte*>(data_); }
  std::size_t size() const { return size_; }
  std::uint64_t checksum() const { return checksum_; }
  void unmap() {
    if (data_ != nullptr && size_ > 0) ::munmap(data_, size_);
    data_ = nullptr;
  }

 private:
  std::uint64_t step_ = 0;
  int rank_ = 0;
  void* data_ = nullptr;
  std::size_t size_ = 0;
  std::uint64_t checksum_ = 0;
};

class MemoryTier {
 public:
  // From the environment the agent gives its workers: on with --memory-checkpoints.
  MemoryTier() : address_(node_address_from_environment()) {
    const char* budget = std::getenv(std::string(contract::env::kMemoryCheckpoints).c_str());
    enabled_ = !address_.empty() && budget != nullptr && *budget != '\0';
  }
  explicit MemoryTier(std::string address) : address_(std::move(address)), enabled_(!address_.empty()) {}

  bool enabled() const { return enabled_; }

  // A new segment of `size` bytes for (step, rank), mapped writable. Throws std::runtime_error
  // with the agent's reason (e.g. the budget cannot hold it).
  MemorySegment allocate(std::uint64_t step, int rank, std::size_t size) {
    auto reply = ask({{"op", contract::node_op::kMemAlloc}, {"step", step}, {"rank", rank}, {"bytes", size}});
    return map(reply, step, rank, size, 0, PROT_READ | PROT_WRITE);
  }

  // Unmaps `segment` and tells the agent it is complete (nothing writes into it after this).
  // `world`: the world size that wrote it -- the agents need it to tell when a step is complete
  // job-wide (every rank's snapshot held somewhere), which a restore after a node loss relies on.
  void commit(MemorySegment segment, std::uint64_t checksum, int world = 0) {
    const auto step = segment.step();
    const int rank = segment.rank();
    segment.unmap();
    ask({{"op", contract::node_op::kMemCommit},
         {"step", step},
         {"rank", rank},
         {"checksum", checksum},
         {"world", world}});
  }

  // The newest committed segment of `rank` (or the one of `step`), mapped read-only; nullopt when
  // the agent holds none.
  // `refetch` (with `step`): the copy the agent holds failed its checksum -- it replaces it with a
  // peer agent's copy of the same round first (nullopt when no peer has one).
  std::optional<MemorySegment> newest(int rank, std::optional<std::uint64_t> step = std::nullopt,
                                      bool refetch = false) {
    nlohmann::json request = {{"op", contract::node_op::kMemGet}, {"rank", rank}};
    if (step) request["step"] = *step;
    if (refetch) request["refetch"] = true;
    auto reply = node_request(address_, request);
    if (!reply.body.value("ok", false)) return std::nullopt;
    return map(reply, reply.body.value("step", std::uint64_t{0}), rank, reply.body.value("bytes", std::size_t{0}),
               reply.body.value("checksum", std::uint64_t{0}), PROT_READ);
  }

  // After a restore to `step` (from the file tier, or a fresh start: 0): the agent drops every
  // snapshot of a later step (an abandoned history). Returns how many segments it dropped.
  std::size_t forget_after(std::uint64_t step) {
    return ask({{"op", contract::node_op::kMemForget}, {"after_step", step}}).body.value("dropped", std::size_t{0});
  }

  // mem_list's reply: budget, used, segments ({"step","rank","bytes","committed","world","origin"};
  // origin "own": written on this node, "fetched": copied from a peer for this node's ranks after
  // a re-form, "replica": held for the partner node -- not this node's to restore from).
  nlohmann::json list() { return ask({{"op", contract::node_op::kMemList}}).body; }

 private:
  NodeReply ask(const nlohmann::json& request) {
    auto reply = node_request(address_, request);
    if (!reply.body.value("ok", false))
      throw std::runtime_error("memory checkpoint tier: " + reply.body.value("error", std::string("no reason given")));
    return reply;
  }

  static MemorySegment map(const NodeReply& reply, std::uint64_t step, int rank, std::size_t size,
                           std::uint64_t checksum, int protection) {
    if (!reply.fd) throw std::runtime_error("memory checkpoint tier: the agent's reply carried no segment");
    void* data = nullptr;
    if (size > 0) {
      // MAP_POPULATE: the pages (a reused segment's, mostly) are mapped in one call instead of a
      // fault per page during the copy
      data = ::mmap(nullptr, size, protection, MAP_SHARED | MAP_POPULATE, reply.fd.get(), 0);
      if (data == MAP_FAILED)
        throw std::runtime_error(std::string("memory checkpoint tier: mmap: ") + std::strerror(errno));
    }
    return MemorySegment(step, rank, data, size, checksum);
  }

  std::string address_;
  bool enabled_ = false;
};

}  // namespace elastrun::worker
