// Helpers of the checkpoint tests that damage, rewrite or inspect committed steps on disk (real
// HDF5 files): byte flips in a shard's data, rewritten manifests, rechunked datasets, and small
// one-tensor saves and restores. Header-only, for tests/ckpt/test_ckpt_*.cpp.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <fstream>
#include <functional>

#include "elastrun/ckpt/async_saver.hpp"
#include "elastrun/ckpt/checkpoint.hpp"
#include "h5.hpp"
#include "internal.hpp"
#include "fault_hook_guard.hpp"
#include "test_support.hpp"

namespace elastrun::ckpt::testing::steps {

namespace fs = std::filesystem;
using ckpt::testing::extract_box;
using ckpt::testing::make_tensor;
using ckpt::testing::run_ranks;
using ckpt::testing::save_world4;
using ckpt::testing::TempDir;
using ckpt::testing::world4_model;
using nlohmann::json;

using ckpt::testing::FaultHookGuard;

// XORs one byte of the stored data of `dataset_name` in `shard` (located through HDF5).
inline void flip_stored_byte(const fs::path& shard, const std::string& dataset_name) {
  haddr_t offset = HADDR_UNDEF;
  {
    h5::Lock lock(h5::library_mutex());
    h5::Handle file = h5::make_file(H5Fopen(shard.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "open");
    h5::Handle dataset = h5::make_dataset(H5Dopen2(file.get(), dataset_name.c_str(), H5P_DEFAULT), "open dataset");
    offset = H5Dget_offset(dataset.get());
  }
  ASSERT_NE(offset, HADDR_UNDEF);
  std::fstream stream(shard, std::ios::in | std::ios::out | std::ios::binary);
  stream.seekg(static_cast<std::streamoff>(offset));
  char byte = 0;
  stream.read(&byte, 1);
  stream.seekp(static_cast<std::streamoff>(offset));
  stream.put(static_cast<char>(byte ^ 0x5a));
  ASSERT_TRUE(stream.good());
}

// The elements of `dataset` as stored (its own type), whatever its layout.
inline std::vector<std::byte> stored_bytes(hid_t dataset, hid_t type) {
  h5::Handle space = h5::make_space(H5Dget_space(dataset), "space");
  std::vector<std::byte> bytes(H5Sget_simple_extent_npoints(space.get()) * H5Tget_size(type));
  h5::check(H5Dread(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()), "read");
  return bytes;
}

// XORs the first byte of `dataset_name` through HDF5 (any layout, e.g. chunked).
inline void flip_stored_byte_chunked(const fs::path& shard, const std::string& dataset_name) {
  h5::Lock lock(h5::library_mutex());
  h5::Handle file = h5::make_file(H5Fopen(shard.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), "open");
  h5::Handle dataset = h5::make_dataset(H5Dopen2(file.get(), dataset_name.c_str(), H5P_DEFAULT), "open dataset");
  h5::Handle type = h5::make_type(H5Dget_type(dataset.get()), "type");
  std::vector<std::byte> bytes = stored_bytes(dataset.get(), type.get());
  bytes[0] ^= std::byte{0x5a};
  h5::check(H5Dwrite(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()), "write");
}

inline SaveOptions quick() {
  SaveOptions options;
  options.fsync = false;
  return options;
}

inline void save_values(const fs::path& root, std::uint64_t step, std::vector<std::int32_t> values,
                        const SaveOptions& options = quick()) {
  SingleProcessCommunicator comm;
  auto view = TensorView::replicated("v", DType::int32, {values.size()}, values.data());
  save_checkpoint(root, step, std::span(&view, 1), {}, comm, options);
}

inline std::optional<std::vector<std::int32_t>> restore_values(const fs::path& root, std::uint64_t* step = nullptr) {
  SingleProcessCommunicator comm;
  std::vector<std::int32_t> out(3, -1);
  auto target = TensorTarget::whole("v", DType::int32, {3}, out.data());
  const auto restored = restore_latest(root, std::span(&target, 1), comm);
  if (!restored) return std::nullopt;
  if (step) *step = restored->step;
  return out;
}

inline void rewrite_manifest_text(const fs::path& step_dir, const std::function<std::string(std::string)>& edit) {
  const fs::path index = step_dir / "index.h5";
  h5::Lock lock(h5::library_mutex());
  h5::Handle file = h5::make_file(H5Fopen(index.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), "open index");
  std::string text;
  {
    h5::Handle dataset =
        h5::make_dataset(H5Dopen2(file.get(), std::string(detail::kManifestDataset).c_str(), H5P_DEFAULT), "open");
    h5::Handle type = h5::make_type(H5Dget_type(dataset.get()), "type");
    text.assign(H5Tget_size(type.get()), '\0');
    h5::check(H5Dread(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, text.data()), "read");
  }
  if (auto nul = text.find('\0'); nul != std::string::npos) text.resize(nul);
  text = edit(std::move(text));
  h5::check(H5Ldelete(file.get(), std::string(detail::kManifestDataset).c_str(), H5P_DEFAULT), "delete manifest");
  h5::Handle type = h5::make_type(H5Tcopy(H5T_C_S1), "string type");
  h5::check(H5Tset_size(type.get(), text.size()), "size");
  h5::Handle space = h5::make_space(H5Screate(H5S_SCALAR), "space");
  h5::Handle dataset = h5::make_dataset(H5Dcreate2(file.get(), std::string(detail::kManifestDataset).c_str(),
                                                   type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                                        "create manifest");
  h5::check(H5Dwrite(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, text.data()), "write manifest");
}

inline void rewrite_manifest(const fs::path& step_dir, const std::function<void(json&)>& edit) {
  rewrite_manifest_text(step_dir, [&](std::string text) {
    json manifest = json::parse(text);
    edit(manifest);
    return manifest.dump();
  });
}

inline json& tensor_entry(json& manifest, const std::string& name) {
  for (auto& t : manifest["tensors"]) {
    if (t["name"] == name) return t;
  }
  throw std::runtime_error("no tensor " + name);
}

// Restores copy and hash contiguous pieces straight from a mapping of the shard file; anything
// else (here: a chunked dataset, as another HDF5 writer could leave) is read through HDF5.
inline void rechunk_dataset(const fs::path& shard, const std::string& name) {
  h5::Lock lock(h5::library_mutex());
  h5::Handle file = h5::make_file(H5Fopen(shard.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), "open shard");
  h5::Handle dataset = h5::make_dataset(H5Dopen2(file.get(), name.c_str(), H5P_DEFAULT), "open dataset");
  h5::Handle type = h5::make_type(H5Dget_type(dataset.get()), "type");
  h5::Handle space = h5::make_space(H5Dget_space(dataset.get()), "space");
  std::vector<hsize_t> dims(static_cast<std::size_t>(H5Sget_simple_extent_ndims(space.get())));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  const std::vector<std::byte> bytes = stored_bytes(dataset.get(), type.get());
  h5::check(H5Lmove(file.get(), name.c_str(), file.get(), (name + ".contiguous").c_str(), H5P_DEFAULT, H5P_DEFAULT),
            "move the contiguous dataset aside");
  h5::Handle dcpl = h5::make_plist(H5Pcreate(H5P_DATASET_CREATE), "dcpl");
  std::vector<hsize_t> chunk = dims;
  chunk[0] = 1;
  h5::check(H5Pset_chunk(dcpl.get(), static_cast<int>(chunk.size()), chunk.data()), "chunk");
  h5::Handle chunked = h5::make_dataset(
      H5Dcreate2(file.get(), name.c_str(), type.get(), space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT), "create");
  h5::check(H5Dwrite(chunked.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()), "write");
}

}  // namespace elastrun::ckpt::testing::steps
