// The memory checkpoint tier's segments, held by the node runtime for the whole job (docs/
// launcher.md, "Memory checkpoints"). Each is a memfd this agent creates for one (step, rank):
// handed to the worker to fill (mem_alloc), sealed against writes and resizing once complete
// (mem_commit), handed out read-only to whoever restores (mem_get). A memfd lives in no
// filesystem: it goes with the last descriptor, so with the agent (its exit or kill -9) and the
// workers that still map it. The budget (--memory-checkpoints=BYTES) bounds the sum of segments.
//
// Thread-safe: the endpoint's thread serves workers; the state machine may read.
#pragma once

#include <compare>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "elastrun/util/unique_fd.hpp"

namespace elastrun::launcher {

class MemoryBudgetError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class MemorySegments {
 public:
  // Committed steps kept on the node (every rank's segments of them): the newest and the one
  // before -- the ranks of a job agree on the oldest newest step they hold, which may be one
  // behind this node's (a rank stopped before its snapshot of the last step).
  static constexpr std::size_t kKeepSteps = 2;

  explicit MemorySegments(std::uint64_t budget_bytes) : budget_(budget_bytes) {}

  // A new writable segment of `bytes` for (step, rank), replacing an uncommitted one of the same
  // key; committed steps older than the node's newest make room if needed (never the newest). Returns a
  // descriptor of it for the caller to pass on. Throws MemoryBudgetError when the budget cannot
  // hold it, std::system_error when memfd_create fails.
  util::UniqueFd allocate(std::uint64_t step, int rank, std::uint64_t bytes);

  // Seals (step, rank) against writes and resizing and records its checksum; drops committed
  // steps beyond the kKeepSteps newest (any rank) and this rank's uncommitted older ones. Throws
  // std::invalid_argument for an unknown segment or one still mapped writable somewhere.
  void commit(std::uint64_t step, int rank, std::uint64_t checksum);

  struct Found {
    std::uint64_t step = 0, bytes = 0, checksum = 0;
    util::UniqueFd fd;  // a new descriptor of the sealed segment
  };
  // The committed segment of (step, rank), or the rank's newest committed one without a step.
  std::optional<Found> find(int rank, std::optional<std::uint64_t> step = std::nullopt) const;

  // Drops every segment (committed or not, any rank) of a step after `after_step`: a restore went
  // back to that step, so newer ones belong to an abandoned history (and, being the newest,
  // retention would keep them and drop the new history's snapshots). Returns how many.
  std::size_t forget_after(std::uint64_t after_step);

  std::uint64_t budget() const { return budget_; }
  std::uint64_t used() const;
  nlohmann::json list() const;  // {"budget","used","segments":[{"step","rank","bytes","committed"}]}

 private:
  struct Key {
    int rank = 0;
    std::uint64_t step = 0;
    auto operator<=>(const Key&) const = default;
  };
  struct Segment {
    util::UniqueFd fd;
    std::uint64_t bytes = 0, checksum = 0;
    bool committed = false;
  };
  std::uint64_t used_locked() const;
  std::optional<std::uint64_t> newest_committed_locked() const;
  void drop_locked(const Key& key);

  const std::uint64_t budget_;
  mutable std::mutex mutex_;
  std::map<Key, Segment> segments_;  // by rank, then step: a rank's steps are neighbours, oldest first
};

}  // namespace elastrun::launcher
