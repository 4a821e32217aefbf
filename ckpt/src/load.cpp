// Checkpoint (reader) and restore_latest (collective, with fallback).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <set>
#include <span>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "elastrun/ckpt/checkpoint.hpp"
#include "elastrun/util/unique_fd.hpp"
#include "elastrun/worker/contract.hpp"
#include "h5.hpp"
#include "internal.hpp"
#include "manifest.hpp"
#include "vote.hpp"

namespace elastrun::ckpt {

namespace fs = std::filesystem;
using detail::Box;
using nlohmann::json;

namespace {

// A read-only mapping of a whole shard file. Restores hash and copy contiguous pieces straight
// from it: no pass through a scratch buffer, and no kernel copy into the targets (reads through
// HDF5 are pread()s; under paravirtualised VMs such as this project's test machines the kernel's
// first write into each 4 KiB page of a target costs a hypervisor fault, ~10x the copy). The
// file's size was checked against the manifest before (check_files), so every mapped byte exists.
class FileMapping {
 public:
  // nullopt where the file cannot be mapped (some network filesystems): read through HDF5 then.
  static std::optional<FileMapping> open(const fs::path& path) {
    util::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    struct stat info {};
    if (!fd || ::fstat(fd.get(), &info) != 0 || info.st_size <= 0) return std::nullopt;
    void* data = ::mmap(nullptr, static_cast<std::size_t>(info.st_size), PROT_READ, MAP_SHARED, fd.get(), 0);
    if (data == MAP_FAILED) return std::nullopt;
    return FileMapping(data, static_cast<std::size_t>(info.st_size));
  }
  FileMapping(FileMapping&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  FileMapping& operator=(FileMapping&&) = delete;
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;
  ~FileMapping() {
    if (data_ != nullptr) ::munmap(data_, size_);
  }
  std::span<const std::byte> bytes() const { return {static_cast<const std::byte*>(data_), size_}; }
  // Maps the pages of `piece` in one call (and reads them, if not cached) instead of one fault per
  // few pages while copying; only what this rank reads (a resharding restore reads parts of files).
  // False if the pages cannot be read (an I/O error, which touching them would turn into SIGBUS):
  // the caller reads through HDF5 instead and gets the error as an exception. Kernels before 5.14
  // refuse the advice (EINVAL): the copy then faults the pages in as usual.
  bool populate(std::span<const std::byte> piece) const {
    if (piece.empty()) return true;
    const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
    const auto first = reinterpret_cast<std::uintptr_t>(piece.data()) / page * page;
    const auto end = reinterpret_cast<std::uintptr_t>(piece.data()) + piece.size();
    return ::madvise(reinterpret_cast<void*>(first), end - first, MADV_POPULATE_READ) == 0 || errno == EINVAL;
  }

 private:
  FileMapping(void* data, std::size_t size) : data_(data), size_(size) {}
  void* data_;
  std::size_t size_;
};

}  // namespace

struct Checkpoint::State {
  fs::path path;
  json manifest;
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::size_t> by_name;
  std::map<std::string, h5::Handle> open_shards;               // file name -> handle
  std::set<std::string> verified;                              // piece_key() of pieces whose hash matched
  std::vector<std::byte> scratch;                              // reused for whole-shard reads when verifying
  std::map<std::string, std::optional<FileMapping>> mappings;  // file name -> mapping (nullopt: unmappable)

  ~State() {
    h5::Lock lock(h5::library_mutex());  // H5Fclose of the cached shards
    open_shards.clear();
  }

  hid_t shard(const std::string& file_name) {
    auto it = open_shards.find(file_name);
    if (it != open_shards.end()) return it->second.get();
    const fs::path shard_path = path / file_name;
    h5::Handle fapl = h5::file_access(0, 0, false);
    h5::Handle file =
        h5::make_file(H5Fopen(shard_path.c_str(), H5F_ACC_RDONLY, fapl.get()), "open shard " + shard_path.string());
    return open_shards.emplace(file_name, std::move(file)).first->second.get();
  }

  const FileMapping* mapping(const std::string& file_name) {
    auto it = mappings.find(file_name);
    if (it == mappings.end()) it = mappings.emplace(file_name, FileMapping::open(path / file_name)).first;
    return it->second ? &*it->second : nullptr;
  }
};

namespace {

std::string piece_key(const ShardInfo& shard, const std::string& tensor) {
  return shard.file + '\n' + tensor + '\n' + std::to_string(shard.rank);
}

std::string read_manifest_text(const fs::path& index_path) {
  h5::Handle fapl = h5::file_access(0, 0, false);
  h5::Handle file = h5::make_file(H5Fopen(index_path.c_str(), H5F_ACC_RDONLY, fapl.get()), "open index");
  h5::Handle dataset = h5::make_dataset(
      H5Dopen2(file.get(), std::string(detail::kManifestDataset).c_str(), H5P_DEFAULT), "open manifest");
  h5::Handle type = h5::make_type(H5Dget_type(dataset.get()), "manifest type");
  if (H5Tget_class(type.get()) != H5T_STRING || H5Tis_variable_str(type.get()) != 0) {
    throw CheckpointError("manifest is not a fixed-length string");
  }
  const std::size_t size = H5Tget_size(type.get());
  std::error_code ec;
  const auto file_bytes = fs::file_size(index_path, ec);
  if (size == 0 || ec || size > file_bytes) {
    throw CheckpointError(fmt::format("manifest size {} is inconsistent with the file size", size));
  }
  std::string text(size, '\0');
  h5::check(H5Dread(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, text.data()), "read manifest");
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
    auto parsed = detail::parse_manifest(read_manifest_text(index_path));
    state_->manifest = std::move(parsed.json);
    state_->tensors = std::move(parsed.tensors);
    state_->by_name = std::move(parsed.by_name);
  } catch (const std::exception& e) {
    throw CorruptCheckpointError(
        fmt::format("{}: unreadable checkpoint index ({}); restore will "
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
    throw CheckpointMismatchError(
        fmt::format("{}: no tensor named '{}' in this checkpoint", state_->path.string(), name));
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
      throw CorruptCheckpointError(
          fmt::format("{}: shard file has {} bytes, expected {} "
                      "(truncated or replaced)",
                      file.string(), info.st_size, expected));
    }
  }
}

namespace {

// Opens the dataset holding `shard` and checks that its dataspace contains the piece.
h5::Handle open_piece(hid_t file, const TensorInfo& tensor, const ShardInfo& shard, h5::Handle& file_space) {
  h5::Handle dataset = h5::make_dataset(H5Dopen2(file, tensor.name.c_str(), H5P_DEFAULT), "open dataset");
  {
    h5::Handle stored = h5::make_type(H5Dget_type(dataset.get()), "get dataset type");
    const std::size_t stored_size = H5Tget_size(stored.get());
    if (stored_size != dtype_size(tensor.dtype)) {
      throw CheckpointError(
          fmt::format("dataset elements are {} bytes but the manifest says {} "
                      "({} bytes)",
                      stored_size, dtype_name(tensor.dtype), dtype_size(tensor.dtype)));
    }
  }
  file_space = h5::make_space(H5Dget_space(dataset.get()), "get dataspace");
  const std::size_t ndim = tensor.shape.size();
  const int file_ndim = H5Sget_simple_extent_ndims(file_space.get());
  h5::check(file_ndim, "get dataset rank");
  if (H5Sget_simple_extent_type(file_space.get()) == H5S_NULL) {
    throw CheckpointError("dataset has a null dataspace");
  }
  std::vector<hsize_t> dims(static_cast<std::size_t>(file_ndim));
  h5::check(H5Sget_simple_extent_dims(file_space.get(), dims.data(), nullptr), "get dataset shape");
  bool holds = static_cast<std::size_t>(file_ndim) == ndim;
  for (std::size_t d = 0; holds && d < ndim; ++d) {
    holds = shard.in_file_offset[d] + shard.extent[d] <= dims[d];
  }
  if (!holds) {
    throw CheckpointError(
        fmt::format("dataset shape [{}] does not hold the piece of extent {} "
                    "the manifest records",
                    fmt::join(dims, ", "), detail::shape_string(shard.extent)));
  }
  return dataset;
}

// The bytes of the piece `shard` in `mapping`, when they are one run in C order there: a
// contiguous dataset stored in exactly the library's storage type, the piece spanning whole rows
// (the writers' layouts: a dataset per piece, or a shared dataset split along dimension 0).
// nullopt: read through HDF5 (chunked or compact datasets, other types, partial rows).
std::optional<std::span<const std::byte>> mapped_piece(const FileMapping* mapping, hid_t dataset, hid_t file_space,
                                                       const TensorInfo& tensor, const ShardInfo& shard) {
  if (mapping == nullptr) return std::nullopt;
  {
    h5::Handle dcpl = h5::make_plist(H5Dget_create_plist(dataset), "get dataset creation list");
    if (H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS) return std::nullopt;
    h5::Handle stored = h5::make_type(H5Dget_type(dataset), "get dataset type");
    h5::Handle expected = h5::storage_type(tensor.dtype);
    if (H5Tequal(stored.get(), expected.get()) <= 0) return std::nullopt;
  }
  const haddr_t address = H5Dget_offset(dataset);
  if (address == HADDR_UNDEF) return std::nullopt;
  const std::size_t ndim = tensor.shape.size();
  std::vector<hsize_t> dims(ndim);
  if (ndim > 0) h5::check(H5Sget_simple_extent_dims(file_space, dims.data(), nullptr), "get dataset shape");
  std::uint64_t row_elements = 1;  // elements per index of dimension 0
  for (std::size_t d = 1; d < ndim; ++d) {
    if (shard.in_file_offset[d] != 0 || shard.extent[d] != dims[d]) return std::nullopt;
    row_elements *= dims[d];
  }
  const std::size_t element_size = dtype_size(tensor.dtype);
  const auto elements = detail::checked_element_count(shard.extent);
  const auto first =
      ndim == 0 ? std::optional<std::uint64_t>(0) : detail::checked_mul(shard.in_file_offset[0], row_elements);
  if (!elements || !first) return std::nullopt;
  const auto begin = detail::checked_add(address, *first * element_size);
  const auto length = detail::checked_mul(*elements, element_size);
  const auto bytes = mapping->bytes();
  if (!begin || !length || *begin > bytes.size() || *length > bytes.size() - *begin) return std::nullopt;
  return bytes.subspan(*begin, *length);
}

// Hashes the stored piece `shard` (as the writer did: its bytes in C order): from the file's
// mapping when the piece is one run there, else reading it in chunks of at most kChunk bytes
// through `scratch`.
std::uint64_t hash_stored_piece(hid_t file, const FileMapping* mapping, const TensorInfo& tensor,
                                const ShardInfo& shard, std::vector<std::byte>& scratch) {
  constexpr std::uint64_t kChunk = 16ULL << 20;
  h5::Handle file_space;
  h5::Handle dataset = open_piece(file, tensor, shard, file_space);
  const auto piece = mapped_piece(mapping, dataset.get(), file_space.get(), tensor, shard);
  if (piece && mapping->populate(*piece)) {
    detail::Xxh3Stream stream;
    stream.update(piece->data(), piece->size());
    return stream.digest();
  }
  h5::Handle type = h5::storage_type(tensor.dtype);
  const std::size_t element_size = dtype_size(tensor.dtype);
  detail::Xxh3Stream stream;
  const std::size_t ndim = tensor.shape.size();
  if (ndim == 0) {
    scratch.resize(element_size);
    h5::check(H5Dread(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, scratch.data()), "read scalar");
    stream.update(scratch.data(), element_size);
    return stream.digest();
  }
  std::vector<hsize_t> start(ndim), count(ndim);
  detail::for_each_chunk(
      shard.extent, element_size, kChunk,
      [&](const Shape& chunk_start, const Shape& chunk_count, std::uint64_t, std::uint64_t bytes) {
        for (std::size_t d = 0; d < ndim; ++d) {
          start[d] = shard.in_file_offset[d] + chunk_start[d];
          count[d] = chunk_count[d];
        }
        h5::check(H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
                  "select piece chunk");
        const hsize_t elements = bytes / element_size;
        h5::Handle memory_space = h5::make_space(H5Screate_simple(1, &elements, nullptr), "create chunk dataspace");
        scratch.resize(std::max<std::size_t>(scratch.size(), bytes));
        h5::check(H5Dread(dataset.get(), type.get(), memory_space.get(), file_space.get(), H5P_DEFAULT, scratch.data()),
                  "read piece");
        stream.update(scratch.data(), bytes);
      });
  return stream.digest();
}

}  // namespace

std::vector<std::string> Checkpoint::verify_all() {
  std::vector<std::string> problems;
  // A damaged file is one problem naming the tensors it holds, not one per tensor piece in it.
  std::map<std::string, std::vector<std::string>> tensors_in;
  for (const auto& tensor : state_->tensors)
    for (const auto& shard : tensor.shards) {
      auto& names = tensors_in[shard.file];
      if (names.empty() || names.back() != tensor.name) names.push_back(tensor.name);
    }
  const auto holds = [&](const std::string& file) {
    const auto& names = tensors_in[file];
    if (names.empty()) return std::string("it holds no tensor");
    std::string list;
    for (std::size_t i = 0; i < names.size() && i < 4; ++i) list += fmt::format("{}'{}'", i ? ", " : "", names[i]);
    if (names.size() > 4) list += fmt::format(" and {} more", names.size() - 4);
    return fmt::format("it holds tensor{} {}", names.size() == 1 ? "" : "s", list);
  };
  std::set<std::string> bad_files;
  for (const auto& f : state_->manifest.at("files")) {
    const std::string name = f.at("name").get<std::string>();
    const fs::path file = state_->path / name;
    struct stat info {};
    const auto expected = f.at("bytes").get<std::uint64_t>();
    if (::stat(file.c_str(), &info) != 0) {
      problems.push_back(fmt::format("{}: shard file missing; {}", file.string(), holds(name)));
    } else if (static_cast<std::uint64_t>(info.st_size) != expected) {
      problems.push_back(fmt::format("{}: shard file has {} bytes, expected {} (truncated or replaced); {}",
                                     file.string(), info.st_size, expected, holds(name)));
    } else {
      continue;
    }
    bad_files.insert(name);
  }
  h5::Lock lock(h5::library_mutex());
  for (const auto& tensor : state_->tensors) {
    for (const auto& shard : tensor.shards) {
      if (bad_files.contains(shard.file)) continue;
      const fs::path file = state_->path / shard.file;
      hid_t handle = -1;
      try {
        handle = state_->shard(shard.file);
      } catch (const std::exception& e) {
        problems.push_back(
            fmt::format("{}: unreadable shard file ({}); {}", file.string(), e.what(), holds(shard.file)));
        bad_files.insert(shard.file);
        continue;
      }
      try {
        const std::uint64_t hash =
            hash_stored_piece(handle, state_->mapping(shard.file), tensor, shard, state_->scratch);
        if (hash != shard.xxh3) {
          problems.push_back(fmt::format("{}: tensor '{}' content hash {} != recorded {} (data corrupted)",
                                         file.string(), tensor.name, detail::hex64(hash), detail::hex64(shard.xxh3)));
        } else {
          state_->verified.insert(piece_key(shard, tensor.name));
        }
      } catch (const std::exception& e) {
        problems.push_back(fmt::format("{}: tensor '{}' unreadable: {}", file.string(), tensor.name, e.what()));
      }
    }
  }
  return problems;
}

void Checkpoint::check_read(const TensorTarget& target, const ReadOptions& options) {
  const TensorInfo& tensor = this->tensor(target.name);
  const std::size_t ndim = tensor.shape.size();
  if (target.dtype != tensor.dtype) {
    throw CheckpointMismatchError(
        fmt::format("{}: tensor '{}' is {} but the target is {}; convert after "
                    "loading",
                    state_->path.string(), target.name, dtype_name(tensor.dtype), dtype_name(target.dtype)));
  }
  if (target.offset.size() != ndim || target.extent.size() != ndim) {
    throw CheckpointMismatchError(
        fmt::format("{}: tensor '{}' has shape {} but the target box has {} "
                    "dimensions",
                    state_->path.string(), target.name, detail::shape_string(tensor.shape), target.extent.size()));
  }
  for (std::size_t d = 0; d < ndim; ++d) {
    const auto end = detail::checked_add(target.offset[d], target.extent[d]);
    if (!end || *end > tensor.shape[d]) {
      throw CheckpointMismatchError(
          fmt::format("{}: target box offset {} extent {} is outside tensor "
                      "'{}' of shape {}",
                      state_->path.string(), detail::shape_string(target.offset), detail::shape_string(target.extent),
                      target.name, detail::shape_string(tensor.shape)));
    }
  }
  if (target.bytes() == 0) return;
  if (target.data == nullptr) {
    throw CheckpointError("target for tensor '" + target.name + "' has a null data pointer");
  }
  const Box wanted{target.offset, target.extent};
  h5::Lock lock(h5::library_mutex());
  for (const auto& shard : tensor.shards) {
    if (!detail::intersect(wanted, Box{shard.offset, shard.extent})) continue;
    const fs::path shard_path = state_->path / shard.file;
    const std::string key = piece_key(shard, tensor.name);
    if (state_->verified.contains(key)) continue;
    std::uint64_t hash = 0;
    try {
      const hid_t file = state_->shard(shard.file);
      if (!options.verify) {
        h5::Handle file_space;
        (void)open_piece(file, tensor, shard, file_space);  // structure only
        continue;
      }
      hash = hash_stored_piece(file, state_->mapping(shard.file), tensor, shard, state_->scratch);
    } catch (const std::exception& e) {
      throw CorruptCheckpointError(
          fmt::format("{}: cannot read tensor '{}' ({}); restore will "
                      "use an older step",
                      shard_path.string(), tensor.name, e.what()));
    }
    if (hash != shard.xxh3) {
      throw CorruptCheckpointError(
          fmt::format("{}: tensor '{}' content hash {} != recorded {}; the shard is corrupted, restore "
                      "will use an older step",
                      shard_path.string(), tensor.name, detail::hex64(hash), detail::hex64(shard.xxh3)));
    }
    state_->verified.insert(key);
  }
}

void Checkpoint::read(const TensorTarget& target, const ReadOptions& options) {
  // Everything is checked (and hashed) before the first byte goes to target.data.
  check_read(target, options);
  if (target.bytes() == 0) return;
  const TensorInfo& tensor = this->tensor(target.name);
  const std::size_t ndim = tensor.shape.size();
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
      h5::Handle file_space;
      h5::Handle dataset = open_piece(file, tensor, shard, file_space);
      const FileMapping* mapping = state_->mapping(shard.file);
      const auto piece = mapped_piece(mapping, dataset.get(), file_space.get(), tensor, shard);
      // Only the rows this target reads are populated (pieces are whole rows: see mapped_piece).
      const std::size_t row_bytes = piece && ndim > 0 ? piece->size() / std::max<std::uint64_t>(shard.extent[0], 1) : 0;
      if (piece && mapping->populate(
                       ndim == 0 ? *piece : piece->subspan(in_shard[0] * row_bytes, overlap->extent[0] * row_bytes))) {
        if (ndim == 0) {
          std::memcpy(target.data, piece->data(), piece->size());
        } else {
          detail::copy_box(piece->data(), shard.extent, in_shard, static_cast<std::byte*>(target.data), target.extent,
                           in_target, overlap->extent, dtype_size(tensor.dtype));
        }
        continue;
      }
      h5::Handle type = h5::storage_type(tensor.dtype);
      if (ndim == 0) {
        h5::check(H5Dread(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, target.data), "read scalar");
        continue;
      }
      std::vector<hsize_t> file_start(ndim);
      for (std::size_t d = 0; d < ndim; ++d) file_start[d] = shard.in_file_offset[d] + in_shard[d];
      const std::vector<hsize_t> count(overlap->extent.begin(), overlap->extent.end());
      h5::check(
          H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, file_start.data(), nullptr, count.data(), nullptr),
          "select shard hyperslab");
      h5::Handle memory_space = h5::dataspace(target.extent);
      const std::vector<hsize_t> memory_start(in_target.begin(), in_target.end());
      h5::check(
          H5Sselect_hyperslab(memory_space.get(), H5S_SELECT_SET, memory_start.data(), nullptr, count.data(), nullptr),
          "select target hyperslab");
      h5::check(H5Dread(dataset.get(), type.get(), memory_space.get(), file_space.get(), H5P_DEFAULT, target.data),
                "read hyperslab");
    } catch (const std::exception& e) {
      throw CorruptCheckpointError(
          fmt::format("{}: cannot read tensor '{}' ({}); restore will "
                      "use an older step",
                      shard_path.string(), tensor.name, e.what()));
    }
  }
}

namespace {

using detail::Decision;
using detail::RankVote;

// One rank's outcome of a restore phase: Corrupt and Mismatch mean "try an older step", Error a
// caller mistake.
template <typename Action>
RankVote attempt(const Action& action) {
  try {
    action();
    return RankVote::ok();
  } catch (const CorruptCheckpointError& e) {
    return {RankVote::Outcome::Corrupt, e.what(), nullptr};
  } catch (const CheckpointMismatchError& e) {
    return {RankVote::Outcome::Mismatch, e.what(), nullptr};
  } catch (const nlohmann::json::exception& e) {
    // a manifest field of the wrong type that slipped past the index checks: damage, not a bug
    return {RankVote::Outcome::Corrupt, fmt::format("damaged checkpoint metadata ({})", e.what()), nullptr};
  } catch (const std::exception& e) {
    return RankVote::error(e.what());
  }
}

// "rank 3 (node n4)": where a rank runs, for messages about what that rank saw.
std::string rank_on(std::size_t rank, const std::vector<std::string>& hosts) {
  return rank < hosts.size() && !hosts[rank].empty() ? fmt::format("rank {} (node {})", rank, hosts[rank])
                                                     : fmt::format("rank {}", rank);
}

// Rank 0's decision from every rank's attempt, broadcast to all.
Decision decide(const std::vector<RankVote>& votes, const fs::path& path, const std::vector<std::string>& hosts) {
  Decision decision;
  for (std::size_t r = 0; r < votes.size(); ++r) {
    const auto& v = votes[r];
    switch (v.outcome) {
      case RankVote::Outcome::Ok: continue;
      case RankVote::Outcome::Error:
        // A caller mistake (bad arguments, I/O refused): older steps would not fix it.
        return Decision::fail(fmt::format("restore from {} failed on {}: {}", path.string(), rank_on(r, hosts), v.why));
      case RankVote::Outcome::Corrupt:
        decision.skipped.push_back(fmt::format("{}: {}", rank_on(r, hosts), v.why));
        break;
      case RankVote::Outcome::Mismatch:
        decision.skipped.push_back(fmt::format("{}: {}", rank_on(r, hosts), v.why));
        if (decision.mismatch.empty()) decision.mismatch = fmt::format("{}: {}", rank_on(r, hosts), v.why);
        break;
    }
  }
  if (!decision.skipped.empty()) decision.action = Decision::Action::Skip;
  return decision;
}

// The node's name as the agent says it (Slurm's, as in its logs and events), else the host name.
std::string this_host() {
  if (const char* node = std::getenv(std::string(contract::env::kNode).c_str()); node && *node) return node;
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return {};
  return name;
}

// Rank 0: every rank's listing of `root` -> the steps everyone tries (rank 0's), or an error when
// some rank sees no step at all while another sees some: that rank's `root` is another directory
// (node-local storage, a filesystem not mounted there), and restoring there would start afresh.
// "unseen": steps that some rank does not list (not marked as damaged when they fail there).
json agree_on_listing(const std::vector<std::string>& listings, const fs::path& root, std::vector<std::string>& hosts) {
  std::vector<std::vector<std::uint64_t>> steps;
  std::vector<std::string> unreadable;  // ranks whose listing itself failed
  for (std::size_t r = 0; r < listings.size(); ++r) {
    const json j = json::parse(listings[r]);
    hosts.push_back(j.at("host").get<std::string>());
    steps.push_back(j.at("steps").get<std::vector<std::uint64_t>>());
    if (!j.value("error", std::string()).empty())
      unreadable.push_back(fmt::format("{}: {}", rank_on(r, hosts), j.at("error").get<std::string>()));
  }
  if (!unreadable.empty())
    return {{"steps", json::array()},
            {"unseen", json::array()},
            {"error", fmt::format("cannot list {}: {}", root.string(), fmt::join(unreadable, "; "))}};
  std::set<std::uint64_t> unseen;
  for (const auto& mine : steps)
    for (const auto step : steps[0])
      if (!std::binary_search(mine.begin(), mine.end(), step)) unseen.insert(step);
  std::size_t seeing = steps.size();
  for (std::size_t r = 0; r < steps.size(); ++r)
    if (!steps[r].empty()) seeing = std::min(seeing, r);
  std::vector<std::string> blind;
  for (std::size_t r = 0; r < steps.size() && seeing < steps.size(); ++r)
    if (steps[r].empty()) blind.push_back(rank_on(r, hosts));
  json decision = {
      {"steps", steps.empty() ? std::vector<std::uint64_t>{} : steps[0]}, {"unseen", unseen}, {"error", ""}};
  if (!blind.empty()) {
    const std::size_t named = std::min<std::size_t>(blind.size(), 4);
    std::string who = fmt::format("{}", fmt::join(blind.begin(), blind.begin() + static_cast<long>(named), ", "));
    if (blind.size() > named) who += fmt::format(" and {} more", blind.size() - named);
    decision["error"] = fmt::format(
        "{} see(s) no checkpoint step under {} while {} sees {} step(s) (newest step {}): is {} on a shared "
        "filesystem, mounted on every node? Nothing was restored",
        who, root.string(), rank_on(seeing, hosts), steps[seeing].size(), steps[seeing].back(), root.string());
  }
  return decision;
}

// Rank 0 marks a step it rejected as damaged so that retention keeps it (kRejectedMarker).
void mark_rejected(const fs::path& step_dir, const std::vector<std::string>& why) {
  const fs::path marker = step_dir / kRejectedMarker;
  std::ofstream out(marker, std::ios::trunc);
  out << json{{"time", static_cast<double>(std::time(nullptr))}, {"why", why}}.dump() << "\n";
  // best effort: a read-only or vanished directory keeps its step anyway
}

}  // namespace

std::optional<RestoreResult> restore_latest(const fs::path& root, std::span<const TensorTarget> targets,
                                            Communicator& comm, const RestoreOptions& options) {
  // Everyone tries the same candidates in the same order: rank 0's listing. Every rank's own is
  // gathered too, to refuse a restore where some rank cannot see the checkpoints at all.
  std::vector<std::string> hosts;  // rank 0: every rank's node
  json listing = {{"host", this_host()}, {"steps", json::array()}, {"error", ""}};
  try {  // every rank reaches the gather: a rank that cannot list says so instead of throwing alone
    for (const auto& entry : list_steps(root)) listing["steps"].push_back(entry.step);
  } catch (const std::exception& e) {
    listing["steps"] = json::array();
    listing["error"] = e.what();
  }
  const auto text = [](const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); };
  const std::vector<std::string> listings = comm.gather(text(listing));
  const json agreed =
      json::parse(comm.broadcast(comm.rank() == 0 ? text(agree_on_listing(listings, root, hosts)) : ""));
  if (!agreed.at("error").get<std::string>().empty()) throw CheckpointError(agreed.at("error").get<std::string>());
  std::vector<std::uint64_t> candidates = agreed.at("steps").get<std::vector<std::uint64_t>>();
  const auto unseen = agreed.at("unseen").get<std::set<std::uint64_t>>();
  std::reverse(candidates.begin(), candidates.end());
  if (options.max_attempts > 0 && candidates.size() > static_cast<std::size_t>(options.max_attempts)) {
    candidates.resize(static_cast<std::size_t>(options.max_attempts));
  }
  // Both votes: gather the statuses to rank 0, which broadcasts one decision (O(world)).
  auto vote = [&](const RankVote& mine, const fs::path& path) {
    const std::vector<std::string> attempts = comm.gather(mine.encode());
    return Decision::decode(
        comm.broadcast(comm.rank() == 0 ? decide(detail::decode_votes(attempts), path, hosts).encode() : ""));
  };
  RestoreResult result;
  std::vector<std::string> rejected;  // "step-N: why on which rank" for each step rejected as damaged
  std::string first_mismatch;         // the newest step that did not fit the targets, if any
  bool targets_touched = false;
  std::string last_copy_failure;
  for (const std::uint64_t step : candidates) {
    // Rank 0 may have listed a "replaced" copy as this step (see list_steps).
    fs::path path = step_directory(root, step);
    if (comm.rank() == 0) {
      for (const auto& entry : list_steps(root)) {
        if (entry.step == step) path = entry.path;
      }
    }
    path = comm.broadcast(path.string());
    std::optional<Checkpoint> checkpoint;
    json metadata;
    std::vector<TensorTarget> chosen_targets;  // options.targets_for's boxes for this step
    std::span<const TensorTarget> step_targets = targets;
    // Phase 1: check (and verify) everything this rank will read; the targets are untouched.
    RankVote mine = attempt([&] {
      checkpoint.emplace(path);
      checkpoint->check_files();
      if (options.targets_for) {
        chosen_targets = options.targets_for(*checkpoint);
        step_targets = chosen_targets;
      }
      for (const auto& target : step_targets) checkpoint->check_read(target, ReadOptions{options.verify});
      metadata = checkpoint->metadata();
      if (options.check_metadata) {
        try {
          options.check_metadata(metadata);
        } catch (const std::exception& e) {
          throw CorruptCheckpointError(fmt::format("{}: metadata rejected ({})", path.string(), e.what()));
        }
      }
    });
    Decision decision = vote(mine, path);
    if (decision.action == Decision::Action::Fail) throw CheckpointError(decision.error);
    if (decision.action == Decision::Action::Skip) {
      result.skipped.insert(result.skipped.end(), decision.skipped.begin(), decision.skipped.end());
      if (first_mismatch.empty()) first_mismatch = decision.mismatch;
      if (decision.mismatch.empty()) {  // damage (a misfit is the caller's model, not the step's fault)
        rejected.push_back(fmt::format("{}: {}", path.filename().string(), fmt::join(decision.skipped, "; ")));
        // a step some rank does not even list is a visibility problem there, not damage: no mark
        if (comm.rank() == 0 && !unseen.contains(step)) mark_rejected(path, decision.skipped);
      }
      continue;
    }
    // Phase 2: every rank's data checked out; copy into the targets.
    targets_touched = true;
    mine = attempt([&] {
      for (const auto& target : step_targets) checkpoint->read(target, ReadOptions{false});
    });
    decision = vote(mine, path);
    if (decision.action == Decision::Action::Go) {
      if (comm.rank() == 0) {  // readable after all (the cause was fixed): retention may retire it again
        std::error_code ec;
        fs::remove(path / kRejectedMarker, ec);
      }
      result.step = step;
      result.path = path;
      result.metadata = std::move(metadata);
      return result;
    }
    if (decision.action == Decision::Action::Fail) throw CheckpointError(decision.error);
    for (const auto& s : decision.skipped) {
      result.skipped.push_back(s);
      last_copy_failure = s;
    }
  }
  if (targets_touched) {
    throw CheckpointError(
        fmt::format("restore failed: a step verified but could not be copied ({}) and no older step "
                    "loaded; the targets are partially overwritten",
                    last_copy_failure));
  }
  if (!first_mismatch.empty())
    // steps exist but none fits: most likely the model changed -- never start afresh silently
    throw CheckpointMismatchError(fmt::format(
        "no checkpoint under {} fits these tensors ({}); restore into the model they were saved from, or use "
        "another checkpoint directory",
        root.string(), first_mismatch));
  if (!rejected.empty()) {
    // steps exist but every one tried is damaged: starting afresh would quietly throw the run away
    // (and the next save's retention would delete its history)
    const std::string lines = fmt::format("{}", fmt::join(rejected, "\n  "));
    if (!options.allow_fresh_start)
      throw CorruptCheckpointError(fmt::format(
          "no usable checkpoint under {}: all {} step(s) tried are damaged or unreadable, nothing was restored "
          "(fix or move them aside, or allow a fresh start):\n  {}",
          root.string(), rejected.size(), lines));
    if (comm.rank() == 0)
      fmt::print(stderr,
                 "warning: every checkpoint step under {} is damaged; starting afresh (allow_fresh_start):\n  {}\n",
                 root.string(), lines);
  }
  return std::nullopt;
}

}  // namespace elastrun::ckpt
