#include "elastrun/ckpt/async_saver.hpp"

#include <fmt/format.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <string_view>

#include "h5.hpp"
#include "internal.hpp"
#include "vote.hpp"
#include "writers.hpp"

namespace elastrun::ckpt {
namespace fs = std::filesystem;
namespace {
// Each staged piece starts on a cache line (and so keeps any dtype's alignment).
constexpr std::size_t kStagingAlignment = 64;

// Fork snapshot child: memory only this process holds (its staging copy, and the old copies of
// pages the parent wrote since the fork) = what the snapshot costs beyond the parent's memory.
// 0 if /proc is unreadable.
std::uint64_t private_bytes() {
  // Plain read(2), no iostreams: a stream takes libstdc++'s locale lock, which another thread of
  // the parent may have held at fork().
  const int fd = ::open("/proc/self/smaps_rollup", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  std::string text;
  char buffer[4096];
  for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) > 0 || (n < 0 && errno == EINTR);) {
    if (n > 0) text.append(buffer, static_cast<std::size_t>(n));
  }
  ::close(fd);
  std::uint64_t total_kib = 0;
  for (const std::string_view key : {"\nPrivate_Clean:", "\nPrivate_Dirty:"}) {
    const auto at = text.find(key);
    if (at != std::string::npos) total_kib += std::strtoull(text.c_str() + at + key.size(), nullptr, 10);
  }
  return total_kib * 1024;
}

std::pair<std::uintptr_t, std::uintptr_t> memory_range(const TensorView& view) {
  const auto begin = reinterpret_cast<std::uintptr_t>(view.data);
  return {begin, begin + element_count(view.slice_extent) * dtype_size(view.dtype)};
}

bool views_overlap(const std::vector<TensorView>& views) {
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> ranges;
  for (const auto& view : views) ranges.push_back(memory_range(view));
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) return true;
  }
  return false;
}

// Fork snapshot child: gives up the child's mapping of the whole pages inside a tensor's memory
// (the parent's pages are untouched; once the child no longer shares them, the parent's writes
// need no copy). Errors are ignored: the pages then stay shared, which costs only faults.
void release_child_pages(const TensorView& view) {
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto [begin, end] = memory_range(view);
  const std::uintptr_t first = (begin + page - 1) / page * page;
  const std::uintptr_t last = end / page * page;
  if (last > first) (void)::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

// The writer thread and the forked child are not the caller's thread (SaveOptions::on_progress).
SaveOptions without_progress(SaveOptions options) {
  options.on_progress = nullptr;
  return options;
}
}  // namespace

AsyncSaver::AsyncSaver(std::filesystem::path root, Communicator& comm, SaveOptions options)
    : root_(std::move(root)),
      comm_(comm),
      options_(without_progress(std::move(options))),
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

// The forked shard writer. Protocol over a socket pair, length-prefixed frames (other children
// of this process may hold copies of the descriptors, so end-of-file cannot mark a message's
// end): the writer thread sends the temporary step directory; the child writes and fsyncs its
// shard file there, replies with its vote (a detail::RankVote) and exits. Everything the child
// needs was decided before fork(); it runs with every signal blocked (a SIGTERM meant for
// training must not kill a half-written save: the parent decides) and dies with the writer
// thread (PR_SET_PDEATHSIG).
struct AsyncSaver::SnapshotProcess {
  pid_t pid = -1;
  int socket = -1;  // the parent's end
  bool reaped = false;
  std::uint64_t private_bytes = 0;  // the child's peak private memory, from its report

  SnapshotProcess() = default;
  SnapshotProcess(const SnapshotProcess&) = delete;
  SnapshotProcess& operator=(const SnapshotProcess&) = delete;
  ~SnapshotProcess() {
    if (socket >= 0) ::close(socket);
    if (pid > 0 && !reaped) {
      ::kill(pid, SIGKILL);  // e.g. the save failed before the child was told where to write
      while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
      }
    }
  }

  // MSG_NOSIGNAL: a dead peer is an error to report, not a SIGPIPE for the whole process.
  static bool send_frame(int fd, std::string_view text) noexcept {
    const std::uint64_t length = text.size();
    std::string frame(reinterpret_cast<const char*>(&length), sizeof length);
    frame.append(text);
    std::string_view rest = frame;
    while (!rest.empty()) {
      const ssize_t n = ::send(fd, rest.data(), rest.size(), MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      rest.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
  }

  static bool receive_exactly(int fd, char* into, std::size_t size) {
    while (size > 0) {
      const ssize_t n = ::recv(fd, into, size, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      into += n;
      size -= static_cast<std::size_t>(n);
    }
    return true;
  }

  // nullopt: the peer closed (or died) before a whole frame arrived.
  static std::optional<std::string> receive_frame(int fd) {
    std::uint64_t length = 0;
    if (!receive_exactly(fd, reinterpret_cast<char*>(&length), sizeof length)) return std::nullopt;
    if (length > (std::uint64_t{1} << 32)) return std::nullopt;
    std::string text(length, '\0');
    if (!receive_exactly(fd, text.data(), text.size())) return std::nullopt;
    return text;
  }

  // In the child, never returns. `prepare` runs at once (while the parent's writer thread
  // agrees on the directory with the other ranks); `write` gets the directory and returns the
  // reply text.
  [[noreturn]] static void child_main(int fd, pid_t parent, const std::function<void()>& prepare,
                                      const std::function<std::string(const fs::path&)>& write) noexcept {
    sigset_t all;
    ::sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, nullptr);
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) ::_exit(3);
    std::string reply;
    try {
      prepare();
      const std::optional<std::string> directory = receive_frame(fd);
      if (!directory || directory->empty()) ::_exit(0);  // the save failed before the shard was needed
      reply = write(*directory);
    } catch (const std::exception& e) {
      reply = detail::RankVote::error(e.what()).encode();
    } catch (...) {
      reply = detail::RankVote::error("unknown error in the snapshot writer process").encode();
    }
    // _exit: no atexit handlers, no static destructors (MPI, torch, HDF5 belong to the parent).
    ::_exit(send_frame(fd, reply) ? 0 : 4);
  }

  // Writer thread: hand the child its directory, collect its report, reap it.
  nlohmann::json write_shard(const fs::path& directory, std::uint64_t& bytes_written, int rank) {
    std::optional<std::string> reply;
    if (send_frame(socket, directory.string())) reply = receive_frame(socket);
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0) {
      if (errno != EINTR) {
        throw CheckpointError(
            fmt::format("rank {}: waitpid for snapshot writer process {}: {}", rank, pid, std::strerror(errno)));
      }
    }
    reaped = true;
    if (WIFSIGNALED(status)) {
      throw CheckpointError(
          fmt::format("rank {}: snapshot writer process {} killed by signal {} "
                      "while writing {}",
                      rank, pid, WTERMSIG(status), directory.string()));
    }
    if (!reply || reply->empty() || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      throw CheckpointError(
          fmt::format("rank {}: snapshot writer process {} exited with status {} "
                      "without a report for {}",
                      rank, pid, WIFEXITED(status) ? WEXITSTATUS(status) : -1, directory.string()));
    }
    detail::RankVote vote = detail::RankVote::decode(*reply);
    if (!vote.is_ok()) throw CheckpointError(vote.why);
    nlohmann::json answer = std::move(vote.report);
    bytes_written += answer.at("bytes").get<std::uint64_t>();
    private_bytes = answer.value("private_bytes", std::uint64_t{0});
    return std::move(answer.at("report"));
  }
};

void AsyncSaver::save(std::uint64_t step, std::span<const TensorView> tensors, nlohmann::json metadata) {
  std::unique_lock lock(mutex_);
  wait_idle(lock);
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  Job job;
  job.step = step;
  job.metadata = std::move(metadata);
  job.views.assign(tensors.begin(), tensors.end());
  try {
    detail::validate_tensors(tensors);
  } catch (const CheckpointError&) {
    // Not thrown here: the other ranks' writers are about to wait for this rank's vote. The
    // writer thread re-validates (before touching any data), votes no, and every rank gets
    // the error from wait() or the next save().
    pending_ = std::move(job);
    in_flight_ = true;
    changed_.notify_all();
    return;
  }
  try {
    detail::fault_point("async.snapshot", comm_.rank());
    // Replicated tensors' fingerprints come from the whole tensors, which are not staged.
    job.fingerprints = detail::replica_fingerprints(tensors, options_.check_replicas);
  } catch (const std::exception& e) {
    job.error = fmt::format("rank {}: snapshot for step {} failed: {}", comm_.rank(), step, e.what());
  }
  if (!job.error && options_.async_snapshot == AsyncSnapshot::fork && options_.layout == Layout::file_per_rank) {
    // fork() from the writer thread, which outlives the child (PR_SET_PDEATHSIG follows the
    // forking thread, and this caller's thread may end first); this thread waits meanwhile, so
    // the tensors cannot change before the address space is copied.
    job.fork_requested = true;
    fork_done_ = false;
    pending_ = std::move(job);
    in_flight_ = true;
    changed_.notify_all();
    changed_.wait(lock, [&] { return fork_done_; });
    return;
  }
  if (!job.error) stage_copy(job, comm_.rank(), comm_.size());
  pending_ = std::move(job);
  in_flight_ = true;
  changed_.notify_all();
}

void AsyncSaver::fail(std::uint64_t step, std::string reason) {
  std::unique_lock lock(mutex_);
  wait_idle(lock);
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  Job job;
  job.step = step;
  job.error = fmt::format("rank {}: step {} not saved: {}", comm_.rank(), step, reason);
  pending_ = std::move(job);
  in_flight_ = true;
  changed_.notify_all();
}

void AsyncSaver::stage_copy(Job& job, int rank, int world, const std::function<void(const TensorView&)>& after_copy) {
  static const std::byte no_piece{};  // non-null data for ranks that write none of a tensor
  try {
    // Only the bytes this rank will write: its slice, or its piece of a replicated tensor.
    std::vector<std::optional<detail::Box>> pieces;
    std::vector<std::size_t> offsets;
    std::size_t total = 0;
    for (const auto& tensor : job.views) {
      const auto& piece = pieces.emplace_back(detail::rank_piece(tensor, rank, world));
      offsets.push_back(total);
      const std::size_t bytes = piece ? element_count(piece->extent) * dtype_size(tensor.dtype) : 0;
      total += (bytes + kStagingAlignment - 1) / kStagingAlignment * kStagingAlignment;
    }
    std::byte* arena = total > 0 ? staging_arena(total) : nullptr;
    for (std::size_t i = 0; i < job.views.size(); ++i) {
      TensorView& view = job.views[i];
      const auto& piece = pieces[i];
      const std::size_t bytes = piece ? element_count(piece->extent) * dtype_size(view.dtype) : 0;
      if (bytes > 0) {
        std::memcpy(arena + offsets[i], detail::piece_data(view, *piece, gather_scratch_), bytes);
      }
      if (after_copy) after_copy(view);
      view.data = bytes > 0 ? arena + offsets[i] : &no_piece;
    }
    job.staged = true;
  } catch (const std::exception& e) {
    // E.g. out of memory for the staging arena. Not thrown: the other ranks' writers wait for
    // this rank's votes, so the writer thread votes no with this error.
    job.views.clear();
    job.fingerprints.clear();
    job.error = fmt::format("rank {}: snapshot for step {} failed: {}", rank, job.step, e.what());
  }
}

void AsyncSaver::take_fork_snapshot(Job& job) {
  int ends[2] = {-1, -1};
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0) {
    stage_copy(job, comm_.rank(), comm_.size());  // no descriptors left: copy instead, same result
    return;
  }
  auto writer = std::make_shared<SnapshotProcess>();
  writer->socket = ends[0];
  const int rank = comm_.rank();
  const int world = comm_.size();
  const pid_t parent = ::getpid();
  // The child writes through HDF5 (under the library mutex): hold the mutex across fork() so no
  // other thread of this process is inside HDF5 at that moment (the child could not recover);
  // the child then starts with a fresh mutex.
  pid_t pid = -1;
  {
    h5::Lock h5_lock(h5::library_mutex());
    pid = ::fork();
    if (pid == 0) {
      h5::reinitialize_library_mutex_in_child();  // h5_lock is never released in the child
      // Copy this rank's pieces into the child's own memory first (one memcpy, while training
      // already runs), then drop the child's mappings of the caller's tensors: from then on
      // training's writes to them cost no copy-on-write fault, however long the disk takes.
      // Views that alias one buffer are dropped only after every piece is copied.
      // Sampled after each copy (before its pages are given up) and before the reply: the
      // child's peak private memory, reported as SaveResult::snapshot_bytes.
      std::uint64_t peak_private = 0;
      const auto sample = [&] { peak_private = std::max(peak_private, private_bytes()); };
      const std::function<void()> prepare = [&] {
        if (!views_overlap(job.views)) {
          stage_copy(job, rank, world, [&](const TensorView& original) {  // each right after its copy
            sample();
            release_child_pages(original);
          });
          return;
        }
        const std::vector<TensorView> originals = job.views;
        stage_copy(job, rank, world);
        sample();
        if (!job.error) {
          for (const auto& original : originals) release_child_pages(original);
        }
      };
      const std::function<std::string(const fs::path&)> write_shard = [&](const fs::path& directory) {
        detail::fault_point("async.fork_child", rank);
        if (job.error) throw CheckpointError(*job.error);
        std::uint64_t bytes = 0;
        nlohmann::json report = detail::write_shard_file(directory, job.step, job.views, rank, world, options_,
                                                         detail::PieceSource::rank_piece_only, bytes);
        sample();
        return detail::RankVote::ok({{"report", std::move(report)}, {"bytes", bytes}, {"private_bytes", peak_private}})
            .encode();
      };
      SnapshotProcess::child_main(ends[1], parent, prepare, write_shard);
    }
  }
  ::close(ends[1]);
  if (pid < 0) {
    stage_copy(job, rank, world);  // e.g. EAGAIN/ENOMEM: copy instead, same result
    return;
  }
  writer->pid = pid;
  job.writer = std::move(writer);
}

void AsyncSaver::run(std::stop_token stop) {
  std::unique_lock lock(mutex_);
  while (true) {
    changed_.wait(lock, stop, [&] { return pending_.has_value(); });
    if (!pending_) return;  // stop requested while idle
    Job job = std::move(*pending_);
    pending_.reset();
    if (job.fork_requested) {
      take_fork_snapshot(job);
      fork_done_ = true;
      changed_.notify_all();
    }
    lock.unlock();
    std::exception_ptr error;
    std::optional<SaveResult> result;
    try {
      detail::SaveInputs inputs;
      // Staged views hold only this rank's pieces; the others are the caller's whole tensors.
      inputs.source = job.staged ? detail::PieceSource::rank_piece_only : detail::PieceSource::whole_tensor;
      inputs.local_error = job.error ? &*job.error : nullptr;
      inputs.fingerprints = &job.fingerprints;
      if (job.writer) {
        inputs.write_shard = [&](const fs::path& directory, std::uint64_t& bytes_written) {
          return job.writer->write_shard(directory, bytes_written, comm_.rank());
        };
      }
      result = detail::save_checkpoint_from(root_, job.step, job.views, job.metadata, comm_, options_, inputs);
      result->snapshot_bytes = job.writer ? job.writer->private_bytes : job.staged ? staging_.get_deleter().length : 0;
    } catch (...) {
      error = std::current_exception();
    }
    job.writer.reset();  // reaps the child if the save failed before it was told to write
    lock.lock();
    error_ = error;
    last_result_ = std::move(result);
    in_flight_ = false;
    changed_.notify_all();
  }
}

}  // namespace elastrun::ckpt
