// Shared-file layout: all ranks create one data.h5 collectively through HDF5's MPI-IO driver and
// write their pieces into it (independently, or collectively with two-phase aggregation).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "elastrun/ckpt/mpi_comm.hpp"
#include "h5.hpp"
#include "writers.hpp"

namespace elastrun::ckpt::detail {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct Declaration {
  std::string dtype;
  Shape shape;
  std::string placement;
};

// Plan round: every rank learns every tensor (collective dataset creation needs identical calls
// on all ranks) and every rank's validation error, so all ranks fail or proceed together.
std::map<std::string, Declaration> agree_on_tensors(std::span<const TensorView> tensors, Communicator& comm,
                                                    bool have_mpi, const std::string* local_error) {
  json mine = {{"error", ""}, {"mpi", have_mpi}, {"tensors", json::array()}};
  try {
    if (local_error) throw CheckpointError(*local_error);
    validate_tensors(tensors);
    for (const auto& t : tensors) {
      mine["tensors"].push_back({{"name", t.name},
                                 {"dtype", dtype_name(t.dtype)},
                                 {"shape", t.global_shape},
                                 {"placement", placement_name(t.placement)}});
    }
  } catch (const std::exception& e) {
    mine["error"] = e.what();
  }
  const std::vector<std::string> gathered = comm.allgather(mine.dump());
  std::map<std::string, Declaration> plan;
  for (std::size_t r = 0; r < gathered.size(); ++r) {
    const json theirs = json::parse(gathered[r]);
    if (!theirs["error"].get<std::string>().empty()) {
      throw CheckpointError(fmt::format("rank {}: {}", r, theirs["error"].get<std::string>()));
    }
    if (!theirs["mpi"].get<bool>()) {
      throw CheckpointError(
          fmt::format("rank {}: the shared-file layout needs an "
                      "MpiCommunicator; use Layout::file_per_rank otherwise",
                      r));
    }
    for (const auto& t : theirs["tensors"]) {
      Declaration declaration{t["dtype"], t["shape"].get<Shape>(), t["placement"]};
      auto [it, inserted] = plan.try_emplace(t["name"].get<std::string>(), declaration);
      if (!inserted && (it->second.dtype != declaration.dtype || it->second.shape != declaration.shape ||
                        it->second.placement != declaration.placement)) {
        throw CheckpointError(
            fmt::format("tensor '{}': rank {} declares {} {} {} unlike another "
                        "rank; all ranks must agree",
                        it->first, r, declaration.dtype, shape_string(declaration.shape), declaration.placement));
      }
    }
  }
  return plan;
}

// Runs the steps of one phase, remembering the first error instead of throwing it (the other
// ranks are about to enter a collective call), then agrees with all ranks on the outcome: if any
// rank failed, every rank throws the same error naming the failed ranks.
class PhaseAgreement {
 public:
  PhaseAgreement(MPI_Comm comm, Communicator& names, int rank) : comm_(comm), names_(names), rank_(rank) {}

  template <typename Step>
  void run(std::string_view point, Step&& step) {
    if (!error_.empty()) return;
    try {
      step();
      // After the step: collective calls must be made by every rank; a test fault here
      // simulates the call failing on this rank only.
      fault_point(point, rank_);
    } catch (const std::exception& e) {
      error_ = e.what();
      if (error_.empty()) error_ = "unknown error";
    }
  }

  void agree(std::string_view phase) {
    const int mine = error_.empty() ? 0 : 1;
    int any = 0;
    const int status = MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, comm_);
    if (status != MPI_SUCCESS) {
      throw CheckpointError(fmt::format("rank {}: MPI_Allreduce of the {} status failed", rank_, phase));
    }
    if (any == 0) return;
    const std::vector<std::string> errors = names_.allgather(error_);
    std::vector<std::string> failed;
    for (std::size_t r = 0; r < errors.size(); ++r) {
      if (!errors[r].empty()) failed.push_back(fmt::format("rank {}: {}", r, errors[r]));
    }
    throw CheckpointError(fmt::format("shared-file save failed during {} ({})", phase, fmt::join(failed, "; ")));
  }

 private:
  MPI_Comm comm_;
  Communicator& names_;
  int rank_;
  std::string error_;
};

}  // namespace

json write_shared_file(const fs::path& directory, std::uint64_t step, std::span<const TensorView> tensors,
                       Communicator& comm, const SaveOptions& options, PieceSource source, std::uint64_t& bytes_written,
                       const std::string* local_error) {
  auto* mpi = dynamic_cast<MpiCommunicator*>(&comm);
  const std::map<std::string, Declaration> plan = agree_on_tensors(tensors, comm, mpi != nullptr, local_error);
  std::map<std::string, const TensorView*> local;
  for (const auto& t : tensors) local[t.name] = &t;

  const int rank = comm.rank();
  const int world = comm.size();
  const bool aggregate = options.shared_file_aggregation;
  const fs::path file_path = directory / kSharedDataFile;
  json report = {{"rank", rank}, {"file", kSharedDataFile}, {"tensors", json::array()}};
  std::vector<std::byte> gather_buffer;
  PhaseAgreement phases(mpi->comm(), comm, rank);
  std::uint64_t written = 0;
  {
    h5::Lock lock(h5::library_mutex());
    h5::Handle fapl;
    h5::Handle dxpl;
    h5::Handle lcpl;
    h5::Handle dcpl;
    phases.run("shared.setup", [&] {
      fapl = h5::make_plist(H5Pcreate(H5P_FILE_ACCESS), "create file access list");
      h5::check(H5Pset_fapl_mpio(fapl.get(), mpi->comm(), MPI_INFO_NULL), "select MPI-IO driver");
      h5::check(H5Pset_all_coll_metadata_ops(fapl.get(), 1), "enable collective metadata reads");
      h5::check(H5Pset_coll_metadata_write(fapl.get(), 1), "enable collective metadata writes");
      if (options.alignment > 1) {
        h5::check(H5Pset_alignment(fapl.get(), options.alignment_threshold, options.alignment), "set alignment");
      }
      h5::check(H5Pset_file_locking(fapl.get(), options.file_locking ? 1 : 0, 1), "set file locking");
      // Without aggregation every rank writes its own pieces independently (H5P_DEFAULT
      // transfers): no collective call, and no agreement, per tensor or chunk. Two-phase
      // aggregation needs collective transfers.
      if (aggregate) {
        dxpl = h5::make_plist(H5Pcreate(H5P_DATASET_XFER), "create transfer list");
        h5::check(H5Pset_dxpl_mpio(dxpl.get(), H5FD_MPIO_COLLECTIVE), "request collective transfers");
      }
      lcpl = h5::link_create_intermediate();
      dcpl = h5::contiguous_no_fill();
    });
    phases.agree("setup");
    h5::Handle file;
    phases.run("shared.create", [&] {
      file = h5::make_file(H5Fcreate(file_path.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, fapl.get()),
                           "create shared file " + file_path.string());
    });
    phases.agree("file creation");
    phases.run("shared.attributes", [&] {
      h5::write_attr_string(file.get(), "format", kFormatName);
      h5::write_attr_i64(file.get(), "format_version", kFormatVersion);
      h5::write_attr_i64(file.get(), "step", static_cast<std::int64_t>(step));
      h5::write_attr_i64(file.get(), "world_size", world);
    });
    phases.agree("file attributes");

    // Collective: every dataset is created (metadata writes) before any data is written, so the
    // data phase below has no collective call: each rank streams its pieces at its own pace.
    struct Created {
      const std::string* name;
      const Declaration* declaration;
      DType dtype;
      h5::Handle type;
      h5::Handle dataset;
      haddr_t address = HADDR_UNDEF;  // of the contiguous storage (writeback hints)
    };
    std::vector<Created> created;
    created.reserve(plan.size());
    for (const auto& [name, declaration] : plan) {
      Created& c = created.emplace_back(Created{&name, &declaration, DType::float32, {}, {}});
      phases.run("shared.create_dataset", [&] {
        c.dtype = dtype_from_name(declaration.dtype);
        c.type = h5::storage_type(c.dtype);
        h5::Handle global_space = h5::dataspace(declaration.shape);
        c.dataset = h5::make_dataset(
            H5Dcreate2(file.get(), name.c_str(), c.type.get(), global_space.get(), lcpl.get(), dcpl.get(), H5P_DEFAULT),
            fmt::format("create dataset {} in {}", name, file_path.string()));
        h5::write_attr_string(c.dataset.get(), "dtype", declaration.dtype);
        h5::write_attr_string(c.dataset.get(), "placement", declaration.placement);
        // Parallel HDF5 allocates contiguous storage at creation; HADDR_UNDEF (nothing to
        // store) only disables the writeback hints.
        c.address = H5Dget_offset(c.dataset.get());
      });
      phases.agree(fmt::format("creation of dataset '{}'", name));
    }

    // Starts the kernel's writeback of each written range right away (asynchronously), so the
    // disk works while the ranks are still copying into the page cache instead of idling until
    // the fsync below, which otherwise writes the whole file (about half of the save's time).
    WritebackHint writeback(file_path, options.fsync);
    const std::byte no_data{};  // a valid pointer for ranks that contribute nothing
    for (Created& c : created) {
      const std::string& name = *c.name;
      const Declaration& declaration = *c.declaration;
      const std::size_t element_size = dtype_size(c.dtype);
      const auto found = local.find(name);
      const TensorView* view = found == local.end() ? nullptr : found->second;
      const std::optional<Box> piece = view ? rank_piece(*view, rank, world) : std::nullopt;
      json entry = {{"name", name},
                    {"dtype", declaration.dtype},
                    {"shape", declaration.shape},
                    {"placement", declaration.placement},
                    {"pieces", json::array()}};
      if (element_count(declaration.shape) == 0) {  // nothing to transfer on any rank
        if (view) report["tensors"].push_back(std::move(entry));
        continue;
      }
      const std::uint64_t piece_bytes = piece ? element_count(piece->extent) * element_size : 0;
      const std::byte* bytes = &no_data;
      std::uint64_t hash = 0;
      if (aggregate) {
        // Collective two-phase transfer of the whole piece; hashed afterwards.
        h5::Handle file_space;
        h5::Handle memory_space;
        phases.run("shared.prepare", [&] {
          file_space = h5::make_space(H5Dget_space(c.dataset.get()), "get dataspace");
          if (piece) {
            bytes = piece_data(*view, *piece, gather_buffer, source);
            memory_space = h5::dataspace(piece->extent);
            if (!declaration.shape.empty()) {
              const std::vector<hsize_t> start(piece->offset.begin(), piece->offset.end());
              const std::vector<hsize_t> count(piece->extent.begin(), piece->extent.end());
              h5::check(
                  H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
                  "select piece of " + name);
            }
          } else {
            const hsize_t one[1] = {1};
            memory_space = h5::make_space(H5Screate_simple(1, one, nullptr), "create dataspace");
            h5::check(H5Sselect_none(memory_space.get()), "select nothing");
            h5::check(H5Sselect_none(file_space.get()), "select nothing");
          }
        });
        phases.agree(fmt::format("preparation of '{}'", name));
        // Collective transfer: every rank calls it (returns on every rank, possibly failed).
        phases.run("shared.write", [&] {
          h5::check(H5Dwrite(c.dataset.get(), c.type.get(), memory_space.get(), file_space.get(), dxpl.get(), bytes),
                    fmt::format("collective write of {} to {}", name, file_path.string()));
          if (piece) {
            hash = xxh3(bytes, piece_bytes);
            writeback.start(c.address, declaration.shape, *piece, element_size);
          }
        });
        phases.agree(fmt::format("write of '{}'", name));
      } else {
        // Local steps only; a failure is remembered and shared at the agreement after the loop.
        phases.run("shared.prepare", [&] {
          if (piece) bytes = piece_data(*view, *piece, gather_buffer, source);
        });
        phases.run("shared.write", [&] {
          if (piece) {
            // independent transfers; each run's writeback starts right after it
            hash = write_hashed_runs(c.dataset.get(), c.type.get(), *piece, element_size, bytes,
                                     /*whole_dataset=*/false,
                                     fmt::format("write of {} to {}", name, file_path.string()), [&](const Box& run) {
                                       writeback.start(c.address, declaration.shape, run, element_size);
                                       if (options.on_progress) options.on_progress();
                                     });
          }
        });
      }
      if (piece) {
        entry["pieces"].push_back(
            {{"offset", piece->offset}, {"extent", piece->extent}, {"in_file_offset", piece->offset}, {"xxh3", hash}});
        written += piece_bytes;
      }
      if (view) report["tensors"].push_back(std::move(entry));
    }
    if (!aggregate) phases.agree("write of the pieces");
    created.clear();  // closes the datasets before the file
    phases.run("shared.close", [&] { file.close_checked("close shared file " + file_path.string()); });
    phases.agree("file close");
  }
  // Every rank flushes its node's cached pages of the file (MPI-IO wrote through each of them).
  // Local from here on: a failure is this rank's "no" vote.
  if (options.fsync) fsync_path(file_path, false);
  report["file_bytes"] = static_cast<std::uint64_t>(fs::file_size(file_path));
  bytes_written += written;
  return report;
}

}  // namespace elastrun::ckpt::detail
