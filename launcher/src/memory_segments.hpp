// The memory checkpoint tier's segments, held by the node runtime for the whole job (docs/
// launcher.md, "Memory checkpoints"). Each is a memfd this agent holds for one (step, rank):
// handed to the worker to fill (mem_alloc), marked complete (mem_commit), handed out through a
// read-only descriptor to whoever restores (mem_get). A dropped segment (one no reader got) is
// kept as a spare and
// handed to the next mem_alloc: a fresh page costs a fault and the kernel's zeroing at its first
// write -- 40x the copy itself on a virtual machine -- so a snapshot every step writes into the
// pages of the one dropped before it (which is why segments are not sealed: a seal is forever).
// A memfd lives in no filesystem: it goes with the last descriptor, so with the agent (its exit
// or kill -9) and the workers that still map it. The budget (--memory-checkpoints=BYTES) bounds
// the sum of segments and spares.
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
#include <string_view>
#include <utility>
#include <vector>

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

  // Where a committed segment came from (mem_list's "origin"): a worker of this node wrote it;
  // a partner agent sent it for safekeeping (a copy of another node's snapshot: not this node's
  // to restore from unless a re-form gives it that rank); or this agent fetched it from a peer
  // for one of its ranks after a re-form (memory_peers.hpp).
  enum class Origin { Own, Replica, Fetched };
  static std::string_view to_string(Origin origin);

  // A writable segment of `bytes` for (step, rank), replacing an uncommitted one of the same key:
  // the spare that needs the fewest new pages (the same rank's first: its worker may still map it),
  // resized, else a new memfd. Spares, then committed
  // steps older than the node's newest (never the newest), make room if needed. Returns a
  // descriptor of it for the caller to pass on. Throws MemoryBudgetError when the budget cannot
  // hold it, std::system_error when memfd_create or resizing fails.
  util::UniqueFd allocate(std::uint64_t step, int rank, std::uint64_t bytes);

  // Marks (step, rank) complete with its checksum (the writer has unmapped it: the protocol; a
  // write after this is caught by the checksum, checked before any restore); drops committed
  // steps beyond the kKeepSteps newest (any rank) and this rank's uncommitted older ones. Throws
  // std::invalid_argument for an unknown segment.
  // `world`: the world size that wrote it (0: not said), for "is step S complete job-wide";
  // `generation`: the rendezvous round it was written in -- two snapshots of one step from
  // different rounds belong to different histories (a node that was cut off and came back) and
  // are never combined in one restore.
  void commit(std::uint64_t step, int rank, std::uint64_t checksum, int world = 0, std::uint64_t generation = 0);

  // ---- copies between agents (memory_peers.hpp) ----
  // A writable segment for a copy of (step, rank) from another agent, std::nullopt when this node
  // already holds that snapshot committed. Within the budget, making room among spares and older
  // replicas only (a worker's allocate() drops replicas before the node's own older steps).
  // Then commit_copy, or discard.
  std::optional<util::UniqueFd> allocate_copy(std::uint64_t step, int rank, std::uint64_t bytes);
  void commit_copy(std::uint64_t step, int rank, std::uint64_t checksum, int world, std::uint64_t generation,
                   Origin origin);
  void discard(std::uint64_t step, int rank);  // an uncommitted segment whose copy failed
  bool drop(std::uint64_t step, int rank);     // a committed one (another history's): false if none
  // A replica of (step, rank) becomes this node's own to restore from (Origin::Fetched): a
  // re-form gave this node that rank. False when it holds no such replica.
  bool adopt(std::uint64_t step, int rank);

  // A committed segment held still while it is read by another thread (sent to a peer): retention
  // may drop it meanwhile, but its memory is reused only once every Pinned of it is gone.
  class Pinned {
   public:
    Pinned(MemorySegments* owner, std::uint64_t id, std::uint64_t step, int rank, util::UniqueFd fd,
           std::uint64_t bytes, std::uint64_t checksum, int world, std::uint64_t generation)
        : step(step),
          rank(rank),
          bytes(bytes),
          checksum(checksum),
          world(world),
          generation(generation),
          fd(std::move(fd)),
          owner_(owner),
          id_(id) {}
    Pinned(Pinned&& o) noexcept
        : step(o.step),
          rank(o.rank),
          bytes(o.bytes),
          checksum(o.checksum),
          world(o.world),
          generation(o.generation),
          fd(std::move(o.fd)),
          owner_(std::exchange(o.owner_, nullptr)),
          id_(o.id_) {}
    Pinned& operator=(Pinned&&) = delete;
    ~Pinned();
    std::uint64_t step = 0;
    int rank = 0;
    std::uint64_t bytes = 0, checksum = 0;
    int world = 0;
    std::uint64_t generation = 0;
    util::UniqueFd fd;  // a duplicate of the segment's descriptor: read with pread/sendfile at offsets

   private:
    MemorySegments* owner_;
    std::uint64_t id_;
  };
  std::optional<Pinned> pin(std::uint64_t step, int rank);

  struct Held {
    std::uint64_t step = 0;
    int rank = 0, world = 0;
    Origin origin = Origin::Own;
    std::uint64_t generation = 0;
  };
  std::vector<Held> held() const;  // the committed segments

  struct Found {
    std::uint64_t step = 0, bytes = 0, checksum = 0;
    util::UniqueFd fd;  // a new read-only descriptor of the segment (its own open file: O_RDONLY)
  };
  // The committed segment of (step, rank), or the rank's newest committed one without a step.
  // The segment is then never reused as a spare (freed when dropped).
  std::optional<Found> find(int rank, std::optional<std::uint64_t> step = std::nullopt);

  // Drops every segment (committed or not, any rank) of a step after `after_step`: a restore went
  // back to that step, so newer ones belong to an abandoned history (and, being the newest,
  // retention would keep them and drop the new history's snapshots). Returns how many.
  std::size_t forget_after(std::uint64_t after_step);

  std::uint64_t budget() const { return budget_; }
  std::uint64_t used() const;   // bytes of segments
  std::uint64_t spare() const;  // bytes of spares (within the budget too)
  // {"budget","used","spare","segments":[{"step","rank","bytes","committed"}]}
  nlohmann::json list() const;

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
    int world = 0;
    std::uint64_t generation = 0;
    Origin origin = Origin::Own;
    int pins = 0;          // Pinned copies alive: its memory is not reused until they are gone
    std::uint64_t id = 0;  // unique in this agent: what a Pinned names
    // find() gave a reader a descriptor of it: when dropped it is freed, never reused -- a reader
    // may still hold it, and must not see another snapshot's bytes (or a shorter file) in it
    bool handed_out = false;
  };
  struct Spare {
    util::UniqueFd fd;
    std::uint64_t bytes = 0;
    int rank = 0;  // whose it was: that rank's worker may still map it (a mapping reused, not a new one)
  };
  std::uint64_t used_locked() const;
  std::uint64_t spare_locked() const;
  std::optional<std::uint64_t> newest_committed_locked() const;
  std::optional<std::size_t> best_spare_locked(std::uint64_t bytes, int rank) const;
  void drop_locked(const Key& key);  // the segment becomes a spare (unless handed out)
  void free_spare_locked(std::size_t index);
  util::UniqueFd allocate_locked(std::uint64_t step, int rank, std::uint64_t bytes, bool for_copy);
  util::UniqueFd new_segment_locked(std::uint64_t step, int rank, std::uint64_t bytes);

  const std::uint64_t budget_;
  mutable std::mutex mutex_;
  std::map<Key, Segment> segments_;  // by rank, then step: a rank's steps are neighbours, oldest first
  std::vector<Spare> spares_;        // dropped segments, oldest first
  // dropped while pinned: (key, segment); a spare when its last pin goes
  std::vector<std::pair<Key, Segment>> dropped_pinned_;
  void unpin(std::uint64_t id);
  std::uint64_t next_id_ = 1;
  void retain_locked(std::uint64_t step, int rank);
};

}  // namespace elastrun::launcher
