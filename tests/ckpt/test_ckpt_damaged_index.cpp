// Damaged or crafted indexes and manifests: clear errors, a fall back to the previous step, never a
// crash (deep nesting, garbage files, fields of the wrong type).
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

struct BadManifest {
  std::string label;
  std::string tensor;    // expected in the message ("" = none)
  std::string fragment;  // expected in the message
  std::function<void(json&)> edit;
  bool fails_on_open = true;  // else: opens, fails on read
};

TEST(CkptDamagedIndex, CraftedBadIndexesGiveClearErrorsAndFallBack) {
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

TEST(CkptDamagedIndex, DeeplyNestedManifestIsCorruptNotACrash) {
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

TEST(CkptDamagedIndex, GarbageIndexFileIsCorruptNotACrash) {
  TempDir dir;
  save_values(dir.path(), 1, {1, 2, 3});
  {
    std::ofstream garbage(dir.path() / "step-000000001" / "index.h5", std::ios::trunc);
    garbage << "\x89HDF\r\n\x1a\n this is not an HDF5 file";
  }
  EXPECT_THROW(Checkpoint(dir.path() / "step-000000001"), CorruptCheckpointError);
  // the only step is damaged: an error naming it, not a fresh start
  EXPECT_THROW(restore_values(dir.path()), CorruptCheckpointError);
}

}  // namespace
}  // namespace elastrun::ckpt
