#pragma once
// Save, find, verify and restore checkpoints (format: docs/checkpoint-format.md).
#include <cstdint>
#include <functional>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "elastrun/ckpt/comm.hpp"
#include "elastrun/ckpt/errors.hpp"
#include "elastrun/ckpt/tensor.hpp"

namespace elastrun::ckpt {

inline constexpr int kFormatVersion = 1;

enum class Layout : std::uint8_t {
  file_per_rank,  // shard-RRRRR-of-NNNNN.h5 per rank + index.h5 (any Communicator)
  shared_file,    // one data.h5 written collectively with MPI-IO + index.h5 (MpiCommunicator)
};

// How save checks that a replicated tensor is identical on every rank (each rank writes only
// 1/N of it, so a rank holding different values would silently mix copies). Each rank sends a
// fingerprint per replicated tensor with its vote; rank 0 compares them.
enum class ReplicaCheck : std::uint8_t {
  off,
  sampled,  // default: xxh3 of the whole tensor up to 1 MiB, else of 64 spread 4 KiB blocks
  full,     // xxh3 of every byte (one extra read of each replicated tensor per rank)
};

// How AsyncSaver takes its snapshot (the moment training may go on modifying the tensors).
enum class AsyncSnapshot : std::uint8_t {
  // Default: copy this rank's bytes into a host staging arena; training blocks for one memcpy
  // of the shard (extra memory: one shard). Works everywhere.
  copy,
  // Copy-on-write: fork() a child process that holds the address space as it was at save():
  // it copies this rank's pieces into its own memory, gives up its mapping of the tensors,
  // then writes the shard file. Training blocks only for fork() (page tables); pages it writes
  // while the child still maps them take a copy-on-write fault each (docs/checkpoint-format.md
  // has the trade-off). Extra memory: one shard in the child plus those pages. Linux, host
  // memory, file-per-rank layout; other layouts, or a failed fork, fall back to copy. The
  // child never touches MPI, torch or the communicator.
  fork,
};

struct SaveOptions {
  Layout layout = Layout::file_per_rank;
  // HDF5 data alignment in bytes (set to the filesystem stripe size); 0 = HDF5 default.
  std::uint64_t alignment = 0;
  // Objects smaller than this are not aligned.
  std::uint64_t alignment_threshold = 64 * 1024;
  // HDF5 1.10 file locking breaks on many parallel filesystems; off unless asked for.
  bool file_locking = false;
  // fsync shard files, index and directories before voting/renaming. Only tests turn it off.
  bool fsync = true;
  // Retention applied by rank 0 after a successful commit: keep the newest `keep_last` steps
  // (0 = keep all) plus every step divisible by `keep_every` (0 = none).
  int keep_last = 0;
  std::uint64_t keep_every = 0;
  ReplicaCheck check_replicas = ReplicaCheck::sampled;
  // Shared-file layout: collective transfers with MPI-IO's two-phase aggregation (one collective
  // write per tensor; can help for many small, interleaved pieces). Off (default): each rank
  // writes its own pieces with independent transfers, hashed while written, writeback started
  // early (twice as fast here for large per-rank pieces, docs/checkpoint-format.md).
  bool shared_file_aggregation = false;
  // AsyncSaver only (save_checkpoint ignores it).
  AsyncSnapshot async_snapshot = AsyncSnapshot::copy;
  // Called after each run of about 4 MiB a rank writes, on the caller's thread: a long save is
  // progress, not a hang (e.g. `[] { elastrun::control::progress(); }` under elastrun
  // --hang-timeout). AsyncSaver never calls it (its writer thread or child is not the training
  // loop: a hung loop must not look alive while a save is in flight).
  std::function<void()> on_progress = {};
};

struct SaveResult {
  std::filesystem::path path;       // committed step directory
  std::uint64_t bytes_written = 0;  // this rank's tensor bytes
  // AsyncSaver: memory the snapshot held beyond the caller's: the staging arena (copy), or the
  // forked writer's peak private memory — its copy plus old copies of pages training wrote
  // while shared (fork; sampled after each tensor's copy and at the end). 0 for sync saves.
  std::uint64_t snapshot_bytes = 0;
  // Problems after the step was committed (it is durable and visible; restore will use it),
  // e.g. `latest` could not be updated or the replaced copy not removed. Same on every rank.
  std::vector<std::string> warnings;
};

// Collective: every rank of `comm` calls it with its tensors. Writes
// <root>/step-<step>.tmp-<gen>/, votes, and (rank 0) renames it to <root>/step-<step>/ and
// points <root>/latest at it. Throws CheckpointError on every rank if any rank failed; the
// previous checkpoint is untouched in that case. Re-saving an existing step swaps the new
// directory in atomically (renameat2 RENAME_EXCHANGE), so a good copy of the step always exists.
SaveResult save_checkpoint(const std::filesystem::path& root, std::uint64_t step, std::span<const TensorView> tensors,
                           const nlohmann::json& metadata, Communicator& comm, const SaveOptions& options = {});
// Collective, for a rank that cannot give its tensors to the save_checkpoint its peers are in
// (its caller failed first, e.g. converting its state): it takes part in every round, voting no
// with `reason`, so that the peers fail at once instead of waiting for its votes. Always throws
// CheckpointError (the same on every rank, naming this rank and `reason`).
[[noreturn]] void fail_save_checkpoint(const std::filesystem::path& root, std::uint64_t step, const std::string& reason,
                                       Communicator& comm, const SaveOptions& options = {});

struct ShardInfo {
  std::string file;  // relative to the step directory
  int rank = 0;
  Shape offset;
  Shape extent;
  std::uint64_t xxh3 = 0;
  Shape in_file_offset;  // where the piece starts inside the file's dataset (zeros per-rank)
};

struct TensorInfo {
  std::string name;
  DType dtype = DType::float32;
  Shape shape;
  Placement placement = Placement::replicated;
  std::vector<ShardInfo> shards;
  std::uint64_t bytes() const { return element_count(shape) * dtype_size(dtype); }
};

struct ReadOptions {
  // Hash every shard dataset a read touches (whole dataset, once per Checkpoint object).
  bool verify = true;
};

// A committed (or any) step directory opened for reading. Not thread-safe; one per thread.
class Checkpoint {
 public:
  // Throws CorruptCheckpointError if the index is missing or unreadable.
  explicit Checkpoint(std::filesystem::path step_dir);
  ~Checkpoint();
  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;

  const std::filesystem::path& path() const;
  std::uint64_t step() const;
  int world_size() const;
  std::string layout() const;
  const nlohmann::json& metadata() const;
  const std::vector<TensorInfo>& tensors() const;
  const TensorInfo& tensor(const std::string& name) const;  // throws if absent
  std::uint64_t total_bytes() const;

  // Cheap structural check: every file the manifest names exists with its recorded size.
  // Throws CorruptCheckpointError naming the file.
  void check_files() const;
  // Reads every shard dataset and compares hashes. Returns one line per problem (empty = ok).
  std::vector<std::string> verify_all();
  // Checks that `target` fits the tensor (CheckpointError: a caller mistake) and that the shard
  // pieces it overlaps are readable and, with options.verify, hash-correct
  // (CorruptCheckpointError). Never writes to target.data.
  void check_read(const TensorTarget& target, const ReadOptions& options = {});
  // Reads the box target.offset/extent of tensor target.name into target.data, touching only
  // the shard bytes that overlap it. With options.verify the overlapping pieces are hashed
  // before anything is written to target.data. Throws CorruptCheckpointError on damaged data.
  void read(const TensorTarget& target, const ReadOptions& options = {});

 private:
  struct State;
  std::unique_ptr<State> state_;
};

struct StepEntry {
  std::uint64_t step = 0;
  std::filesystem::path path;
};

// Committed step directories under root, oldest first (partial .tmp directories excluded; a
// "step-<n>.replaced-<gen>" left by a crash while replacing step n counts as step n when
// step-<n> itself is missing).
std::vector<StepEntry> list_steps(const std::filesystem::path& root);
std::filesystem::path step_directory(const std::filesystem::path& root, std::uint64_t step);

struct RestoreOptions {
  bool verify = true;
  // Try at most this many checkpoints, newest first (0 = all).
  int max_attempts = 0;
  // The caller's check of a step's metadata (e.g. "an object with an unsigned 'step'"): if it
  // throws, that step counts as damaged and an older one is tried. Runs on every rank.
  std::function<void(const nlohmann::json& metadata)> check_metadata;
  // Targets chosen per step: called on every rank for each candidate step, once the step is
  // opened and before anything is read; the boxes it returns are restored from that step (the
  // `targets` argument is then ignored) and must stay valid until restore_latest returns. Lets a
  // caller allocate tensors the step holds but it lacks (a fresh optimizer's state). Throwing
  // CheckpointMismatchError or CorruptCheckpointError skips the step as a misfit or damage.
  std::function<std::vector<TensorTarget>(const Checkpoint& checkpoint)> targets_for;
  // When step directories exist but every one tried is damaged or unreadable, restore throws
  // CorruptCheckpointError (one line per rejected step): never a silent fresh start. With this
  // set it returns nullopt instead, after one warning line on rank 0's stderr.
  bool allow_fresh_start = false;
};

struct RestoreResult {
  std::uint64_t step = 0;
  std::filesystem::path path;
  nlohmann::json metadata;
  std::vector<std::string> skipped;  // why newer checkpoints were rejected
};

// Collective: loads the newest checkpoint whose every target reads (and verifies) on every
// rank; falls back to older ones otherwise. Targets may use any sharding and any world size.
// Every rank first checks (and, with verify, hashes) everything it will read; the targets are
// written only once all ranks agreed on a step, so a rejected step leaves them untouched.
// Returns nullopt if there is no checkpoint (no step directory on any rank). Throws
// CheckpointError if steps exist but none fits the targets (CheckpointMismatchError for every one:
// the model changed), CorruptCheckpointError if every step tried is damaged (unless
// options.allow_fresh_start), and CheckpointError naming the rank and node when some rank sees no
// step while others do (a node-local directory instead of a shared filesystem). A step a restore
// rejected as damaged gets a marker file (kRejectedMarker) that keeps retention from deleting it.
std::optional<RestoreResult> restore_latest(const std::filesystem::path& root, std::span<const TensorTarget> targets,
                                            Communicator& comm, const RestoreOptions& options = {});

// The file a restore leaves in a step directory it rejected as damaged (JSON: when, and why on
// each rank): apply_retention never removes such a step. Remove the step by hand once inspected.
inline constexpr const char* kRejectedMarker = "rejected-by-restore.json";

// The file in which a step committed under an elastrun agent records the round that committed
// it (JSON {"fence_token": "<requeues>.<generation>"}, the token of the fenced commit,
// docs/rendezvous.md): which history a step belongs to, readable after the job. Written into the
// staged step after the fence said yes and before the rename, so every committed step under an
// agent has one; steps committed without an agent (mpirun, srun --torch-env) have none.
inline constexpr const char* kCommitRecord = "committed-by.json";

// The fence token recorded in `step_dir` (kCommitRecord), or "" when it has none or it cannot be
// read.
std::string commit_token(const std::filesystem::path& step_dir);

// Rank-0 housekeeping (save_checkpoint calls it after committing `committed`): sets steps
// numbered above `committed` aside as abandoned-step-<n>-<gen> (a restart from an older step
// abandoned them; restore would otherwise prefer them) and removes older steps beyond the
// retention policy. Never removes `committed`.
void apply_retention(const std::filesystem::path& root, std::uint64_t committed, int keep_last,
                     std::uint64_t keep_every);
void remove_partial_directories(const std::filesystem::path& root);

}  // namespace elastrun::ckpt
