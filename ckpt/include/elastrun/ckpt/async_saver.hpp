#pragma once
// Asynchronous save: training blocks only for the snapshot, then a background thread runs
// save_checkpoint. Snapshot (SaveOptions::async_snapshot): by default a copy into a host staging
// arena (one mapping, reused while the state does not grow: first touch of fresh memory is slow;
// huge pages asked for: fewer TLB misses during the copy); or a copy-on-write fork whose child
// writes the shard file. One save in flight; errors are never dropped.
#include <condition_variable>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "elastrun/ckpt/checkpoint.hpp"

namespace elastrun::ckpt {
namespace detail {
struct Unmap {  // deleter of an anonymous mapping of `length` bytes
  std::size_t length = 0;
  void operator()(std::byte* mapping) const noexcept;
};
}  // namespace detail

class AsyncSaver {
 public:
  // `comm` is used from the writer thread (see MpiCommunicator about MPI_THREAD_MULTIPLE) and
  // must outlive the saver. Every rank of comm must drive its own AsyncSaver in lockstep.
  AsyncSaver(std::filesystem::path root, Communicator& comm, SaveOptions options = {});
  // Waits for the in-flight save. An unreported error is lost here: call wait() first.
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  // Waits for the previous save; if it failed, throws its error (and does not start this one).
  // Otherwise snapshots `tensors` and returns; the caller may modify them right away.
  void save(std::uint64_t step, std::span<const TensorView> tensors, nlohmann::json metadata);
  // This rank cannot take part in step `step` (its caller failed before it had tensors to give,
  // e.g. a state_dict it cannot convert): like save(), but this rank votes no with `reason`, so
  // every rank's next wait() or save() throws instead of the others waiting for its votes until
  // their timeout. Throws the previous save's error like save().
  void fail(std::uint64_t step, std::string reason);
  // Blocks until no save is in flight; throws the last save's error once, if it failed.
  std::optional<SaveResult> wait();
  bool busy() const;

 private:
  struct SnapshotProcess;  // the forked shard writer of a fork snapshot (async_saver.cpp)
  struct Job {
    std::uint64_t step = 0;
    // Into staging_ (copy snapshot) or, until the writer thread forked, the caller's tensors.
    std::vector<TensorView> views;
    bool staged = false;                      // views point into staging_ (this rank's pieces only)
    bool fork_requested = false;              // save() waits until the writer thread forked (fork_done_)
    std::shared_ptr<SnapshotProcess> writer;  // set once forked
    nlohmann::json metadata;
    std::map<std::string, std::uint64_t> fingerprints;  // replicated tensors, whole-tensor
    std::optional<std::string> error;                   // this rank's snapshot failed: vote no in every round
  };
  // Grows (never shrinks) the staging arena to at least `bytes`; throws std::bad_alloc.
  std::byte* staging_arena(std::size_t bytes);
  // Copy snapshot: job.views (the caller's tensors) -> this rank's pieces in the staging arena;
  // after_copy sees each original view once its piece is copied. On failure (e.g. out of
  // memory) sets job.error instead of throwing.
  void stage_copy(Job& job, int rank, int world, const std::function<void(const TensorView&)>& after_copy = {});
  // Writer thread, while save() waits: fork the shard writer, or copy if fork is impossible.
  void take_fork_snapshot(Job& job);
  void run(std::stop_token stop);
  void wait_idle(std::unique_lock<std::mutex>& lock);

  std::filesystem::path root_;
  Communicator& comm_;
  SaveOptions options_;
  std::unique_ptr<std::byte[], detail::Unmap> staging_;  // anonymous mapping, staging_.get_deleter().length bytes
  std::vector<std::byte> gather_scratch_;                // replicated pieces not contiguous in the source
  mutable std::mutex mutex_;
  std::condition_variable_any changed_;
  std::optional<Job> pending_;
  bool in_flight_ = false;
  bool fork_done_ = false;  // the pending fork snapshot was taken: save() may return
  std::exception_ptr error_;
  std::optional<SaveResult> last_result_;
  std::jthread worker_;  // last member: started after, joined before, everything above
};

}  // namespace elastrun::ckpt
