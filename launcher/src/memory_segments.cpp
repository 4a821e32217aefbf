#include "memory_segments.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <system_error>
#include <vector>

#include <fmt/format.h>

namespace elastrun::launcher {

namespace {
constexpr unsigned kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL;
}

std::uint64_t MemorySegments::used_locked() const {
  std::uint64_t total = 0;
  for (const auto& [key, segment] : segments_) total += segment.bytes;
  return total;
}

void MemorySegments::drop_locked(const Key& key) { segments_.erase(key); }

util::UniqueFd MemorySegments::allocate(std::uint64_t step, int rank, std::uint64_t bytes) {
  std::lock_guard lock(mutex_);
  const Key key{rank, step};
  drop_locked(key);  // a snapshot of the same step started again (its writer died, or retried)
  // Room: committed segments of steps older than the node's newest committed step, oldest first
  // (never the newest: the one a restore needs until the next step is complete everywhere).
  while (used_locked() + bytes > budget_) {
    const auto newest = newest_committed_locked();
    std::optional<Key> oldest;
    for (const auto& [k, s] : segments_)
      if (s.committed && newest && k.step < *newest && (!oldest || k.step < oldest->step)) oldest = k;
    if (!oldest) break;
    drop_locked(*oldest);
  }
  if (used_locked() + bytes > budget_)
    throw MemoryBudgetError(fmt::format(
        "the memory checkpoint budget ({} bytes, --memory-checkpoints) cannot hold step {} of rank {} ({} bytes; {} "
        "in use): give the agent a larger budget",
        budget_, step, rank, bytes, used_locked()));
  util::UniqueFd fd(
      ::memfd_create(fmt::format("elastrun-mem-{}-{}", step, rank).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) throw std::system_error(errno, std::generic_category(), "memfd_create");
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0)
    throw std::system_error(errno, std::generic_category(), fmt::format("sizing a {}-byte memory segment", bytes));
  util::UniqueFd copy(::fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
  if (!copy) throw std::system_error(errno, std::generic_category(), "dup");
  segments_[key] = Segment{std::move(fd), bytes, 0, false};
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

void MemorySegments::commit(std::uint64_t step, int rank, std::uint64_t checksum) {
  std::lock_guard lock(mutex_);
  const auto it = segments_.find(Key{rank, step});
  if (it == segments_.end())
    throw std::invalid_argument(
        fmt::format("no memory segment of step {} rank {} to commit (mem_alloc first)", step, rank));
  auto& segment = it->second;
  if (!segment.committed) {
    if (::fcntl(segment.fd.get(), F_ADD_SEALS, kSeals) != 0)
      throw std::invalid_argument(
          errno == EBUSY
              ? fmt::format("step {} of rank {} is still mapped writable: unmap it before mem_commit", step, rank)
              : fmt::format("sealing step {} of rank {}: {}", step, rank, std::strerror(errno)));
    segment.committed = true;
    segment.checksum = checksum;
  }
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

std::optional<MemorySegments::Found> MemorySegments::find(int rank, std::optional<std::uint64_t> step) const {
  std::lock_guard lock(mutex_);
  const Segment* best = nullptr;
  std::uint64_t best_step = 0;
  for (const auto& [k, s] : segments_) {
    if (k.rank != rank || !s.committed || (step && k.step != *step)) continue;
    best = &s;  // ascending steps: the last one is the newest
    best_step = k.step;
  }
  if (best == nullptr) return std::nullopt;
  util::UniqueFd copy(::fcntl(best->fd.get(), F_DUPFD_CLOEXEC, 0));
  if (!copy) throw std::system_error(errno, std::generic_category(), "dup");
  return Found{best_step, best->bytes, best->checksum, std::move(copy)};
}

std::uint64_t MemorySegments::used() const {
  std::lock_guard lock(mutex_);
  return used_locked();
}

nlohmann::json MemorySegments::list() const {
  std::lock_guard lock(mutex_);
  nlohmann::json segments = nlohmann::json::array();
  for (const auto& [k, s] : segments_)
    segments.push_back({{"step", k.step}, {"rank", k.rank}, {"bytes", s.bytes}, {"committed", s.committed}});
  return {{"budget", budget_}, {"used", used_locked()}, {"segments", std::move(segments)}};
}

}  // namespace elastrun::launcher
