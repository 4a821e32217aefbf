#pragma once
// Private: pieces of save_checkpoint shared between the file-per-rank and shared-file writers.
#include <hdf5.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

#include "elastrun/ckpt/checkpoint.hpp"
#include "internal.hpp"

namespace elastrun::ckpt::detail {

inline constexpr std::string_view kSharedDataFile = "data.h5";

// Runs of a piece hashed and then written while still in the CPU cache (both layouts).
inline constexpr std::uint64_t kWriteChunk = 4ULL << 20;

// Writes `bytes`, the C-order elements of `file_box` of `dataset` (independent transfers), in runs
// of about kWriteChunk hashed just before they are written: one pass over the bytes serves both,
// straight from the caller's memory. `whole_dataset`: the box is the whole dataset (a small piece
// then goes in one H5S_ALL write). `after_run` sees each run's box in dataset coordinates.
// Returns the xxh3 of all the bytes.
std::uint64_t write_hashed_runs(hid_t dataset, hid_t type, const Box& file_box, std::size_t element_size,
                                const std::byte* bytes, bool whole_dataset, const std::string& what,
                                const std::function<void(const Box&)>& after_run = {});

// Asks the kernel to start writing back byte ranges of a file being written (sync_file_range
// SYNC_FILE_RANGE_WRITE: asynchronous, no durability promise), so the disk works while the ranks
// are still copying into the page cache instead of idling until the fsync, which otherwise writes
// the whole file (about half of a save's time). Only a hint: the fsync after close remains the
// durability point and its errors are the ones reported, so a file that cannot be opened here or
// a filesystem that rejects the call just turns the hints off. Both layouts.
class WritebackHint {
 public:
  // Off without fsync: the early writeback only exists to shorten the fsync.
  WritebackHint(const std::filesystem::path& path, bool enabled);
  ~WritebackHint();
  WritebackHint(const WritebackHint&) = delete;
  WritebackHint& operator=(const WritebackHint&) = delete;

  // The file bytes of `box` (C order in a dataset of `shape` stored contiguously at `address`):
  // from its first to its last element, which is exactly the box for row splits.
  void start(haddr_t address, const Shape& shape, const Box& box, std::size_t element_size);

 private:
  int fd_;
};

inline std::string_view placement_name(Placement placement) {
  return placement == Placement::sharded ? "sharded" : "replicated";
}

// Where a replicated tensor's bytes point: the whole tensor (save_checkpoint), or only this
// rank's piece, already extracted (AsyncSaver snapshots just that: ~1/N of the bytes).
enum class PieceSource { whole_tensor, rank_piece_only };

struct SaveInputs {
  PieceSource source = PieceSource::whole_tensor;
  // This rank already failed (AsyncSaver's snapshot): it takes part in every round, voting no.
  const std::string* local_error = nullptr;
  // Replicated tensors' fingerprints (name -> hash), computed from the whole tensors by the
  // caller when the views hold only this rank's piece (rank_piece_only).
  const std::map<std::string, std::uint64_t>* fingerprints = nullptr;
  // File-per-rank layout: writes this rank's shard into the temporary step directory instead of
  // write_shard_file (AsyncSaver's fork snapshot: a child process writes it). Returns the report.
  std::function<nlohmann::json(const std::filesystem::path& directory, std::uint64_t& bytes_written)> write_shard;
};

// File-per-rank layout: writes rank `rank`'s shard file into `directory`, fsynced unless
// options.fsync is off, and returns its report for the vote. Uses no communicator (it also runs
// in AsyncSaver's forked snapshot writer).
nlohmann::json write_shard_file(const std::filesystem::path& directory, std::uint64_t step,
                                std::span<const TensorView> tensors, int rank, int world, const SaveOptions& options,
                                PieceSource source, std::uint64_t& bytes_written);

SaveResult save_checkpoint_from(const std::filesystem::path& root, std::uint64_t step,
                                std::span<const TensorView> tensors, const nlohmann::json& metadata, Communicator& comm,
                                const SaveOptions& options, const SaveInputs& inputs);

// Fingerprints of the replicated tensors in `tensors` (whole tensors in memory).
std::map<std::string, std::uint64_t> replica_fingerprints(std::span<const TensorView> tensors, ReplicaCheck mode);

// The box of `t` this rank writes (nullopt: nothing) and a pointer to its C-contiguous bytes
// (the caller's memory when possible, else gathered into gather_buffer).
std::optional<Box> rank_piece(const TensorView& t, int rank, int world);
const std::byte* piece_data(const TensorView& t, const Box& piece, std::vector<std::byte>& gather_buffer,
                            PieceSource source = PieceSource::whole_tensor);

// Names, shapes, slices; throws CheckpointError naming the tensor.
void validate_tensors(std::span<const TensorView> tensors);

// Collective over an MpiCommunicator: writes every rank's pieces into <directory>/data.h5 with
// MPI-IO (collective metadata; independent transfers, hashed while written, unless
// SaveOptions::shared_file_aggregation asks for collective ones). Returns this rank's report
// for the vote. Every rank calls it, also one that already failed (local_error): the error is
// shared in the first collective round and all ranks throw together. After each collective
// phase (and after the independent writes) the ranks agree on a status flag, so a failure on
// one rank (e.g. a write error) makes every rank throw an error naming it instead of leaving
// the others blocked in the next collective call.
nlohmann::json write_shared_file(const std::filesystem::path& directory, std::uint64_t step,
                                 std::span<const TensorView> tensors, Communicator& comm, const SaveOptions& options,
                                 PieceSource source, std::uint64_t& bytes_written,
                                 const std::string* local_error = nullptr);

}  // namespace elastrun::ckpt::detail
