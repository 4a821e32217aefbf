#pragma once
// Private: pieces of save_checkpoint shared between the file-per-rank and shared-file writers.
#include <cstdint>
#include <filesystem>
#include <span>

#include <nlohmann/json.hpp>

#include "elastrun/ckpt/checkpoint.hpp"
#include "internal.hpp"

namespace elastrun::ckpt::detail {

inline constexpr std::string_view kSharedDataFile = "data.h5";

inline std::string_view placement_name(Placement placement) {
  return placement == Placement::sharded ? "sharded" : "replicated";
}

// Where a replicated tensor's bytes point: the whole tensor (save_checkpoint), or only this
// rank's piece, already extracted (AsyncSaver snapshots just that: ~1/N of the bytes).
enum class PieceSource { whole_tensor, rank_piece_only };

SaveResult save_checkpoint_from(const std::filesystem::path& root, std::uint64_t step,
                                std::span<const TensorView> tensors,
                                const nlohmann::json& metadata, Communicator& comm,
                                const SaveOptions& options, PieceSource source,
                                const std::string* local_error = nullptr);

// The box of `t` this rank writes (nullopt: nothing) and a pointer to its C-contiguous bytes
// (the caller's memory when possible, else gathered into gather_buffer).
std::optional<Box> rank_piece(const TensorView& t, int rank, int world);
const std::byte* piece_data(const TensorView& t, const Box& piece,
                            std::vector<std::byte>& gather_buffer,
                            PieceSource source = PieceSource::whole_tensor);

// Names, shapes, slices; throws CheckpointError naming the tensor.
void validate_tensors(std::span<const TensorView> tensors);

// Collective over an MpiCommunicator: writes every rank's pieces into <directory>/data.h5 with
// MPI-IO (collective metadata and transfers). Returns this rank's report for the vote.
nlohmann::json write_shared_file(const std::filesystem::path& directory, std::uint64_t step,
                                 std::span<const TensorView> tensors, Communicator& comm,
                                 const SaveOptions& options, PieceSource source,
                                 std::uint64_t& bytes_written);

}  // namespace elastrun::ckpt::detail
