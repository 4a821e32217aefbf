// save_checkpoint: shard files per rank, vote, index with virtual datasets, then the atomic
// commit and housekeeping of steps.cpp.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "elastrun/ckpt/checkpoint.hpp"
#include "h5.hpp"
#include "internal.hpp"
#include "steps.hpp"
#include "vote.hpp"
#include "writers.hpp"

namespace elastrun::ckpt {

namespace fs = std::filesystem;
using detail::Box;
using nlohmann::json;

std::optional<Box> detail::rank_piece(const TensorView& t, int rank, int world) {
  if (t.placement == Placement::sharded) {
    if (element_count(t.slice_extent) == 0) return std::nullopt;
    return Box{t.slice_offset, t.slice_extent};
  }
  return detail::replicated_piece(t.global_shape, rank, world);
}

const std::byte* detail::piece_data(const TensorView& t, const Box& piece, std::vector<std::byte>& gather_buffer,
                                    PieceSource source) {
  if (t.placement == Placement::sharded || t.global_shape.empty() || source == PieceSource::rank_piece_only) {
    return t.data;
  }
  // A replicated piece differs from the whole tensor in one dimension (`split`); it is
  // contiguous in the caller's memory when every dimension before that one has length 1.
  const std::size_t ndim = t.global_shape.size();
  const std::size_t element_size = dtype_size(t.dtype);
  std::size_t split = 0;
  while (split < ndim && piece.extent[split] == t.global_shape[split]) ++split;
  if (split == ndim) return t.data;  // the whole tensor
  bool contiguous = true;
  for (std::size_t d = 0; d < split; ++d) contiguous = contiguous && t.global_shape[d] == 1;
  if (contiguous) {
    std::uint64_t stride_bytes = element_size;
    for (std::size_t d = split + 1; d < ndim; ++d) stride_bytes *= t.global_shape[d];
    return t.data + piece.offset[split] * stride_bytes;
  }
  gather_buffer.resize(element_count(piece.extent) * element_size);
  detail::copy_box(t.data, t.global_shape, piece.offset, gather_buffer.data(), piece.extent, Shape(ndim, 0),
                   piece.extent, element_size);
  return gather_buffer.data();
}

void detail::validate_tensors(std::span<const TensorView> tensors) {
  std::set<std::string> names;
  for (const auto& t : tensors) {
    if (auto reason = detail::invalid_name_reason(t.name); !reason.empty()) {
      throw CheckpointError(fmt::format("tensor '{}': {}; rename it", t.name, reason));
    }
    if (!names.insert(t.name).second) {
      throw CheckpointError(fmt::format("tensor '{}' is passed twice to save; pass it once", t.name));
    }
    const std::size_t ndim = t.global_shape.size();
    if (t.slice_offset.size() != ndim || t.slice_extent.size() != ndim) {
      throw CheckpointError(fmt::format("tensor '{}': slice offset/extent need {} dimensions like the global shape {}",
                                        t.name, ndim, detail::shape_string(t.global_shape)));
    }
    for (std::size_t d = 0; d < ndim; ++d) {
      if (t.slice_offset[d] + t.slice_extent[d] > t.global_shape[d]) {
        throw CheckpointError(
            fmt::format("tensor '{}': slice offset {} extent {} exceeds global shape {} in dimension {}", t.name,
                        detail::shape_string(t.slice_offset), detail::shape_string(t.slice_extent),
                        detail::shape_string(t.global_shape), d));
      }
    }
    if (t.placement == Placement::replicated && t.slice_extent != t.global_shape) {
      throw CheckpointError(fmt::format("tensor '{}': a replicated tensor must pass its whole shape as slice", t.name));
    }
    if (t.data == nullptr && t.slice_bytes() > 0) {
      throw CheckpointError(fmt::format("tensor '{}': data pointer is null", t.name));
    }
  }
}

std::map<std::string, std::uint64_t> detail::replica_fingerprints(std::span<const TensorView> tensors,
                                                                  ReplicaCheck mode) {
  std::map<std::string, std::uint64_t> fingerprints;
  if (mode == ReplicaCheck::off) return fingerprints;
  constexpr std::uint64_t kWhole = 1 << 20;
  constexpr std::uint64_t kBlock = 4096;
  constexpr std::uint64_t kBlocks = 64;
  for (const auto& t : tensors) {
    if (t.placement != Placement::replicated) continue;
    const std::uint64_t bytes = t.slice_bytes();
    if (bytes == 0 || t.data == nullptr) continue;
    if (mode == ReplicaCheck::full || bytes <= kWhole) {
      fingerprints[t.name] = detail::xxh3(t.data, bytes);
      continue;
    }
    detail::Xxh3Stream stream;  // same positions on every rank: they depend on the size only
    for (std::uint64_t i = 0; i < kBlocks; ++i) {
      stream.update(t.data + i * ((bytes - kBlock) / (kBlocks - 1)), kBlock);
    }
    fingerprints[t.name] = stream.digest();
  }
  return fingerprints;
}

detail::WritebackHint::WritebackHint(const fs::path& path, bool enabled)
    : fd_(enabled ? ::open(path.c_str(), O_RDONLY | O_CLOEXEC) : -1) {}

detail::WritebackHint::~WritebackHint() {
  if (fd_ >= 0) (void)::close(fd_);  // read-only descriptor: nothing to report on close
}

void detail::WritebackHint::start(haddr_t address, const Shape& shape, const Box& box, std::size_t element_size) {
  if (fd_ < 0 || address == HADDR_UNDEF) return;
  std::uint64_t first = 0;
  std::uint64_t last = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    first = first * shape[d] + box.offset[d];
    last = last * shape[d] + box.offset[d] + box.extent[d] - 1;
  }
  const std::uint64_t begin = address + first * element_size;
  const std::uint64_t length = (last - first + 1) * element_size;
  if (::sync_file_range(fd_, static_cast<off64_t>(begin), static_cast<off64_t>(length), SYNC_FILE_RANGE_WRITE) != 0) {
    (void)::close(fd_);
    fd_ = -1;
  }
}

std::uint64_t detail::write_hashed_runs(hid_t dataset, hid_t type, const Box& file_box, std::size_t element_size,
                                        const std::byte* bytes, bool whole_dataset, const std::string& what,
                                        const std::function<void(const Box&)>& after_run) {
  Xxh3Stream stream;
  const std::uint64_t total = element_count(file_box.extent) * element_size;
  if (file_box.extent.empty() || (whole_dataset && total <= kWriteChunk)) {  // 0-d, or one run
    stream.update(bytes, total);
    h5::check(H5Dwrite(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes), what);
    if (after_run) after_run(file_box);
    return stream.digest();
  }
  h5::Handle file_space = h5::make_space(H5Dget_space(dataset), "get dataspace");
  const std::size_t rank = file_box.extent.size();
  std::vector<hsize_t> start(rank), count(rank);
  Box run{Shape(rank), Shape(rank)};
  for_each_chunk(
      file_box.extent, element_size, kWriteChunk,
      [&](const Shape& chunk_start, const Shape& chunk_count, std::uint64_t offset, std::uint64_t chunk_bytes) {
        for (std::size_t d = 0; d < rank; ++d) {
          run.offset[d] = file_box.offset[d] + chunk_start[d];
          run.extent[d] = chunk_count[d];
        }
        std::copy(run.offset.begin(), run.offset.end(), start.begin());
        std::copy(run.extent.begin(), run.extent.end(), count.begin());
        h5::check(H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
                  what);
        const hsize_t elements = chunk_bytes / element_size;
        h5::Handle memory_space = h5::make_space(H5Screate_simple(1, &elements, nullptr), "create chunk dataspace");
        stream.update(bytes + offset, chunk_bytes);
        h5::check(H5Dwrite(dataset, type, memory_space.get(), file_space.get(), H5P_DEFAULT, bytes + offset), what);
        if (after_run) after_run(run);
      });
  return stream.digest();
}

json detail::write_shard_file(const fs::path& directory, std::uint64_t step, std::span<const TensorView> tensors,
                              int rank, int world, const SaveOptions& options, PieceSource source,
                              std::uint64_t& bytes_written) {
  detail::validate_tensors(tensors);
  const std::string file_name = detail::shard_file_name(rank, world);
  const fs::path file_path = directory / file_name;
  json report = {{"rank", rank}, {"file", file_name}, {"tensors", json::array()}};
  std::vector<std::byte> gather_buffer;  // replicated pieces that are not contiguous in memory
  {
    h5::Lock lock(h5::library_mutex());
    h5::Handle fapl = h5::file_access(options.alignment, options.alignment_threshold, options.file_locking);
    h5::Handle file = h5::make_file(H5Fcreate(file_path.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, fapl.get()),
                                    fmt::format("create shard file {}", file_path.string()));
    h5::write_attr_string(file.get(), "format", detail::kFormatName);
    h5::write_attr_i64(file.get(), "format_version", kFormatVersion);
    h5::write_attr_i64(file.get(), "step", static_cast<std::int64_t>(step));
    h5::write_attr_i64(file.get(), "rank", rank);
    h5::write_attr_i64(file.get(), "world_size", world);
    h5::Handle lcpl = h5::link_create_intermediate();
    h5::Handle dcpl = h5::contiguous_no_fill();
    detail::WritebackHint writeback(file_path, options.fsync);

    for (const auto& t : tensors) {
      json entry = {{"name", t.name},
                    {"dtype", dtype_name(t.dtype)},
                    {"shape", t.global_shape},
                    {"placement", placement_name(t.placement)},
                    {"pieces", json::array()}};
      const std::size_t element_size = dtype_size(t.dtype);
      const std::optional<Box> piece = detail::rank_piece(t, rank, world);
      const std::byte* bytes = piece ? detail::piece_data(t, *piece, gather_buffer, source) : nullptr;
      if (piece) {
        const std::uint64_t piece_bytes = element_count(piece->extent) * element_size;
        h5::Handle type = h5::storage_type(t.dtype);
        h5::Handle space = h5::dataspace(piece->extent);
        h5::Handle dataset = h5::make_dataset(
            H5Dcreate2(file.get(), t.name.c_str(), type.get(), space.get(), lcpl.get(), dcpl.get(), H5P_DEFAULT),
            fmt::format("create dataset {} in {}", t.name, file_path.string()));
        // Each run's writeback starts right after it (the address exists once data is written).
        haddr_t address = HADDR_UNDEF;
        const std::uint64_t hash = detail::write_hashed_runs(
            dataset.get(), type.get(), Box{Shape(piece->extent.size(), 0), piece->extent}, element_size, bytes,
            /*whole_dataset=*/true, fmt::format("write tensor {} to {}", t.name, file_path.string()),
            [&](const Box& run) {
              if (address == HADDR_UNDEF) address = H5Dget_offset(dataset.get());
              writeback.start(address, piece->extent, run, element_size);
              if (options.on_progress) options.on_progress();
            });
        h5::write_attr_string(dataset.get(), "dtype", dtype_name(t.dtype));
        h5::write_attr_u64_array(dataset.get(), "global_shape", t.global_shape, {t.global_shape.size()});
        h5::write_attr_u64_array(dataset.get(), "global_offset", piece->offset, {piece->offset.size()});
        h5::write_attr_u64_array(dataset.get(), "xxh3_64", {hash}, {1});
        dataset.close_checked(fmt::format("close dataset {} in {}", t.name, file_path.string()));
        entry["pieces"].push_back({{"offset", piece->offset},
                                   {"extent", piece->extent},
                                   {"in_file_offset", Shape(piece->offset.size(), 0)},
                                   {"xxh3", hash}});
        bytes_written += piece_bytes;
      }
      report["tensors"].push_back(std::move(entry));
    }
    file.close_checked(fmt::format("close shard file {}", file_path.string()));
  }
  if (options.fsync) detail::fsync_path(file_path, false);
  report["file_bytes"] = static_cast<std::uint64_t>(fs::file_size(file_path));
  return report;
}

namespace {

// Rank 0: combine the ranks' reports into the manifest, checking that they agree and that
// every tensor is covered exactly once.
json merge_reports(const std::vector<json>& reports, std::uint64_t step, int world, const json& metadata,
                   Layout layout) {
  json manifest = {{"format", detail::kFormatName},
                   {"format_version", kFormatVersion},
                   {"step", step},
                   {"world_size", world},
                   {"layout", layout == Layout::shared_file ? "shared-file" : "file-per-rank"},
                   {"hash_algorithm", detail::kHashAlgorithm},
                   {"metadata", metadata},
                   {"files", json::array()},
                   {"tensors", json::array()}};
  std::map<std::string, json> tensors;
  std::set<std::string> files;
  for (const auto& report : reports) {
    if (files.insert(report["file"].get<std::string>()).second) {
      manifest["files"].push_back({{"name", report["file"]}, {"bytes", report["file_bytes"]}});
    }
    for (const auto& entry : report["tensors"]) {
      const std::string name = entry["name"];
      auto [it, inserted] = tensors.try_emplace(name, json{{"name", name},
                                                           {"dtype", entry["dtype"]},
                                                           {"shape", entry["shape"]},
                                                           {"placement", entry["placement"]},
                                                           {"shards", json::array()}});
      json& tensor = it->second;
      if (tensor["dtype"] != entry["dtype"] || tensor["shape"] != entry["shape"] ||
          tensor["placement"] != entry["placement"]) {
        throw CheckpointError(fmt::format(
            "tensor '{}': rank {} declares {} {} {} but another rank declares {} {} {}; all ranks "
            "must agree on dtype, global shape and placement",
            name, report["rank"].get<int>(), entry["dtype"].dump(), entry["shape"].dump(), entry["placement"].dump(),
            tensor["dtype"].dump(), tensor["shape"].dump(), tensor["placement"].dump()));
      }
      for (const auto& piece : entry["pieces"]) {
        tensor["shards"].push_back({{"file", report["file"]},
                                    {"rank", report["rank"]},
                                    {"offset", piece["offset"]},
                                    {"extent", piece["extent"]},
                                    {"in_file_offset", piece["in_file_offset"]},
                                    {"xxh3", piece["xxh3"]}});
      }
    }
  }
  for (auto& [name, tensor] : tensors) {
    const Shape shape = tensor["shape"].get<Shape>();
    std::vector<Box> boxes;
    std::uint64_t covered = 0;
    for (const auto& shard : tensor["shards"]) {
      Box box{shard["offset"].get<Shape>(), shard["extent"].get<Shape>()};
      covered += element_count(box.extent);
      boxes.push_back(std::move(box));
    }
    // Overlap check as a sweep along dimension 0: a box is compared only with the boxes whose
    // dimension-0 range is still open, i.e. O(pieces) for row splits, not O(pieces^2).
    if (!shape.empty()) {
      std::sort(boxes.begin(), boxes.end(), [](const Box& a, const Box& b) { return a.offset[0] < b.offset[0]; });
      std::vector<const Box*> open;
      for (const auto& box : boxes) {
        std::erase_if(open, [&](const Box* o) { return o->offset[0] + o->extent[0] <= box.offset[0]; });
        for (const Box* other : open) {
          if (detail::intersect(box, *other)) {
            throw CheckpointError(
                fmt::format("tensor '{}': slices from different ranks overlap at offset {}; save each element "
                            "from exactly one rank (mark whole copies as replicated)",
                            name, detail::shape_string(box.offset)));
          }
        }
        open.push_back(&box);
      }
    } else if (boxes.size() > 1) {
      throw CheckpointError(fmt::format("tensor '{}': the 0-d tensor is saved by {} ranks", name, boxes.size()));
    }
    if (covered != element_count(shape)) {
      throw CheckpointError(
          fmt::format("tensor '{}': the ranks' slices cover {} of {} elements; every element of a sharded "
                      "tensor must be saved by some rank, and a replicated one declared on every rank",
                      name, covered, element_count(shape)));
    }
    manifest["tensors"].push_back(std::move(tensor));
  }
  // Replicated tensors: every rank must hold the same bytes (each wrote only its part).
  std::map<std::string, std::pair<std::uint64_t, int>> reference;  // name -> (fingerprint, rank)
  std::map<std::string, std::vector<int>> differing;
  for (const auto& report : reports) {
    if (!report.contains("fingerprints")) continue;
    const int rank = report["rank"].get<int>();
    for (const auto& [name, value] : report["fingerprints"].items()) {
      const auto fingerprint = value.get<std::uint64_t>();
      auto [it, inserted] = reference.try_emplace(name, fingerprint, rank);
      if (!inserted && it->second.first != fingerprint) differing[name].push_back(rank);
    }
  }
  if (!differing.empty()) {
    std::vector<std::string> parts;
    for (const auto& [name, ranks] : differing) {
      std::vector<int> shown(ranks.begin(), ranks.begin() + std::min<std::size_t>(ranks.size(), 8));
      parts.push_back(fmt::format(
          "replicated tensor '{}' differs across ranks: rank(s) {}{} hold "
          "other values than rank {}",
          name, fmt::join(shown, ", "), ranks.size() > shown.size() ? ", ..." : "", reference[name].second));
    }
    throw CheckpointError(
        fmt::format("{}; a replicated tensor must be identical on every rank (broadcast it, or save it as "
                    "sharded)",
                    fmt::join(parts, "; ")));
  }
  return manifest;
}

void write_string_dataset(hid_t file, const std::string& path, const std::string& text) {
  h5::Handle type = h5::make_type(H5Tcopy(H5T_C_S1), "copy string type");
  h5::check(H5Tset_size(type.get(), std::max<std::size_t>(text.size(), 1)), "set string size");
  h5::check(H5Tset_cset(type.get(), H5T_CSET_UTF8), "set string charset");
  h5::Handle space = h5::make_space(H5Screate(H5S_SCALAR), "create scalar dataspace");
  h5::Handle lcpl = h5::link_create_intermediate();
  h5::Handle dataset = h5::make_dataset(
      H5Dcreate2(file, path.c_str(), type.get(), space.get(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT), "create " + path);
  h5::check(H5Dwrite(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, text.c_str()), "write " + path);
}

// Rank 0: index.h5 with one virtual dataset per tensor over the shard files (0-d tensors are
// copied, HDF5 virtual datasets need a simple dataspace).
void write_index(const fs::path& directory, const json& manifest, const SaveOptions& options) {
  const fs::path index_path = directory / detail::kIndexFile;
  h5::Lock lock(h5::library_mutex());
  h5::Handle fapl = h5::file_access(0, 0, options.file_locking);
  h5::Handle file = h5::make_file(H5Fcreate(index_path.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, fapl.get()),
                                  "create index " + index_path.string());
  h5::write_attr_string(file.get(), "format", detail::kFormatName);
  h5::write_attr_i64(file.get(), "format_version", kFormatVersion);
  h5::write_attr_i64(file.get(), "step", manifest["step"].get<std::int64_t>());
  h5::write_attr_i64(file.get(), "world_size", manifest["world_size"].get<std::int64_t>());
  h5::write_attr_string(file.get(), "layout", manifest["layout"].get<std::string>());
  h5::write_attr_string(file.get(), "hash_algorithm", detail::kHashAlgorithm);
  h5::Handle lcpl = h5::link_create_intermediate();
  const bool shared = manifest["layout"] == "shared-file";

  for (const auto& tensor : manifest["tensors"]) {
    const std::string name = tensor["name"];
    const DType dtype = dtype_from_name(tensor["dtype"].get<std::string>());
    const Shape shape = tensor["shape"].get<Shape>();
    h5::Handle type = h5::storage_type(dtype);
    h5::Handle space = h5::dataspace(shape);
    h5::Handle dataset;
    if (shape.empty()) {
      // Copy the scalar from the shard that holds it (already durable on disk).
      const auto& shard = tensor["shards"].at(0);
      const fs::path shard_path = directory / shard["file"].get<std::string>();
      h5::Handle shard_fapl = h5::file_access(0, 0, options.file_locking);
      h5::Handle shard_file =
          h5::make_file(H5Fopen(shard_path.c_str(), H5F_ACC_RDONLY, shard_fapl.get()), "open " + shard_path.string());
      h5::Handle source = h5::make_dataset(H5Dopen2(shard_file.get(), name.c_str(), H5P_DEFAULT),
                                           "open " + name + " in " + shard_path.string());
      std::vector<std::byte> value(dtype_size(dtype));
      h5::check(H5Dread(source.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, value.data()),
                "read " + name + " from " + shard_path.string());
      dataset = h5::make_dataset(
          H5Dcreate2(file.get(), name.c_str(), type.get(), space.get(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT),
          "create index dataset " + name);
      h5::check(H5Dwrite(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, value.data()),
                "write index dataset " + name);
    } else {
      h5::Handle dcpl = h5::make_plist(H5Pcreate(H5P_DATASET_CREATE), "create dataset list");
      const std::string source_name = h5::escape_vds_name(name);
      for (const auto& shard : tensor["shards"]) {
        const Shape offset = shard["offset"].get<Shape>();
        const Shape extent = shard["extent"].get<Shape>();
        const Shape in_file = shard["in_file_offset"].get<Shape>();
        const std::vector<hsize_t> start(offset.begin(), offset.end());
        const std::vector<hsize_t> count(extent.begin(), extent.end());
        const std::vector<hsize_t> source_start(in_file.begin(), in_file.end());
        h5::Handle virtual_space = h5::make_space(H5Scopy(space.get()), "copy dataspace");
        h5::check(
            H5Sselect_hyperslab(virtual_space.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
            "select virtual hyperslab of " + name);
        // Per-rank shards hold exactly the piece; the shared file holds the global tensor.
        h5::Handle source_space = h5::dataspace(shared ? shape : extent);
        h5::check(H5Sselect_hyperslab(source_space.get(), H5S_SELECT_SET, source_start.data(), nullptr, count.data(),
                                      nullptr),
                  "select source hyperslab of " + name);
        h5::check(H5Pset_virtual(dcpl.get(), virtual_space.get(), shard["file"].get<std::string>().c_str(),
                                 source_name.c_str(), source_space.get()),
                  "map " + name + " to " + shard["file"].get<std::string>());
      }
      dataset = h5::make_dataset(
          H5Dcreate2(file.get(), name.c_str(), type.get(), space.get(), lcpl.get(), dcpl.get(), H5P_DEFAULT),
          "create virtual dataset " + name);
    }
    // Attributes for readers without elastrun code.
    std::vector<std::int32_t> ranks;
    std::vector<std::uint64_t> offsets, extents, hashes;
    for (const auto& shard : tensor["shards"]) {
      ranks.push_back(shard["rank"].get<std::int32_t>());
      for (auto v : shard["offset"]) offsets.push_back(v.get<std::uint64_t>());
      for (auto v : shard["extent"]) extents.push_back(v.get<std::uint64_t>());
      hashes.push_back(shard["xxh3"].get<std::uint64_t>());
    }
    h5::write_attr_string(dataset.get(), "dtype", dtype_name(dtype));
    h5::write_attr_string(dataset.get(), "placement", tensor["placement"].get<std::string>());
    h5::write_attr_u64_array(dataset.get(), "global_shape", shape, {shape.size()});
    h5::write_attr_i32_array(dataset.get(), "shard_ranks", ranks);
    if (!shape.empty()) {
      const std::vector<hsize_t> dims = {ranks.size(), shape.size()};
      h5::write_attr_u64_array(dataset.get(), "shard_offsets", offsets, dims);
      h5::write_attr_u64_array(dataset.get(), "shard_extents", extents, dims);
    }
    h5::write_attr_u64_array(dataset.get(), "shard_xxh3_64", hashes, {hashes.size()});
    dataset.close_checked("close index dataset " + name);
  }
  write_string_dataset(file.get(), std::string(detail::kManifestDataset), manifest.dump());
  // A dataset, not an attribute: HDF5 1.10 refuses attributes past 64 KiB.
  write_string_dataset(file.get(), std::string(detail::kUserMetadataDataset), manifest["metadata"].dump());
  file.close_checked("close index " + index_path.string());
}

}  // namespace

namespace {

// Whether `j` nests deeper than `limit` (stops looking there: bounded recursion).
bool nested_deeper_than(const json& j, int limit) {
  if (!j.is_structured()) return false;
  if (limit == 0) return true;
  for (const auto& child : j)
    if (nested_deeper_than(child, limit - 1)) return true;
  return false;
}

}  // namespace

SaveResult save_checkpoint(const fs::path& root, std::uint64_t step, std::span<const TensorView> tensors,
                           const json& metadata, Communicator& comm, const SaveOptions& options) {
  return detail::save_checkpoint_from(root, step, tensors, metadata, comm, options, {});
}

void fail_save_checkpoint(const fs::path& root, std::uint64_t step, const std::string& reason, Communicator& comm,
                          const SaveOptions& options) {
  detail::SaveInputs inputs;
  inputs.local_error = &reason;
  (void)detail::save_checkpoint_from(root, step, {}, json::object(), comm, options, inputs);
  throw CheckpointError(fmt::format("checkpoint step {} not saved: {}", step, reason));  // not reached: the vote fails
}

SaveResult detail::save_checkpoint_from(const fs::path& root, std::uint64_t step, std::span<const TensorView> tensors,
                                        const json& metadata, Communicator& comm, const SaveOptions& options,
                                        const SaveInputs& inputs) {
  // Readers refuse manifests nested deeper than 64 levels (load.cpp); the metadata sits 1 deep.
  // Every rank has the same metadata, so every rank refuses: no collective is left half done.
  if (nested_deeper_than(metadata, 48))
    throw CheckpointError("checkpoint metadata is nested deeper than 48 levels; flatten it");
  const int rank = comm.rank();
  // Round 1 (broadcast): rank 0 creates the temporary directory and tells everyone its name.
  std::string proposal;
  if (rank == 0) {
    try {
      fs::create_directories(root);
      const std::string generation = detail::generation_token();
      const fs::path temporary = root / (detail::step_name(step) + ".tmp-" + generation);
      fs::create_directory(temporary);
      proposal = detail::Decision::go(generation).encode();
    } catch (const std::exception& e) {
      proposal = detail::Decision::fail(
                     fmt::format("cannot create checkpoint directory under {}: {}", root.string(), e.what()))
                     .encode();
    }
  }
  const detail::Decision created = detail::Decision::decode(comm.broadcast(proposal));
  if (created.action != detail::Decision::Action::Go) throw CheckpointError(created.error);
  const std::string& generation = created.value;
  const fs::path temporary = root / (detail::step_name(step) + ".tmp-" + generation);

  // Round 2 (gather to rank 0): every rank writes its shard and votes with its report (or its
  // error). A rank that already failed locally still takes part, voting no, so the other ranks
  // never wait for it.
  SaveResult result;
  std::string vote;
  try {
    std::map<std::string, std::uint64_t> own_fingerprints;
    const std::map<std::string, std::uint64_t>* fingerprints = inputs.fingerprints;
    if (fingerprints == nullptr && inputs.local_error == nullptr) {
      own_fingerprints = detail::replica_fingerprints(tensors, options.check_replicas);
      fingerprints = &own_fingerprints;
    }
    json report;
    if (options.layout == Layout::shared_file) {
      // Collective: a local error is shared inside, so every rank fails in the same phase.
      report = detail::write_shared_file(temporary, step, tensors, comm, options, inputs.source, result.bytes_written,
                                         inputs.local_error);
    } else {
      if (inputs.local_error) throw CheckpointError(*inputs.local_error);
      report = inputs.write_shard ? inputs.write_shard(temporary, result.bytes_written)
                                  : detail::write_shard_file(temporary, step, tensors, comm.rank(), comm.size(),
                                                             options, inputs.source, result.bytes_written);
    }
    if (fingerprints != nullptr && !fingerprints->empty()) report["fingerprints"] = *fingerprints;
    vote = detail::RankVote::ok(std::move(report)).encode();
  } catch (const std::exception& e) {
    vote = detail::RankVote::error(e.what()).encode();
  }
  const std::vector<std::string> votes = comm.gather(vote);

  // Round 3 (broadcast): rank 0 checks the votes, writes the index, commits and tells everyone
  // the outcome: Fail (not committed, previous kept) or Go with the commit's warnings.
  std::string outcome;
  if (rank == 0) {
    detail::Decision decision;
    const std::vector<detail::RankVote> ballots = detail::decode_votes(votes);
    if (const std::string errors = detail::failed_ranks(ballots); !errors.empty()) {
      decision =
          detail::Decision::fail(fmt::format("checkpoint step {} not saved (previous one kept): {}", step, errors));
    } else {
      try {
        std::vector<json> reports;
        reports.reserve(ballots.size());
        for (const auto& b : ballots) reports.push_back(b.report);
        const json manifest = merge_reports(reports, step, comm.size(), metadata, options.layout);
        write_index(temporary, manifest, options);
        decision.warnings = detail::commit(root, temporary, step, generation, options);
        try {
          remove_partial_directories(root);
          apply_retention(root, step, options.keep_last, options.keep_every);
        } catch (const std::exception&) {
          // Housekeeping failures never fail a committed save; the next save retries.
        }
      } catch (const std::exception& e) {
        decision = detail::Decision::fail(
            fmt::format("checkpoint step {} not committed (previous one kept): {}", step, e.what()));
      }
    }
    if (decision.action != detail::Decision::Action::Go) {
      std::error_code ec;
      fs::remove_all(temporary, ec);  // best effort; otherwise the next save removes it
    }
    outcome = decision.encode();
  }
  const detail::Decision decision = detail::Decision::decode(comm.broadcast(outcome));
  if (decision.action != detail::Decision::Action::Go) throw CheckpointError(decision.error);
  result.warnings = decision.warnings;
  result.path = step_directory(root, step);
  return result;
}

}  // namespace elastrun::ckpt
