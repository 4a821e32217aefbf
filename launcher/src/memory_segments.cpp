#include "memory_segments.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <set>
#include <system_error>
#include <tuple>
#include <vector>

#include <fmt/format.h>

namespace elastrun::launcher {

std::string_view MemorySegments::to_string(Origin origin) {
  switch (origin) {
    case Origin::Own: return "own";
    case Origin::Replica: return "replica";
    case Origin::Fetched: return "fetched";
  }
  return "own";
}

std::uint64_t MemorySegments::used_locked() const {
  std::uint64_t total = 0;
  for (const auto& [key, segment] : segments_) total += segment.bytes;
  for (const auto& [key, segment] : dropped_pinned_) total += segment.bytes;
  return total;
}

std::uint64_t MemorySegments::spare_locked() const {
  std::uint64_t total = 0;
  for (const auto& spare : spares_) total += spare.bytes;
  return total;
}

void MemorySegments::drop_locked(const Key& key) {
  const auto it = segments_.find(key);
  if (it == segments_.end()) return;
  if (it->second.pins > 0) {  // a peer is being sent it: reused only once that is done (unpin)
    dropped_pinned_.emplace_back(key, std::move(it->second));
    segments_.erase(it);
    return;
  }
  if (!it->second.handed_out) spares_.push_back(Spare{std::move(it->second.fd), it->second.bytes, key.rank});
  segments_.erase(it);
}

// Its pages are freed by the truncation, not by closing this descriptor: the worker that wrote it
// may still map it (elastrun.memory keeps its mappings), and it will never be handed out again.
void MemorySegments::free_spare_locked(std::size_t index) {
  (void)::ftruncate(spares_[index].fd.get(), 0);  // best effort: closing frees it once unmapped anyway
  spares_.erase(spares_.begin() + static_cast<std::ptrdiff_t>(index));
}

// The spare that needs the fewest new pages to hold `bytes`; among those, one of the same rank (its
// worker keeps its mappings of its segments: a new mapping costs a fault per page at the first
// write), then the smallest (what is left over is freed by the resize).
std::optional<std::size_t> MemorySegments::best_spare_locked(std::uint64_t bytes, int rank) const {
  const auto order = [&](const Spare& s) {
    return std::tuple(bytes > s.bytes ? bytes - s.bytes : 0, s.rank != rank, s.bytes);
  };
  std::optional<std::size_t> best;
  for (std::size_t i = 0; i < spares_.size(); ++i)
    if (!best || order(spares_[i]) < order(spares_[*best])) best = i;
  return best;
}

util::UniqueFd MemorySegments::new_segment_locked(std::uint64_t step, int rank, std::uint64_t bytes) {
  util::UniqueFd fd(::memfd_create(fmt::format("elastrun-mem-{}-{}", step, rank).c_str(), MFD_CLOEXEC));
  if (!fd) throw std::system_error(errno, std::generic_category(), "memfd_create");
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0)
    throw std::system_error(errno, std::generic_category(), fmt::format("sizing a {}-byte memory segment", bytes));
  return fd;
}

util::UniqueFd MemorySegments::allocate(std::uint64_t step, int rank, std::uint64_t bytes) {
  std::lock_guard lock(mutex_);
  return allocate_locked(step, rank, bytes, false);
}

std::optional<util::UniqueFd> MemorySegments::allocate_copy(std::uint64_t step, int rank, std::uint64_t bytes) {
  std::lock_guard lock(mutex_);
  if (const auto it = segments_.find(Key{rank, step}); it != segments_.end() && it->second.committed)
    return std::nullopt;
  return allocate_locked(step, rank, bytes, true);
}

void MemorySegments::commit_copy(std::uint64_t step, int rank, std::uint64_t checksum, int world,
                                 std::uint64_t generation, Origin origin) {
  std::lock_guard lock(mutex_);
  const auto it = segments_.find(Key{rank, step});
  if (it == segments_.end() || it->second.committed)
    throw std::invalid_argument(fmt::format("no copy of step {} rank {} in progress", step, rank));
  it->second.committed = true;
  it->second.checksum = checksum;
  it->second.world = world;
  it->second.generation = generation;
  it->second.origin = origin;
  retain_locked(step, rank);
}

bool MemorySegments::drop(std::uint64_t step, int rank) {
  std::lock_guard lock(mutex_);
  const auto it = segments_.find(Key{rank, step});
  if (it == segments_.end() || !it->second.committed) return false;
  drop_locked(it->first);
  return true;
}

void MemorySegments::discard(std::uint64_t step, int rank) {
  std::lock_guard lock(mutex_);
  if (const auto it = segments_.find(Key{rank, step}); it != segments_.end() && !it->second.committed)
    drop_locked(it->first);
}

bool MemorySegments::adopt(std::uint64_t step, int rank) {
  std::lock_guard lock(mutex_);
  const auto it = segments_.find(Key{rank, step});
  if (it == segments_.end() || !it->second.committed || it->second.origin != Origin::Replica) return false;
  it->second.origin = Origin::Fetched;
  return true;
}

std::optional<MemorySegments::Pinned> MemorySegments::pin(std::uint64_t step, int rank) {
  std::lock_guard lock(mutex_);
  const auto it = segments_.find(Key{rank, step});
  if (it == segments_.end() || !it->second.committed) return std::nullopt;
  util::UniqueFd copy(::fcntl(it->second.fd.get(), F_DUPFD_CLOEXEC, 0));
  if (!copy) throw std::system_error(errno, std::generic_category(), "dup");
  ++it->second.pins;
  return Pinned(this, it->second.id, step, rank, std::move(copy), it->second.bytes, it->second.checksum,
                it->second.world, it->second.generation);
}

MemorySegments::Pinned::~Pinned() {
  fd.reset();
  if (owner_ != nullptr) owner_->unpin(id_);
}

void MemorySegments::unpin(std::uint64_t id) {
  std::lock_guard lock(mutex_);
  for (auto& [key, segment] : segments_)
    if (segment.id == id) {
      --segment.pins;
      return;
    }
  for (auto it = dropped_pinned_.begin(); it != dropped_pinned_.end(); ++it)
    if (it->second.id == id) {
      if (--it->second.pins == 0) {
        if (!it->second.handed_out)
          spares_.push_back(Spare{std::move(it->second.fd), it->second.bytes, it->first.rank});
        dropped_pinned_.erase(it);
      }
      return;
    }
}

std::vector<MemorySegments::Held> MemorySegments::held() const {
  std::lock_guard lock(mutex_);
  std::vector<Held> out;
  for (const auto& [k, s] : segments_)
    if (s.committed) out.push_back({k.step, k.rank, s.world, s.origin, s.generation});
  return out;
}

util::UniqueFd MemorySegments::allocate_locked(std::uint64_t step, int rank, std::uint64_t bytes, bool for_copy) {
  const Key key{rank, step};
  if (bytes > budget_)
    throw MemoryBudgetError(fmt::format(
        "the memory checkpoint budget ({} bytes, --memory-checkpoints) cannot hold step {} of rank {} ({} bytes): "
        "give the agent a larger budget",
        budget_, step, rank, bytes));
  drop_locked(key);  // a snapshot of the same step started again (its writer died, or retried)
  // Room: first spares other than the one to reuse, then committed segments of steps older than
  // the node's newest committed step, oldest first (never the newest: the one a restore needs
  // until the next step is complete everywhere).
  const auto held_after = [&](std::optional<std::size_t> reuse) {
    return used_locked() + spare_locked() - (reuse ? spares_[*reuse].bytes : 0) + bytes;
  };
  // Then replicas (copies held for the partner node: they yield to this node's own snapshots),
  // oldest first; a copy makes room among older replicas only.
  auto reuse = best_spare_locked(bytes, rank);
  while (held_after(reuse) > budget_) {
    if (spares_.size() > (reuse ? 1u : 0u)) {
      free_spare_locked(reuse && *reuse == 0 ? 1 : 0);
    } else {
      const auto newest = newest_committed_locked();
      std::optional<Key> oldest_replica, oldest;
      for (const auto& [k, s] : segments_) {
        if (!s.committed) continue;
        if (s.origin == Origin::Replica && (!for_copy || k.step < step) &&
            (!oldest_replica || k.step < oldest_replica->step))
          oldest_replica = k;
        if (!for_copy && newest && k.step < *newest && (!oldest || k.step < oldest->step)) oldest = k;
      }
      if (oldest_replica) {
        drop_locked(*oldest_replica);
      } else if (oldest) {
        drop_locked(*oldest);
      } else {
        break;
      }
    }
    reuse = best_spare_locked(bytes, rank);
  }
  if (held_after(reuse) > budget_)
    throw MemoryBudgetError(fmt::format(
        "the memory checkpoint budget ({} bytes, --memory-checkpoints) cannot hold step {} of rank {} ({} bytes; {} "
        "in use by newer snapshots): give the agent a larger budget",
        budget_, step, rank, bytes, used_locked() + spare_locked()));
  util::UniqueFd fd;
  if (reuse) {
    fd = std::move(spares_[*reuse].fd);
    const bool resize = spares_[*reuse].bytes != bytes;
    spares_.erase(spares_.begin() + static_cast<std::ptrdiff_t>(*reuse));
    if (resize && ::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0)
      throw std::system_error(errno, std::generic_category(),
                              fmt::format("resizing a memory segment to {} bytes", bytes));
  } else {
    fd = new_segment_locked(step, rank, bytes);
  }
  util::UniqueFd copy(::fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
  if (!copy) throw std::system_error(errno, std::generic_category(), "dup");
  Segment segment;
  segment.fd = std::move(fd);
  segment.bytes = bytes;
  segment.id = next_id_++;
  segments_[key] = std::move(segment);
  return copy;
}

std::size_t MemorySegments::forget_after(std::uint64_t after_step) {
  std::lock_guard lock(mutex_);
  std::vector<Key> dropped;
  for (const auto& [k, s] : segments_)
    if (k.step > after_step) dropped.push_back(k);
  for (const auto& k : dropped) drop_locked(k);
  return dropped.size();
}

void MemorySegments::commit(std::uint64_t step, int rank, std::uint64_t checksum, int world, std::uint64_t generation) {
  std::lock_guard lock(mutex_);
  const auto it = segments_.find(Key{rank, step});
  if (it == segments_.end())
    throw std::invalid_argument(
        fmt::format("no memory segment of step {} rank {} to commit (mem_alloc first)", step, rank));
  auto& segment = it->second;
  if (!segment.committed) {
    segment.committed = true;
    segment.checksum = checksum;
    segment.world = world;
    segment.generation = generation;
    segment.origin = Origin::Own;
  }
  retain_locked(step, rank);
}

void MemorySegments::retain_locked(std::uint64_t step, int rank) {
  // retention, node-wide: the kKeepSteps newest committed steps (of any rank: ranks may be
  // renumbered by a re-form), and this rank's unfinished older snapshots
  std::set<std::uint64_t> steps;
  for (const auto& [k, s] : segments_)
    if (s.committed) steps.insert(k.step);
  while (steps.size() > kKeepSteps) steps.erase(steps.begin());
  std::vector<Key> dropped;
  for (const auto& [k, s] : segments_)
    if ((s.committed && !steps.contains(k.step)) || (!s.committed && k.rank == rank && k.step < step))
      dropped.push_back(k);
  for (const auto& k : dropped) drop_locked(k);
}

std::optional<std::uint64_t> MemorySegments::newest_committed_locked() const {
  std::optional<std::uint64_t> newest;
  for (const auto& [k, s] : segments_)
    if (s.committed && (!newest || k.step > *newest)) newest = k.step;
  return newest;
}

std::optional<MemorySegments::Found> MemorySegments::find(int rank, std::optional<std::uint64_t> step) {
  std::lock_guard lock(mutex_);
  Segment* best = nullptr;
  std::uint64_t best_step = 0;
  for (auto& [k, s] : segments_) {
    if (k.rank != rank || !s.committed || (step && k.step != *step)) continue;
    best = &s;  // ascending steps: the last one is the newest
    best_step = k.step;
  }
  if (best == nullptr) return std::nullopt;
  // its own open file, read-only: whoever restores can neither write nor map it writable-shared
  util::UniqueFd reader(::open(fmt::format("/proc/self/fd/{}", best->fd.get()).c_str(), O_RDONLY | O_CLOEXEC));
  if (!reader) throw std::system_error(errno, std::generic_category(), "reopening a memory segment read-only");
  best->handed_out = true;
  return Found{best_step, best->bytes, best->checksum, std::move(reader)};
}

std::uint64_t MemorySegments::used() const {
  std::lock_guard lock(mutex_);
  return used_locked();
}

std::uint64_t MemorySegments::spare() const {
  std::lock_guard lock(mutex_);
  return spare_locked();
}

nlohmann::json MemorySegments::list() const {
  std::lock_guard lock(mutex_);
  nlohmann::json segments = nlohmann::json::array();
  for (const auto& [k, s] : segments_)
    segments.push_back({{"step", k.step},
                        {"rank", k.rank},
                        {"bytes", s.bytes},
                        {"committed", s.committed},
                        {"world", s.world},
                        {"generation", s.generation},
                        {"origin", to_string(s.origin)}});
  return {{"budget", budget_}, {"used", used_locked()}, {"spare", spare_locked()}, {"segments", std::move(segments)}};
}

}  // namespace elastrun::launcher
