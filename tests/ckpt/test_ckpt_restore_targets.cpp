// Restores never half-write their targets: a rejected step leaves them untouched, every read checks
// the hash before it writes, and chunked pieces are read through HDF5.
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
#include "step_fixtures.hpp"
#include "test_support.hpp"

namespace elastrun::ckpt {
namespace {

using namespace testing::steps;  // NOLINT(google-build-using-namespace): the helpers of these tests

TEST(CkptRestoreTargets, RejectedStepLeavesTargetsUntouched) {
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
      RestoreOptions options;
      options.max_attempts = attempts;
      std::optional<RestoreResult> restored;
      if (attempts == 1) {
        // Only the damaged step was allowed: an error (never a fresh start), and nothing written.
        EXPECT_THROW(restored = restore_latest(dir.path(), targets, comm, options), CorruptCheckpointError);
      } else {
        restored = restore_latest(dir.path(), targets, comm, options);
      }
      if (attempts == 1) {
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

TEST(CkptRestoreTargets, ReadChecksTheHashBeforeWritingTheTarget) {
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

TEST(CkptRestoreTargets, ChunkedPiecesAreReadThroughHdf5) {
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

}  // namespace
}  // namespace elastrun::ckpt
