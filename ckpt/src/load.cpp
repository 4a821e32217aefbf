// Checkpoint (reader) and restore_latest (collective, with fallback).
#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "elastrun/ckpt/checkpoint.hpp"
#include "h5.hpp"
#include "internal.hpp"

namespace elastrun::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;
using detail::Box;

struct Checkpoint::State {
  fs::path path;
  json manifest;
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::size_t> by_name;
  std::map<std::string, h5::Handle> open_shards;  // file name -> handle
  std::set<std::string> verified;  // piece_key() of pieces whose hash matched
  std::vector<std::byte> scratch;  // reused for whole-shard reads when verifying

  ~State() {
    h5::Lock lock(h5::library_mutex());  // H5Fclose of the cached shards
    open_shards.clear();
  }

  hid_t shard(const std::string& file_name) {
    auto it = open_shards.find(file_name);
    if (it != open_shards.end()) return it->second.get();
    const fs::path shard_path = path / file_name;
    h5::Handle fapl = h5::file_access(0, 0, false);
    h5::Handle file = h5::make_file(H5Fopen(shard_path.c_str(), H5F_ACC_RDONLY, fapl.get()),
                                    "open shard " + shard_path.string());
    return open_shards.emplace(file_name, std::move(file)).first->second.get();
  }
};

namespace {

std::string piece_key(const ShardInfo& shard, const std::string& tensor) {
  return shard.file + '\n' + tensor + '\n' + std::to_string(shard.rank);
}

std::string read_manifest_text(const fs::path& index_path) {
  h5::Handle fapl = h5::file_access(0, 0, false);
  h5::Handle file = h5::make_file(H5Fopen(index_path.c_str(), H5F_ACC_RDONLY, fapl.get()),
                                  "open index");
  h5::Handle dataset = h5::make_dataset(
      H5Dopen2(file.get(), std::string(detail::kManifestDataset).c_str(), H5P_DEFAULT),
      "open manifest");
  h5::Handle type = h5::make_type(H5Dget_type(dataset.get()), "manifest type");
  if (H5Tget_class(type.get()) != H5T_STRING || H5Tis_variable_str(type.get()) != 0) {
    throw CheckpointError("manifest is not a fixed-length string");
  }
  std::string text(H5Tget_size(type.get()), '\0');
  h5::check(H5Dread(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, text.data()),
            "read manifest");
  if (auto nul = text.find('\0'); nul != std::string::npos) text.resize(nul);
  return text;
}

}  // namespace

Checkpoint::Checkpoint(fs::path step_dir) : state_(std::make_unique<State>()) {
  state_->path = std::move(step_dir);
  const fs::path index_path = state_->path / detail::kIndexFile;
  try {
    h5::Lock lock(h5::library_mutex());
    if (!fs::exists(index_path)) throw CheckpointError("file missing");
    state_->manifest = json::parse(read_manifest_text(index_path));
    const json& m = state_->manifest;
    if (m.at("format") != detail::kFormatName) throw CheckpointError("not an elastrun checkpoint");
    if (m.at("format_version").get<int>() > kFormatVersion) {
      throw CheckpointError(fmt::format("format version {} is newer than this reader ({}); "
                                        "upgrade elastrun",
                                        m.at("format_version").get<int>(), kFormatVersion));
    }
    for (const auto& t : m.at("tensors")) {
      TensorInfo info;
      info.name = t.at("name").get<std::string>();
      info.dtype = dtype_from_name(t.at("dtype").get<std::string>());
      info.shape = t.at("shape").get<Shape>();
      info.placement =
          t.at("placement") == "sharded" ? Placement::sharded : Placement::replicated;
      for (const auto& s : t.at("shards")) {
        ShardInfo shard{s.at("file").get<std::string>(), s.at("rank").get<int>(),
                        s.at("offset").get<Shape>(), s.at("extent").get<Shape>(),
                        s.at("xxh3").get<std::uint64_t>(),
                        s.value("in_file_offset", Shape(info.shape.size(), 0))};
        info.shards.push_back(std::move(shard));
      }
      state_->by_name[info.name] = state_->tensors.size();
      state_->tensors.push_back(std::move(info));
    }
  } catch (const std::exception& e) {
    throw CorruptCheckpointError(fmt::format("{}: unreadable checkpoint index ({}); restore will "
                                             "use an older step",
                                             index_path.string(), e.what()));
  }
}

Checkpoint::~Checkpoint() = default;
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;

const fs::path& Checkpoint::path() const { return state_->path; }
std::uint64_t Checkpoint::step() const { return state_->manifest.at("step").get<std::uint64_t>(); }
int Checkpoint::world_size() const { return state_->manifest.at("world_size").get<int>(); }
std::string Checkpoint::layout() const { return state_->manifest.at("layout").get<std::string>(); }
const json& Checkpoint::metadata() const { return state_->manifest.at("metadata"); }
const std::vector<TensorInfo>& Checkpoint::tensors() const { return state_->tensors; }

const TensorInfo& Checkpoint::tensor(const std::string& name) const {
  auto it = state_->by_name.find(name);
  if (it == state_->by_name.end()) {
    throw CheckpointError(fmt::format("{}: no tensor named '{}' in this checkpoint",
                                      state_->path.string(), name));
  }
  return state_->tensors[it->second];
}

std::uint64_t Checkpoint::total_bytes() const {
  std::uint64_t total = 0;
  for (const auto& t : state_->tensors) total += t.bytes();
  return total;
}

void Checkpoint::check_files() const {
  for (const auto& f : state_->manifest.at("files")) {
    const fs::path file = state_->path / f.at("name").get<std::string>();
    struct stat info {};
    if (::stat(file.c_str(), &info) != 0) {
      throw CorruptCheckpointError(fmt::format("{}: shard file missing", file.string()));
    }
    const auto expected = f.at("bytes").get<std::uint64_t>();
    if (static_cast<std::uint64_t>(info.st_size) != expected) {
      throw CorruptCheckpointError(fmt::format("{}: shard file has {} bytes, expected {} "
                                               "(truncated or replaced)",
                                               file.string(), info.st_size, expected));
    }
  }
}

namespace {

// Opens the dataset holding `shard` and checks that its dataspace contains the piece.
h5::Handle open_piece(hid_t file, const TensorInfo& tensor, const ShardInfo& shard,
                      h5::Handle& file_space) {
  h5::Handle dataset = h5::make_dataset(H5Dopen2(file, tensor.name.c_str(), H5P_DEFAULT),
                                        "open dataset");
  file_space = h5::make_space(H5Dget_space(dataset.get()), "get dataspace");
  const std::size_t ndim = tensor.shape.size();
  const int file_ndim = H5Sget_simple_extent_ndims(file_space.get());
  h5::check(file_ndim, "get dataset rank");
  std::vector<hsize_t> dims(static_cast<std::size_t>(file_ndim));
  h5::check(H5Sget_simple_extent_dims(file_space.get(), dims.data(), nullptr), "get dataset shape");
  bool holds = static_cast<std::size_t>(file_ndim) == ndim;
  for (std::size_t d = 0; holds && d < ndim; ++d) {
    holds = shard.in_file_offset[d] + shard.extent[d] <= dims[d];
  }
  if (!holds) {
    throw CheckpointError(fmt::format("dataset shape [{}] does not hold the piece of extent {} "
                                      "the manifest records",
                                      fmt::join(dims, ", "), detail::shape_string(shard.extent)));
  }
  return dataset;
}

// Reads the whole piece `shard` (for hashing) into `buffer`.
void read_whole_shard(hid_t file, const TensorInfo& tensor, const ShardInfo& shard,
                      std::vector<std::byte>& buffer) {
  h5::Handle file_space;
  h5::Handle dataset = open_piece(file, tensor, shard, file_space);
  h5::Handle type = h5::storage_type(tensor.dtype);
  buffer.resize(element_count(shard.extent) * dtype_size(tensor.dtype));
  if (tensor.shape.empty()) {
    h5::check(H5Dread(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, buffer.data()),
              "read scalar");
    return;
  }
  const std::vector<hsize_t> start(shard.in_file_offset.begin(), shard.in_file_offset.end());
  const std::vector<hsize_t> count(shard.extent.begin(), shard.extent.end());
  h5::check(H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start.data(), nullptr,
                                count.data(), nullptr),
            "select piece");
  h5::Handle memory_space = h5::dataspace(shard.extent);
  h5::check(H5Dread(dataset.get(), type.get(), memory_space.get(), file_space.get(), H5P_DEFAULT,
                    buffer.data()),
            "read piece");
}

}  // namespace

std::vector<std::string> Checkpoint::verify_all() {
  std::vector<std::string> problems;
  try {
    check_files();
  } catch (const CheckpointError& e) {
    problems.push_back(e.what());
  }
  h5::Lock lock(h5::library_mutex());
  for (const auto& tensor : state_->tensors) {
    for (const auto& shard : tensor.shards) {
      try {
        read_whole_shard(state_->shard(shard.file), tensor, shard, state_->scratch);
        const std::uint64_t hash = detail::xxh3(state_->scratch.data(), state_->scratch.size());
        if (hash != shard.xxh3) {
          problems.push_back(fmt::format("{}: tensor '{}' content hash {} != recorded {} (data "
                                         "corrupted)",
                                         (state_->path / shard.file).string(), tensor.name,
                                         detail::hex64(hash), detail::hex64(shard.xxh3)));
        } else {
          state_->verified.insert(piece_key(shard, tensor.name));
        }
      } catch (const CheckpointError& e) {
        problems.push_back(fmt::format("{}: tensor '{}' unreadable: {}",
                                       (state_->path / shard.file).string(), tensor.name,
                                       e.what()));
      }
    }
  }
  return problems;
}

void Checkpoint::read(const TensorTarget& target, const ReadOptions& options) {
  const TensorInfo& tensor = this->tensor(target.name);
  const std::size_t ndim = tensor.shape.size();
  if (target.dtype != tensor.dtype) {
    throw CheckpointError(fmt::format("{}: tensor '{}' is {} but the target is {}; convert after "
                                      "loading",
                                      state_->path.string(), target.name,
                                      dtype_name(tensor.dtype), dtype_name(target.dtype)));
  }
  if (target.offset.size() != ndim || target.extent.size() != ndim) {
    throw CheckpointError(fmt::format("{}: tensor '{}' has shape {} but the target box has {} "
                                      "dimensions",
                                      state_->path.string(), target.name,
                                      detail::shape_string(tensor.shape), target.extent.size()));
  }
  for (std::size_t d = 0; d < ndim; ++d) {
    if (target.offset[d] + target.extent[d] > tensor.shape[d]) {
      throw CheckpointError(fmt::format("{}: target box offset {} extent {} is outside tensor "
                                        "'{}' of shape {}",
                                        state_->path.string(), detail::shape_string(target.offset),
                                        detail::shape_string(target.extent), target.name,
                                        detail::shape_string(tensor.shape)));
    }
  }
  if (target.bytes() == 0) return;
  if (target.data == nullptr) {
    throw CheckpointError("target for tensor '" + target.name + "' has a null data pointer");
  }
  const std::size_t element_size = dtype_size(tensor.dtype);
  const Box wanted{target.offset, target.extent};
  h5::Lock lock(h5::library_mutex());
  for (const auto& shard : tensor.shards) {
    const auto overlap = detail::intersect(wanted, Box{shard.offset, shard.extent});
    if (!overlap) continue;
    Shape in_shard(ndim), in_target(ndim);
    for (std::size_t d = 0; d < ndim; ++d) {
      in_shard[d] = overlap->offset[d] - shard.offset[d];
      in_target[d] = overlap->offset[d] - target.offset[d];
    }
    const fs::path shard_path = state_->path / shard.file;
    try {
      const hid_t file = state_->shard(shard.file);
      const bool verify = options.verify && !state_->verified.contains(piece_key(shard, tensor.name));
      if (verify) {
        // Hashing needs the whole shard dataset; read it once and copy the overlap from memory.
        read_whole_shard(file, tensor, shard, state_->scratch);
        const std::uint64_t hash = detail::xxh3(state_->scratch.data(), state_->scratch.size());
        if (hash != shard.xxh3) {
          throw CorruptCheckpointError(fmt::format(
              "{}: tensor '{}' content hash {} != recorded {}; the shard is corrupted, restore "
              "will use an older step",
              shard_path.string(), tensor.name, detail::hex64(hash), detail::hex64(shard.xxh3)));
        }
        state_->verified.insert(piece_key(shard, tensor.name));
        detail::copy_box(state_->scratch.data(), shard.extent, in_shard, target.data,
                         target.extent, in_target, overlap->extent, element_size);
        continue;
      }
      h5::Handle file_space;
      h5::Handle dataset = open_piece(file, tensor, shard, file_space);
      h5::Handle type = h5::storage_type(tensor.dtype);
      if (ndim == 0) {
        h5::check(H5Dread(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, target.data),
                  "read scalar");
        continue;
      }
      std::vector<hsize_t> file_start(ndim);
      for (std::size_t d = 0; d < ndim; ++d) file_start[d] = shard.in_file_offset[d] + in_shard[d];
      const std::vector<hsize_t> count(overlap->extent.begin(), overlap->extent.end());
      h5::check(H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, file_start.data(), nullptr,
                                    count.data(), nullptr),
                "select shard hyperslab");
      h5::Handle memory_space = h5::dataspace(target.extent);
      const std::vector<hsize_t> memory_start(in_target.begin(), in_target.end());
      h5::check(H5Sselect_hyperslab(memory_space.get(), H5S_SELECT_SET, memory_start.data(),
                                    nullptr, count.data(), nullptr),
                "select target hyperslab");
      h5::check(H5Dread(dataset.get(), type.get(), memory_space.get(), file_space.get(),
                        H5P_DEFAULT, target.data),
                "read hyperslab");
    } catch (const CorruptCheckpointError&) {
      throw;
    } catch (const std::exception& e) {
      throw CorruptCheckpointError(fmt::format("{}: cannot read tensor '{}' ({}); restore will "
                                               "use an older step",
                                               shard_path.string(), tensor.name, e.what()));
    }
  }
}

std::optional<RestoreResult> restore_latest(const fs::path& root,
                                            std::span<const TensorTarget> targets,
                                            Communicator& comm, const RestoreOptions& options) {
  // Everyone tries the same candidates in the same order: rank 0's listing.
  std::string listing;
  if (comm.rank() == 0) {
    json steps = json::array();
    for (const auto& entry : list_steps(root)) steps.push_back(entry.step);
    listing = steps.dump();
  }
  std::vector<std::uint64_t> candidates =
      json::parse(comm.allgather(listing).at(0)).get<std::vector<std::uint64_t>>();
  std::reverse(candidates.begin(), candidates.end());
  if (options.max_attempts > 0 && candidates.size() > static_cast<std::size_t>(options.max_attempts)) {
    candidates.resize(static_cast<std::size_t>(options.max_attempts));
  }
  RestoreResult result;
  for (const std::uint64_t step : candidates) {
    const fs::path path = step_directory(root, step);
    std::string status = "ok";
    json metadata;
    try {
      Checkpoint checkpoint(path);
      checkpoint.check_files();
      for (const auto& target : targets) checkpoint.read(target, ReadOptions{options.verify});
      metadata = checkpoint.metadata();
    } catch (const CorruptCheckpointError& e) {
      status = std::string("corrupt:") + e.what();
    } catch (const std::exception& e) {
      status = std::string("error:") + e.what();
    }
    const std::vector<std::string> statuses = comm.allgather(status);
    bool all_ok = true;
    for (std::size_t r = 0; r < statuses.size(); ++r) {
      if (statuses[r] == "ok") continue;
      all_ok = false;
      if (statuses[r].rfind("error:", 0) == 0) {
        // A caller mistake (unknown tensor, wrong dtype): older steps would not fix it.
        throw CheckpointError(fmt::format("restore from {} failed on rank {}: {}", path.string(),
                                          r, statuses[r].substr(6)));
      }
      result.skipped.push_back(fmt::format("rank {}: {}", r, statuses[r].substr(8)));
    }
    if (all_ok) {
      result.step = step;
      result.path = path;
      result.metadata = std::move(metadata);
      return result;
    }
  }
  return std::nullopt;
}

}  // namespace elastrun::ckpt
