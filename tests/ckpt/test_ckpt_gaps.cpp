// Issue #4 review gaps, on real HDF5 files: commit when replacing a step, failures after the
// commit point, restore that never half-writes targets, damaged/crafted manifests, replicated
// tensors that differ between ranks, the O(world) vote collectives.
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

namespace elastrun::ckpt {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::extract_box;
using testing::make_tensor;
using testing::run_ranks;
using testing::save_world4;
using testing::TempDir;
using testing::world4_model;

using testing::FaultHookGuard;

// XORs one byte of the stored data of `dataset_name` in `shard` (located through HDF5).
void flip_stored_byte(const fs::path& shard, const std::string& dataset_name) {
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
std::vector<std::byte> stored_bytes(hid_t dataset, hid_t type) {
  h5::Handle space = h5::make_space(H5Dget_space(dataset), "space");
  std::vector<std::byte> bytes(H5Sget_simple_extent_npoints(space.get()) * H5Tget_size(type));
  h5::check(H5Dread(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()), "read");
  return bytes;
}

// XORs the first byte of `dataset_name` through HDF5 (any layout, e.g. chunked).
void flip_stored_byte_chunked(const fs::path& shard, const std::string& dataset_name) {
  h5::Lock lock(h5::library_mutex());
  h5::Handle file = h5::make_file(H5Fopen(shard.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), "open");
  h5::Handle dataset = h5::make_dataset(H5Dopen2(file.get(), dataset_name.c_str(), H5P_DEFAULT), "open dataset");
  h5::Handle type = h5::make_type(H5Dget_type(dataset.get()), "type");
  std::vector<std::byte> bytes = stored_bytes(dataset.get(), type.get());
  bytes[0] ^= std::byte{0x5a};
  h5::check(H5Dwrite(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()), "write");
}

SaveOptions quick() {
  SaveOptions options;
  options.fsync = false;
  return options;
}

void save_values(const fs::path& root, std::uint64_t step, std::vector<std::int32_t> values,
                 const SaveOptions& options = quick()) {
  SingleProcessCommunicator comm;
  auto view = TensorView::replicated("v", DType::int32, {values.size()}, values.data());
  save_checkpoint(root, step, std::span(&view, 1), {}, comm, options);
}

std::optional<std::vector<std::int32_t>> restore_values(const fs::path& root, std::uint64_t* step = nullptr) {
  SingleProcessCommunicator comm;
  std::vector<std::int32_t> out(3, -1);
  auto target = TensorTarget::whole("v", DType::int32, {3}, out.data());
  const auto restored = restore_latest(root, std::span(&target, 1), comm);
  if (!restored) return std::nullopt;
  if (step) *step = restored->step;
  return out;
}

// ---- item 2: replacing a committed step ----------------------------------------------------

TEST(CkptGapsCommit, FailureAfterTheRenameIsACommittedSaveWithAWarning) {
  TempDir dir;
  save_values(dir.path(), 1, {1, 1, 1});
  // `latest` cannot be replaced by a symlink while it is a non-empty directory: the step is
  // committed all the same, and must be reported as saved (with a warning), not as failed.
  fs::remove(dir.path() / "latest");
  fs::create_directories(dir.path() / "latest" / "blocker");
  SingleProcessCommunicator comm;
  std::vector<std::int32_t> values = {2, 2, 2};
  auto view = TensorView::replicated("v", DType::int32, {3}, values.data());
  SaveResult result;
  ASSERT_NO_THROW(result = save_checkpoint(dir.path(), 2, std::span(&view, 1), {}, comm, quick()));
  ASSERT_EQ(result.warnings.size(), 1U);
  EXPECT_NE(result.warnings[0].find("latest"), std::string::npos) << result.warnings[0];
  std::uint64_t step = 0;
  EXPECT_EQ(restore_values(dir.path(), &step), (std::vector<std::int32_t>{2, 2, 2}));
  EXPECT_EQ(step, 2U);
}

TEST(CkptGapsCommit, ResaveFailureAfterExchangeStillReportsSuccessAndNewData) {
  TempDir dir;
  save_values(dir.path(), 7, {1, 1, 1});
  FaultHookGuard hook([](std::string_view point, int) {
    if (point == "commit.published") throw CheckpointError("injected post-commit failure");
  });
  SingleProcessCommunicator comm;
  std::vector<std::int32_t> values = {2, 2, 2};
  auto view = TensorView::replicated("v", DType::int32, {3}, values.data());
  const SaveResult result = save_checkpoint(dir.path(), 7, std::span(&view, 1), {}, comm, quick());
  ASSERT_EQ(result.warnings.size(), 1U);
  EXPECT_NE(result.warnings[0].find("injected"), std::string::npos);
  EXPECT_EQ(restore_values(dir.path()), values);
  EXPECT_EQ(list_steps(dir.path()).size(), 1U);
  // The replaced copy was removed after the exchange (by the background remover).
  detail::wait_for_background_removals();
  for (const auto& e : fs::directory_iterator(dir.path())) {
    EXPECT_FALSE(detail::is_partial_name(e.path().filename().string())) << e.path();
  }
}

TEST(CkptGapsCommit, FailureBeforeTheRenameKeepsTheOldStep) {
  TempDir dir;
  save_values(dir.path(), 7, {1, 1, 1});
  FaultHookGuard hook([](std::string_view point, int) {
    if (point == "commit.before_publish") throw CheckpointError("injected pre-commit failure");
  });
  EXPECT_THROW(save_values(dir.path(), 7, {2, 2, 2}), CheckpointError);
  EXPECT_EQ(restore_values(dir.path()), (std::vector<std::int32_t>{1, 1, 1}));
}

// A leftover of a crash between the two renames of the non-atomic fallback: only
// step-N.replaced-<gen> exists. It still counts as step N, and the next save restores its name.
TEST(CkptGapsCommit, ReplacedCopyLeftByACrashIsStillTheStep) {
  TempDir dir;
  save_values(dir.path(), 6, {6, 6, 6});
  save_values(dir.path(), 7, {7, 7, 7});
  fs::rename(dir.path() / "step-000000007", dir.path() / "step-000000007.replaced-0123abcd");
  const auto steps = list_steps(dir.path());
  ASSERT_EQ(steps.size(), 2U);
  EXPECT_EQ(steps.back().step, 7U);
  std::uint64_t step = 0;
  EXPECT_EQ(restore_values(dir.path(), &step), (std::vector<std::int32_t>{7, 7, 7}));
  EXPECT_EQ(step, 7U);
  save_values(dir.path(), 8, {8, 8, 8});  // its housekeeping renames the copy back
  EXPECT_TRUE(fs::is_directory(dir.path() / "step-000000007"));
  EXPECT_FALSE(fs::exists(dir.path() / "step-000000007.replaced-0123abcd"));
}

// A child process re-saves step 7 and dies (_exit) at a point of the commit; the parent must
// always find a complete step 7 holding either the old or the new values.
void expect_step7_survives_crash_at(const std::string& point, bool disable_exchange) {
  TempDir dir;
  save_values(dir.path(), 7, {1, 1, 1});
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    detail::set_rename_exchange_disabled(disable_exchange);
    detail::set_fault_hook([&](std::string_view p, int) {
      if (p == point) ::_exit(42);
    });
    try {
      save_values(dir.path(), 7, {2, 2, 2});
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 42) << "crash point " << point << " not reached";
  std::uint64_t step = 0;
  const auto values = restore_values(dir.path(), &step);
  ASSERT_TRUE(values.has_value()) << "step 7 lost after a crash at " << point;
  EXPECT_EQ(step, 7U);
  EXPECT_TRUE(*values == (std::vector<std::int32_t>{1, 1, 1}) || *values == (std::vector<std::int32_t>{2, 2, 2}));
  save_values(dir.path(), 8, {8, 8, 8});
  EXPECT_TRUE(fs::is_directory(dir.path() / "step-000000007")) << point;
}

TEST(CkptGapsCommit, CrashWhileReplacingAStepNeverLosesIt) {
  for (const char* point : {"commit.before_publish", "commit.published"}) {
    expect_step7_survives_crash_at(point, false);
  }
  expect_step7_survives_crash_at("commit.between_renames", true);
}

// ---- item 3: restore never half-writes the targets -------------------------------------------

TEST(CkptGapsRestore, RejectedStepLeavesTargetsUntouched) {
  TempDir dir;
  const auto old_model = world4_model(910);
  const auto new_model = world4_model(920);
  save_world4(dir.path(), 1, old_model);
  save_world4(dir.path(), 2, new_model);
  // Damage the data of the *last* target only (model/ragged, shard of rank 2).
  flip_stored_byte(dir.path() / "step-000000002" / "shard-00002-of-00004.h5", "model/ragged");
  const std::vector<std::string> names = {"model/w", "data/u8", "model/ragged"};
  for (int attempts : {1, 0}) {
    run_ranks(2, [&](int, Communicator& comm) {
      std::vector<std::vector<std::byte>> buffers;
      std::vector<TensorTarget> targets;
      buffers.reserve(names.size());
      for (const auto& name : names) {
        const auto& t =
            *std::find_if(old_model.begin(), old_model.end(), [&](const auto& m) { return m.name == name; });
        buffers.emplace_back(t.bytes.size(), std::byte{0xab});
        targets.push_back(TensorTarget::whole(t.name, t.dtype, t.shape, buffers.back().data()));
      }
      const auto restored = restore_latest(dir.path(), targets, comm, [&] {
        RestoreOptions o;
        o.max_attempts = attempts;
        return o;
      }());
      if (attempts == 1) {
        // Only the damaged step was allowed: nothing restored, and nothing written.
        EXPECT_FALSE(restored.has_value());
        for (std::size_t i = 0; i < names.size(); ++i) {
          EXPECT_TRUE(
              std::all_of(buffers[i].begin(), buffers[i].end(), [](std::byte b) { return b == std::byte{0xab}; }))
              << names[i] << " was written although step 2 was rejected";
        }
      } else {
        ASSERT_TRUE(restored.has_value());
        EXPECT_EQ(restored->step, 1U);
        for (std::size_t i = 0; i < names.size(); ++i) {
          const auto& t =
              *std::find_if(old_model.begin(), old_model.end(), [&](const auto& m) { return m.name == names[i]; });
          EXPECT_EQ(buffers[i], t.bytes) << names[i];
        }
      }
    });
  }
}

TEST(CkptGapsRestore, ReadChecksTheHashBeforeWritingTheTarget) {
  TempDir dir;
  const auto model = world4_model(930);
  save_world4(dir.path(), 1, model);
  flip_stored_byte(dir.path() / "step-000000001" / "shard-00003-of-00004.h5", "model/w");
  Checkpoint checkpoint(dir.path() / "step-000000001");
  std::vector<std::byte> out(10 * 7 * 4, std::byte{0xab});
  EXPECT_THROW(checkpoint.read(TensorTarget::whole("model/w", DType::float32, {10, 7}, out.data())),
               CorruptCheckpointError);
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](std::byte b) { return b == std::byte{0xab}; }));
}

// ---- item 6: damaged or crafted manifests --------------------------------------------------

void rewrite_manifest_text(const fs::path& step_dir, const std::function<std::string(std::string)>& edit) {
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

void rewrite_manifest(const fs::path& step_dir, const std::function<void(json&)>& edit) {
  rewrite_manifest_text(step_dir, [&](std::string text) {
    json manifest = json::parse(text);
    edit(manifest);
    return manifest.dump();
  });
}

json& tensor_entry(json& manifest, const std::string& name) {
  for (auto& t : manifest["tensors"]) {
    if (t["name"] == name) return t;
  }
  throw std::runtime_error("no tensor " + name);
}

// Restores copy and hash contiguous pieces straight from a mapping of the shard file; anything
// else (here: a chunked dataset, as another HDF5 writer could leave) is read through HDF5.
void rechunk_dataset(const fs::path& shard, const std::string& name) {
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

TEST(CkptGapsRestore, ChunkedPiecesAreReadThroughHdf5) {
  TempDir dir;
  const auto model = world4_model(940);
  SaveOptions options;
  options.fsync = false;
  save_world4(dir.path(), 1, model, options);
  const fs::path step = dir.path() / "step-000000001";
  for (int rank = 0; rank < 4; ++rank) rechunk_dataset(step / detail::shard_file_name(rank, 4), "model/w");
  // The files grew: the manifest's sizes are what check_files compares, so record the new ones.
  rewrite_manifest(step, [&](json& manifest) {
    for (auto& f : manifest["files"]) f["bytes"] = fs::file_size(step / f["name"].get<std::string>());
  });
  const testing::GlobalTensor& w = model[0];
  std::vector<std::byte> whole(w.bytes.size());
  {
    Checkpoint checkpoint(step);
    EXPECT_EQ(checkpoint.verify_all(), std::vector<std::string>{});
    checkpoint.read(TensorTarget::whole("model/w", DType::float32, {10, 7}, whole.data()), ReadOptions{true});
    EXPECT_EQ(whole, w.bytes);
    // A box across row shards and columns: [2, 7) x [1, 5).
    std::vector<std::byte> box(5 * 4 * 4);
    checkpoint.read(TensorTarget::box("model/w", DType::float32, {2, 1}, {5, 4}, box.data()), ReadOptions{true});
    EXPECT_EQ(box, extract_box(w.bytes, w.shape, {2, 1}, {5, 4}, 4));
  }  // closes the shard files
  // ... and the hash still guards it: one flipped byte in the chunked copy is caught.
  flip_stored_byte_chunked(step / detail::shard_file_name(0, 4), "model/w");
  Checkpoint damaged(step);
  EXPECT_THROW(damaged.read(TensorTarget::whole("model/w", DType::float32, {10, 7}, whole.data()), ReadOptions{true}),
               CorruptCheckpointError);
}

struct BadManifest {
  std::string label;
  std::string tensor;    // expected in the message ("" = none)
  std::string fragment;  // expected in the message
  std::function<void(json&)> edit;
  bool fails_on_open = true;  // else: opens, fails on read
};

TEST(CkptGapsManifest, CraftedBadIndexesGiveClearErrorsAndFallBack) {
  const std::uint64_t huge = 1ULL << 63;
  const std::vector<BadManifest> cases = {
      {"extent overflows", "model/w", "outside shape",
       [&](json& m) {
         tensor_entry(m, "model/w")["shards"][1]["extent"] = {huge, huge};
       }},
      {"offset out of range", "model/w", "outside shape",
       [](json& m) {
         tensor_entry(m, "model/w")["shards"][3]["offset"] = {8, 3};
       }},
      {"shape element count overflows", "model/emb", "too large",
       [&](json& m) {
         tensor_entry(m, "model/emb")["shape"] = {huge, huge, 4};
       }},
      {"negative extent", "model/col", "non-negative",
       [](json& m) {
         tensor_entry(m, "model/col")["shards"][0]["extent"] = {3, -2};
       }},
      {"wrong number of dimensions", "model/col", "dimensions",
       [](json& m) { tensor_entry(m, "model/col")["shards"][0]["offset"] = {0}; }},
      {"rank outside the world", "model/w", "outside world size",
       [](json& m) { tensor_entry(m, "model/w")["shards"][0]["rank"] = 99; }},
      {"file escapes the step directory", "model/w", "not one of the checkpoint's files",
       [](json& m) { tensor_entry(m, "model/w")["shards"][0]["file"] = "../../etc/passwd"; }},
      {"unknown dtype", "opt/mask", "unknown dtype",
       [](json& m) { tensor_entry(m, "opt/mask")["dtype"] = "complex128"; }},
      {"world size is a string", "", "world_size", [](json& m) { m["world_size"] = "four"; }},
      {"shards do not cover the tensor", "data/u8", "cover",
       [](json& m) { tensor_entry(m, "data/u8")["shards"].erase(0); }},
      {"dtype size disagrees with the dataset", "model/w", "bytes",
       [](json& m) { tensor_entry(m, "model/w")["dtype"] = "float64"; }, false},
  };
  for (const auto& bad : cases) {
    SCOPED_TRACE(bad.label);
    TempDir dir;
    const auto model = world4_model(940);
    save_world4(dir.path(), 1, model);
    save_world4(dir.path(), 2, model);
    const fs::path step2 = dir.path() / "step-000000002";
    rewrite_manifest(step2, bad.edit);
    std::string message;
    try {
      Checkpoint checkpoint(step2);
      ASSERT_FALSE(bad.fails_on_open) << "opened without error";
      for (const auto& t : model) {
        const TensorInfo& info = checkpoint.tensor(t.name);
        std::vector<std::byte> out(info.bytes());
        checkpoint.read(TensorTarget::whole(t.name, info.dtype, info.shape, out.data()));
      }
      ADD_FAILURE() << "read without error";
    } catch (const CorruptCheckpointError& e) {
      message = e.what();
    }
    EXPECT_NE(message.find(bad.fails_on_open ? "index.h5" : "shard-"), std::string::npos) << message;
    if (!bad.tensor.empty()) {
      EXPECT_NE(message.find("'" + bad.tensor + "'"), std::string::npos) << message;
    }
    EXPECT_NE(message.find(bad.fragment), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    // Restore skips the damaged step (a dtype change too: it does not fit the target).
    run_ranks(2, [&](int, Communicator& comm) {
      const auto& w = model[0];
      std::vector<std::byte> out(w.bytes.size());
      auto target = TensorTarget::whole(w.name, w.dtype, w.shape, out.data());
      const auto restored = restore_latest(dir.path(), std::span(&target, 1), comm);
      ASSERT_TRUE(restored.has_value());
      EXPECT_EQ(restored->step, 1U);
      EXPECT_EQ(out, w.bytes);
    });
  }
}

TEST(CkptGapsManifest, DeeplyNestedManifestIsCorruptNotACrash) {
  TempDir dir;
  save_values(dir.path(), 1, {1, 2, 3});
  save_values(dir.path(), 2, {4, 5, 6});
  rewrite_manifest_text(dir.path() / "step-000000002", [](std::string text) {
    const std::string field = "\"metadata\":null";
    const auto at = text.find(field);
    EXPECT_NE(at, std::string::npos) << text;
    return text.replace(at, field.size(),
                        "\"metadata\":{\"deep\":" + std::string(100000, '[') + std::string(100000, ']') + "}");
  });
  try {
    Checkpoint checkpoint(dir.path() / "step-000000002");
    ADD_FAILURE() << "a 100000-deep manifest was accepted";
  } catch (const CorruptCheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("nested deeper than 64"), std::string::npos) << e.what();
  }
  std::uint64_t step = 0;
  EXPECT_EQ(restore_values(dir.path(), &step), (std::vector<std::int32_t>{1, 2, 3}));
  EXPECT_EQ(step, 1U);
  // and a save refuses metadata that readers would refuse
  SingleProcessCommunicator comm;
  json deep = 1;
  for (int i = 0; i < 60; ++i) deep = json::array({deep});
  EXPECT_THROW(save_checkpoint(dir.path(), 3, {}, json{{"deep", deep}}, comm), CheckpointError);
  EXPECT_FALSE(fs::exists(dir.path() / "step-000000003"));
}

TEST(CkptGapsManifest, GarbageIndexFileIsCorruptNotACrash) {
  TempDir dir;
  save_values(dir.path(), 1, {1, 2, 3});
  {
    std::ofstream garbage(dir.path() / "step-000000001" / "index.h5", std::ios::trunc);
    garbage << "\x89HDF\r\n\x1a\n this is not an HDF5 file";
  }
  EXPECT_THROW(Checkpoint(dir.path() / "step-000000001"), CorruptCheckpointError);
  EXPECT_FALSE(restore_values(dir.path()).has_value());
}

// ---- item 5: replicated tensors must be identical on every rank ------------------------------

void expect_replica_mismatch(const Shape& shape, ReplicaCheck mode, std::size_t differing_byte, bool async) {
  TempDir dir;
  const auto good = make_tensor(77, DType::uint8, shape);
  save_values(dir.path(), 1, {1, 2, 3});
  std::atomic<int> failures = 0;
  run_ranks(3, [&](int rank, Communicator& comm) {
    auto mine = good;
    if (rank == 2) mine[differing_byte] ^= std::byte{1};
    auto view = TensorView::replicated("r", DType::uint8, shape, mine.data());
    SaveOptions options = quick();
    options.check_replicas = mode;
    try {
      if (async) {
        AsyncSaver saver(dir.path(), comm, options);
        saver.save(2, std::span(&view, 1), {});
        saver.wait();
      } else {
        save_checkpoint(dir.path(), 2, std::span(&view, 1), {}, comm, options);
      }
    } catch (const CheckpointError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("replicated tensor 'r'"), std::string::npos) << message;
      EXPECT_NE(message.find("rank(s) 2"), std::string::npos) << message;
      ++failures;
    }
  });
  EXPECT_EQ(failures.load(), 3);
  ASSERT_EQ(list_steps(dir.path()).size(), 1U);
  EXPECT_EQ(list_steps(dir.path())[0].step, 1U);
}

TEST(CkptGapsReplicas, RanksHoldingDifferentReplicatedValuesFailTheSave) {
  expect_replica_mismatch({40, 25}, ReplicaCheck::sampled, 777, false);       // small: all bytes
  expect_replica_mismatch({40, 25}, ReplicaCheck::sampled, 777, true);        // AsyncSaver
  expect_replica_mismatch({3, 1 << 20}, ReplicaCheck::full, 1234567, false);  // 3 MiB, full hash
  expect_replica_mismatch({3, 1 << 20}, ReplicaCheck::sampled, 0, false);     // first sample
}

TEST(CkptGapsReplicas, IdenticalReplicasAndCheckOffSave) {
  TempDir dir;
  const auto good = make_tensor(78, DType::uint8, {3, 1 << 20});
  run_ranks(3, [&](int rank, Communicator& comm) {
    auto mine = good;
    auto view = TensorView::replicated("r", DType::uint8, {3, 1 << 20}, mine.data());
    EXPECT_NO_THROW(save_checkpoint(dir.path(), 1, std::span(&view, 1), {}, comm, quick()));
    if (rank == 1) mine[5] ^= std::byte{1};
    SaveOptions off = quick();
    off.check_replicas = ReplicaCheck::off;
    EXPECT_NO_THROW(save_checkpoint(dir.path(), 2, std::span(&view, 1), {}, comm, off));
  });
}

// ---- item 8: pieces larger than the write/hash chunk are written and hashed in runs --------

TEST(CkptGapsChunks, LargePiecesRoundTripAndVerify) {
  TempDir dir;
  // 8.4 MB split along dim 0; 12 MB whose single dim-0 row must be split further; a sharded
  // piece of a 3-D tensor.
  const std::vector<std::pair<std::string, Shape>> specs = {
      {"a", {3, 700, 1000}}, {"b", {1, 2, 1500000}}, {"c", {5, 3, 400000}}};
  std::vector<std::vector<std::byte>> data;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    data.push_back(make_tensor(990 + i, DType::float32, specs[i].second));
  }
  run_ranks(2, [&](int rank, Communicator& comm) {
    std::vector<TensorView> views;
    views.push_back(TensorView::replicated("a", DType::float32, specs[0].second, data[0].data()));
    views.push_back(TensorView::replicated("b", DType::float32, specs[1].second, data[1].data()));
    // c: rank 0 owns rows [0, 2), rank 1 rows [2, 5).
    const std::uint64_t begin = rank == 0 ? 0 : 2;
    const std::uint64_t rows = rank == 0 ? 2 : 3;
    static thread_local std::vector<std::byte> slice;
    slice = extract_box(data[2], specs[2].second, {begin, 0, 0}, {rows, 3, 400000}, 4);
    views.push_back(
        TensorView::sharded("c", DType::float32, specs[2].second, {begin, 0, 0}, {rows, 3, 400000}, slice.data()));
    save_checkpoint(dir.path(), 1, views, {}, comm, quick());
  });
  Checkpoint checkpoint(dir.path() / "step-000000001");
  EXPECT_TRUE(checkpoint.verify_all().empty());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    Checkpoint fresh(dir.path() / "step-000000001");
    std::vector<std::byte> out(data[i].size());
    fresh.read(TensorTarget::whole(specs[i].first, DType::float32, specs[i].second, out.data()));
    EXPECT_EQ(out, data[i]) << specs[i].first;
  }
}

// ---- item 4: gather / broadcast ------------------------------------------------------------

TEST(CkptGapsComm, GatherAndBroadcastDefaults) {
  run_ranks(4, [&](int rank, Communicator& comm) {
    const auto gathered = comm.gather(std::to_string(rank * 10));
    if (rank == 0) {
      EXPECT_EQ(gathered, (std::vector<std::string>{"0", "10", "20", "30"}));
    } else {
      EXPECT_TRUE(gathered.empty());
    }
    EXPECT_EQ(comm.broadcast(rank == 0 ? "from zero" : "ignored"), "from zero");
  });
}

}  // namespace
}  // namespace elastrun::ckpt
