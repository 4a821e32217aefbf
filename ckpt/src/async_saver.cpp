#include "elastrun/ckpt/async_saver.hpp"

#include <fmt/format.h>

#include <sys/mman.h>

#include <cstring>
#include <new>

#include "internal.hpp"
#include "writers.hpp"

namespace elastrun::ckpt {
namespace {
// Each staged piece starts on a cache line (and so keeps any dtype's alignment).
constexpr std::size_t kStagingAlignment = 64;
}  // namespace

AsyncSaver::AsyncSaver(std::filesystem::path root, Communicator& comm, SaveOptions options)
    : root_(std::move(root)), comm_(comm), options_(options),
      worker_([this](std::stop_token stop) { run(stop); }) {}

AsyncSaver::~AsyncSaver() {
  std::unique_lock lock(mutex_);
  wait_idle(lock);
  lock.unlock();
  worker_.request_stop();
  changed_.notify_all();
}

void detail::Unmap::operator()(std::byte* mapping) const noexcept {
  if (mapping != nullptr) ::munmap(mapping, length);
}

std::byte* AsyncSaver::staging_arena(std::size_t bytes) {
  if (bytes <= staging_.get_deleter().length) return staging_.get();
  staging_.reset();  // the old snapshot is no longer referenced (no save in flight)
  void* mapping = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapping == MAP_FAILED) throw std::bad_alloc();
  // Advisory: with transparent huge pages in "madvise" mode (Debian's default) the copy into
  // 2 MiB pages takes far fewer TLB misses; without THP this is a harmless no-op.
  (void)::madvise(mapping, bytes, MADV_HUGEPAGE);
  staging_ = std::unique_ptr<std::byte[], detail::Unmap>(static_cast<std::byte*>(mapping), detail::Unmap{bytes});
  return staging_.get();
}

bool AsyncSaver::busy() const {
  std::lock_guard lock(mutex_);
  return in_flight_;
}

void AsyncSaver::wait_idle(std::unique_lock<std::mutex>& lock) {
  changed_.wait(lock, [&] { return !in_flight_; });
}

std::optional<SaveResult> AsyncSaver::wait() {
  std::unique_lock lock(mutex_);
  wait_idle(lock);
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  return std::exchange(last_result_, std::nullopt);
}

void AsyncSaver::save(std::uint64_t step, std::span<const TensorView> tensors,
                      nlohmann::json metadata) {
  std::unique_lock lock(mutex_);
  wait_idle(lock);
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  Job job;
  job.step = step;
  job.metadata = std::move(metadata);
  static const std::byte no_piece{};  // non-null data for ranks that write none of a tensor
  try {
    detail::validate_tensors(tensors);
  } catch (const CheckpointError&) {
    // Not thrown here: the other ranks' writers are about to wait for this rank's vote. The
    // writer thread re-validates (before touching any data), votes no, and every rank gets
    // the error from wait() or the next save().
    job.views.assign(tensors.begin(), tensors.end());
    pending_ = std::move(job);
    in_flight_ = true;
    changed_.notify_all();
    return;
  }
  try {
    detail::fault_point("async.snapshot", comm_.rank());
    // Replicated tensors' fingerprints come from the whole tensors, which are not staged.
    job.fingerprints = detail::replica_fingerprints(tensors, options_.check_replicas);
    // Only the bytes this rank will write: its slice, or its piece of a replicated tensor.
    std::vector<std::optional<detail::Box>> pieces;
    std::vector<std::size_t> offsets;
    std::size_t total = 0;
    for (const auto& tensor : tensors) {
      const auto& piece = pieces.emplace_back(detail::rank_piece(tensor, comm_.rank(), comm_.size()));
      offsets.push_back(total);
      const std::size_t bytes = piece ? element_count(piece->extent) * dtype_size(tensor.dtype) : 0;
      total += (bytes + kStagingAlignment - 1) / kStagingAlignment * kStagingAlignment;
    }
    std::byte* arena = total > 0 ? staging_arena(total) : nullptr;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const TensorView& tensor = tensors[i];
      const auto& piece = pieces[i];
      const std::size_t bytes = piece ? element_count(piece->extent) * dtype_size(tensor.dtype) : 0;
      TensorView copy = tensor;
      copy.data = bytes > 0 ? arena + offsets[i] : &no_piece;
      if (bytes > 0) {
        std::memcpy(arena + offsets[i], detail::piece_data(tensor, *piece, gather_scratch_), bytes);
      }
      job.views.push_back(std::move(copy));
    }
  } catch (const std::exception& e) {
    // E.g. out of memory for the staging buffers. Not thrown here either: the other ranks'
    // writers wait for this rank's votes, so the writer thread votes no with this error.
    job.views.clear();
    job.fingerprints.clear();
    job.error = fmt::format("rank {}: snapshot for step {} failed: {}", comm_.rank(), step, e.what());
  }
  pending_ = std::move(job);
  in_flight_ = true;
  changed_.notify_all();
}

void AsyncSaver::run(std::stop_token stop) {
  std::unique_lock lock(mutex_);
  while (true) {
    changed_.wait(lock, stop, [&] { return pending_.has_value(); });
    if (!pending_) return;  // stop requested while idle
    Job job = std::move(*pending_);
    pending_.reset();
    lock.unlock();
    std::exception_ptr error;
    std::optional<SaveResult> result;
    try {
      detail::SaveInputs inputs;
      inputs.source = detail::PieceSource::rank_piece_only;
      inputs.local_error = job.error ? &*job.error : nullptr;
      inputs.fingerprints = &job.fingerprints;
      result = detail::save_checkpoint_from(root_, job.step, job.views, job.metadata, comm_,
                                            options_, inputs);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    error_ = error;
    last_result_ = std::move(result);
    in_flight_ = false;
    changed_.notify_all();
  }
}

}  // namespace elastrun::ckpt
