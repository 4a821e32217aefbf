// Core checkpoint tests on real HDF5 files: dtypes, shapes, resharding, commit, fallback.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <map>

#include "elastrun/ckpt/checkpoint.hpp"
#include "h5.hpp"
#include "internal.hpp"
#include "step_fixtures.hpp"
#include "test_support.hpp"

namespace elastrun::ckpt {
namespace {

namespace fs = std::filesystem;
using testing::extract_box;
using testing::GlobalTensor;
using testing::make_tensor;
using testing::run_ranks;
using testing::save_world4;
using testing::split;
using testing::TempDir;
using testing::world4_model;

TEST(CkptDType, NamesRoundTripAndSizes) {
  for (DType d : {DType::float16, DType::bfloat16, DType::float32, DType::float64, DType::int8, DType::int16,
                  DType::int32, DType::int64, DType::uint8, DType::boolean}) {
    EXPECT_EQ(dtype_from_name(dtype_name(d)), d);
  }
  EXPECT_EQ(dtype_size(DType::bfloat16), 2U);
  EXPECT_EQ(dtype_size(DType::float64), 8U);
  EXPECT_EQ(dtype_size(DType::boolean), 1U);
  EXPECT_THROW(dtype_from_name("complex64"), std::invalid_argument);
}

TEST(CkptDetail, CopyBoxMatchesNaiveExtraction) {
  const Shape shape = {4, 5, 6};
  const auto global = make_tensor(7, DType::int16, shape);
  const Shape offset = {1, 2, 0};
  const Shape extent = {2, 3, 6};
  std::vector<std::byte> out(element_count(extent) * 2);
  detail::copy_box(global.data(), shape, offset, out.data(), extent, {0, 0, 0}, extent, 2);
  EXPECT_EQ(out, extract_box(global, shape, offset, extent, 2));
  // Into the middle of a larger destination.
  const Shape dst_shape = {3, 4, 7};
  std::vector<std::byte> dst(element_count(dst_shape) * 2, std::byte{0});
  detail::copy_box(global.data(), shape, {0, 1, 1}, dst.data(), dst_shape, {1, 1, 2}, {2, 2, 4}, 2);
  const auto back = extract_box(dst, dst_shape, {1, 1, 2}, {2, 2, 4}, 2);
  EXPECT_EQ(back, extract_box(global, shape, {0, 1, 1}, {2, 2, 4}, 2));
}

TEST(CkptDetail, ReplicatedPiecesTileTheTensor) {
  for (const Shape& shape : {Shape{10, 3}, Shape{2, 9, 4}, Shape{3}, Shape{2, 2}}) {
    for (int world : {1, 3, 4, 6}) {
      std::uint64_t covered = 0;
      for (int r = 0; r < world; ++r) {
        if (auto piece = detail::replicated_piece(shape, r, world)) {
          covered += element_count(piece->extent);
        }
      }
      EXPECT_EQ(covered, element_count(shape)) << detail::shape_string(shape) << " world " << world;
    }
  }
  EXPECT_TRUE(detail::replicated_piece({}, 0, 4).has_value());
  EXPECT_FALSE(detail::replicated_piece({}, 1, 4).has_value());
  EXPECT_FALSE(detail::replicated_piece({0, 3}, 0, 4).has_value());
}

TEST(CkptDetail, StepNames) {
  EXPECT_EQ(detail::step_name(1200), "step-000001200");
  EXPECT_EQ(detail::parse_step_name("step-000001200"), 1200U);
  EXPECT_FALSE(detail::parse_step_name("step-000001200.tmp-abc"));
  EXPECT_FALSE(detail::parse_step_name("latest"));
  EXPECT_TRUE(detail::is_partial_name("step-000001200.tmp-abc"));
  EXPECT_FALSE(detail::is_partial_name("step-000001200"));
  EXPECT_FALSE(detail::invalid_name_reason("model/layer1.weight").size());
  EXPECT_TRUE(detail::invalid_name_reason("model//w").size());
  EXPECT_TRUE(detail::invalid_name_reason("_elastrun/x").size());
  EXPECT_TRUE(detail::invalid_name_reason("/abs").size());
}

// Every dtype and a range of shapes including 0-d and empty, world 1.
TEST(CkptRoundTrip, EveryDTypeAndShape) {
  TempDir dir;
  const std::vector<DType> dtypes = {DType::float16, DType::bfloat16, DType::float32, DType::float64, DType::int8,
                                     DType::int16,   DType::int32,    DType::int64,   DType::uint8,   DType::boolean};
  const std::vector<Shape> shapes = {{}, {0}, {1}, {7}, {3, 0, 2}, {4, 5}, {2, 3, 4, 5}};
  std::map<std::string, std::pair<DType, Shape>> specs;
  std::map<std::string, std::vector<std::byte>> data;
  std::vector<TensorView> views;
  std::uint64_t seed = 1;
  for (DType dtype : dtypes) {
    for (std::size_t s = 0; s < shapes.size(); ++s) {
      const std::string name = fmt::format("t/{}/s{}", dtype_name(dtype), s);
      specs[name] = {dtype, shapes[s]};
      data[name] = make_tensor(seed++, dtype, shapes[s]);
    }
  }
  for (auto& [name, spec] : specs) {
    views.push_back(TensorView::replicated(name, spec.first, spec.second, data[name].data()));
  }
  SingleProcessCommunicator comm;
  const nlohmann::json metadata = {{"epoch", 3}, {"data_position", 12345}};
  const SaveResult saved = save_checkpoint(dir.path(), 5, views, metadata, comm);
  EXPECT_EQ(saved.path, dir.path() / "step-000000005");
  EXPECT_TRUE(fs::is_symlink(dir.path() / "latest"));
  EXPECT_EQ(fs::read_symlink(dir.path() / "latest"), "step-000000005");

  Checkpoint checkpoint(saved.path);
  EXPECT_EQ(checkpoint.step(), 5U);
  EXPECT_EQ(checkpoint.world_size(), 1);
  EXPECT_EQ(checkpoint.metadata().at("epoch"), 3);
  EXPECT_EQ(checkpoint.tensors().size(), specs.size());
  EXPECT_TRUE(checkpoint.verify_all().empty());
  for (auto& [name, spec] : specs) {
    const TensorInfo& info = checkpoint.tensor(name);
    EXPECT_EQ(info.dtype, spec.first) << name;
    EXPECT_EQ(info.shape, spec.second) << name;
    for (bool verify : {true, false}) {
      Checkpoint fresh(saved.path);  // verification state is per object
      std::vector<std::byte> out(data[name].size(), std::byte{0x5a});
      fresh.read(TensorTarget::whole(name, spec.first, spec.second, out.data()), ReadOptions{verify});
      EXPECT_EQ(out, data[name]) << name << " verify=" << verify;
    }
  }
}

// Restores the world-4 checkpoint with `world` ranks, each asking for a dim-0 split of every
// tensor (rank's rows) and compares bit-exactly against the global tensors.
void expect_restore_with_world(const fs::path& root, const std::vector<GlobalTensor>& model, int world,
                               std::uint64_t expected_step) {
  run_ranks(world, [&](int rank, Communicator& comm) {
    std::vector<std::vector<std::byte>> buffers;
    std::vector<TensorTarget> targets;
    std::vector<std::vector<std::byte>> expected;
    buffers.reserve(model.size());
    for (const auto& t : model) {
      Shape offset(t.shape.size(), 0);
      Shape extent = t.shape;
      if (!t.shape.empty()) {
        const auto [begin, length] = split(t.shape[0], world, rank);
        offset[0] = begin;
        extent[0] = length;
      }
      expected.push_back(extract_box(t.bytes, t.shape, offset, extent, dtype_size(t.dtype)));
      buffers.emplace_back(expected.back().size(), std::byte{0xee});
      targets.push_back(TensorTarget::box(t.name, t.dtype, offset, extent, buffers.back().data()));
    }
    const auto restored = restore_latest(root, targets, comm);
    ASSERT_TRUE(restored.has_value());
    EXPECT_EQ(restored->step, expected_step);
    EXPECT_EQ(restored->metadata.at("step_meta"), expected_step);
    for (std::size_t i = 0; i < model.size(); ++i) {
      EXPECT_EQ(buffers[i], expected[i]) << model[i].name << " world " << world << " rank " << rank;
    }
  });
}

TEST(CkptReshard, World4ToWorlds3And6And1BitExact) {
  TempDir dir;
  const auto model = world4_model(100);
  save_world4(dir.path(), 1200, model);
  Checkpoint checkpoint(dir.path() / "step-000001200");
  EXPECT_EQ(checkpoint.world_size(), 4);
  EXPECT_EQ(checkpoint.tensor("model/w").shards.size(), 4U);
  EXPECT_EQ(checkpoint.tensor("model/ragged").shards.size(), 3U);
  EXPECT_EQ(checkpoint.tensor("opt/empty").shards.size(), 0U);
  EXPECT_EQ(checkpoint.tensor("opt/step").shards.size(), 1U);
  EXPECT_EQ(checkpoint.tensor("data/u8").shards.size(), 4U);  // split along dim 1 (5 >= 4)
  EXPECT_TRUE(checkpoint.verify_all().empty());
  for (int world : {3, 6, 1}) expect_restore_with_world(dir.path(), model, world, 1200);
}

TEST(CkptReshard, ArbitraryBoxesWithoutVerification) {
  TempDir dir;
  const auto model = world4_model(300);
  save_world4(dir.path(), 3, model);
  Checkpoint checkpoint(dir.path() / "step-000000003");
  const auto& w = model[0];
  // A box straddling all four shards of the 2x2 grid, read through HDF5 hyperslabs.
  const Shape offset = {3, 2};
  const Shape extent = {5, 4};
  std::vector<std::byte> out(element_count(extent) * 4);
  checkpoint.read(TensorTarget::box(w.name, w.dtype, offset, extent, out.data()), ReadOptions{false});
  EXPECT_EQ(out, extract_box(w.bytes, w.shape, offset, extent, 4));
}

TEST(CkptReshard, ReadsTouchOnlyOverlappingShards) {
  TempDir dir;
  const auto model = world4_model(400);
  save_world4(dir.path(), 4, model);
  const fs::path step = dir.path() / "step-000000004";
  // model/w is a 2x2 grid: rows [0,5) live in shards 0 and 1 only. Without shards 2 and 3 a
  // box inside rows [0,5) still reads (verified or not); one reaching row 5 must fail.
  fs::remove(step / "shard-00002-of-00004.h5");
  fs::remove(step / "shard-00003-of-00004.h5");
  const auto& w = model[0];
  for (bool verify : {true, false}) {
    Checkpoint checkpoint(step);
    std::vector<std::byte> top(5 * 7 * 4);
    checkpoint.read(TensorTarget::box(w.name, w.dtype, {0, 0}, {5, 7}, top.data()), ReadOptions{verify});
    EXPECT_EQ(top, extract_box(w.bytes, w.shape, {0, 0}, {5, 7}, 4));
    std::vector<std::byte> reaching(6 * 7 * 4);
    EXPECT_THROW(
        checkpoint.read(TensorTarget::box(w.name, w.dtype, {0, 0}, {6, 7}, reaching.data()), ReadOptions{verify}),
        CorruptCheckpointError);
  }
}

TEST(CkptSave, InconsistentRanksFailEverywhereAndKeepPrevious) {
  TempDir dir;
  const auto model = world4_model(1);
  save_world4(dir.path(), 10, model);
  std::vector<float> values(8, 1.0F);
  std::atomic<int> failures = 0;
  run_ranks(4, [&](int rank, Communicator& comm) {
    // Rank 2 declares a different global shape: rank 0's merge must reject the step.
    const Shape shape = rank == 2 ? Shape{9} : Shape{8};
    const auto [b, n] = split(8, 4, rank);
    auto view = TensorView::sharded("x", DType::float32, shape, {b}, {n}, values.data() + b);
    try {
      save_checkpoint(dir.path(), 11, std::span(&view, 1), {}, comm);
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("'x'"), std::string::npos) << e.what();
      ++failures;
    }
  });
  EXPECT_EQ(failures.load(), 4);
  const auto steps = list_steps(dir.path());
  ASSERT_EQ(steps.size(), 1U);
  EXPECT_EQ(steps[0].step, 10U);
  EXPECT_EQ(fs::read_symlink(dir.path() / "latest"), "step-000000010");
}

TEST(CkptSave, InvalidSliceFailsAllRanks) {
  TempDir dir;
  std::vector<float> values(4, 0.0F);
  std::atomic<int> failures = 0;
  run_ranks(2, [&](int rank, Communicator& comm) {
    const Shape extent = rank == 1 ? Shape{5} : Shape{2};  // rank 1 runs past the end
    auto view = TensorView::sharded("x", DType::float32, {4}, {rank * 2ULL}, extent, values.data());
    try {
      save_checkpoint(dir.path(), 1, std::span(&view, 1), {}, comm);
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
      ++failures;
    }
  });
  EXPECT_EQ(failures.load(), 2);
  EXPECT_TRUE(list_steps(dir.path()).empty());
}

TEST(CkptCommit, RetentionKeepsLastKAndEveryM) {
  TempDir dir;
  SingleProcessCommunicator comm;
  std::vector<std::int32_t> values = {1, 2, 3};
  SaveOptions options;
  options.fsync = false;
  options.keep_last = 2;
  options.keep_every = 4;
  for (std::uint64_t step = 1; step <= 9; ++step) {
    values[0] = static_cast<std::int32_t>(step);
    auto view = TensorView::replicated("v", DType::int32, {3}, values.data());
    save_checkpoint(dir.path(), step, std::span(&view, 1), {}, comm, options);
  }
  std::vector<std::uint64_t> steps;
  for (const auto& e : list_steps(dir.path())) steps.push_back(e.step);
  EXPECT_EQ(steps, (std::vector<std::uint64_t>{4, 8, 9}));
  // A leftover temporary directory is ignored by listing and removed by the next save.
  fs::create_directories(dir.path() / "step-000000010.tmp-deadbeef");
  EXPECT_EQ(list_steps(dir.path()).back().step, 9U);
  auto view = TensorView::replicated("v", DType::int32, {3}, values.data());
  save_checkpoint(dir.path(), 10, std::span(&view, 1), {}, comm, options);
  EXPECT_FALSE(fs::exists(dir.path() / "step-000000010.tmp-deadbeef"));
  EXPECT_EQ(fs::read_symlink(dir.path() / "latest"), "step-000000010");
}

TEST(CkptCommit, SavingAnOlderStepKeepsItAndSetsNewerStepsAside) {
  // Training resumed from step 2 (say 3 was bad) and saves step 2 again with keep_last=1:
  // the new step must survive retention, and the abandoned step 3 must not win a restore.
  TempDir dir;
  SingleProcessCommunicator comm;
  std::vector<std::int32_t> values = {1, 2, 3};
  SaveOptions options;
  options.fsync = false;
  auto view = TensorView::replicated("v", DType::int32, {3}, values.data());
  for (std::uint64_t step = 1; step <= 3; ++step)
    save_checkpoint(dir.path(), step, std::span(&view, 1), {}, comm, options);
  options.keep_last = 1;
  values = {7, 7, 7};
  save_checkpoint(dir.path(), 2, std::span(&view, 1), {}, comm, options);
  std::vector<std::uint64_t> steps;
  for (const auto& e : list_steps(dir.path())) steps.push_back(e.step);
  EXPECT_EQ(steps, (std::vector<std::uint64_t>{2}));
  bool set_aside = false;
  for (const auto& e : fs::directory_iterator(dir.path()))
    set_aside = set_aside || e.path().filename().string().starts_with("abandoned-step-000000003-");
  EXPECT_TRUE(set_aside) << "step 3 was deleted instead of set aside";
  std::vector<std::int32_t> out(3);
  auto target = TensorTarget::whole("v", DType::int32, {3}, out.data());
  auto restored = restore_latest(dir.path(), std::span(&target, 1), comm);
  ASSERT_TRUE(restored);
  EXPECT_EQ(restored->step, 2U);
  EXPECT_EQ(out, values);
}

TEST(CkptCommit, ResavingAStepReplacesIt) {
  TempDir dir;
  SingleProcessCommunicator comm;
  std::vector<std::int32_t> values = {1, 2, 3};
  auto view = TensorView::replicated("v", DType::int32, {3}, values.data());
  save_checkpoint(dir.path(), 7, std::span(&view, 1), {}, comm);
  values = {4, 5, 6};
  save_checkpoint(dir.path(), 7, std::span(&view, 1), {}, comm);
  std::vector<std::int32_t> out(3);
  auto target = TensorTarget::whole("v", DType::int32, {3}, out.data());
  auto restored = restore_latest(dir.path(), std::span(&target, 1), comm);
  ASSERT_TRUE(restored);
  EXPECT_EQ(out, values);
  EXPECT_EQ(list_steps(dir.path()).size(), 1U);
}

TEST(CkptSave, AlignmentPlacesLargeDatasetsOnStripeBoundaries) {
  TempDir dir;
  SingleProcessCommunicator comm;
  const auto big = make_tensor(1, DType::float32, {300, 100});  // 120 kB: aligned
  const auto small = make_tensor(2, DType::float32, {10});      // below the threshold
  const std::vector<TensorView> views = {TensorView::replicated("a/small", DType::float32, {10}, small.data()),
                                         TensorView::replicated("a/big", DType::float32, {300, 100}, big.data())};
  SaveOptions options;
  options.alignment = 1 << 20;
  options.alignment_threshold = 64 * 1024;
  save_checkpoint(dir.path(), 1, views, {}, comm, options);
  const fs::path shard = dir.path() / "step-000000001" / "shard-00000-of-00001.h5";
  h5::Lock lock(h5::library_mutex());
  h5::Handle file = h5::make_file(H5Fopen(shard.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "open");
  h5::Handle dataset = h5::make_dataset(H5Dopen2(file.get(), "a/big", H5P_DEFAULT), "open");
  const haddr_t offset = H5Dget_offset(dataset.get());
  ASSERT_NE(offset, HADDR_UNDEF);
  EXPECT_EQ(offset % (1 << 20), 0U);
  h5::Handle dcpl = h5::make_plist(H5Dget_create_plist(dataset.get()), "dcpl");
  EXPECT_EQ(H5Pget_layout(dcpl.get()), H5D_CONTIGUOUS);
  H5D_fill_time_t fill_time{};
  ASSERT_GE(H5Pget_fill_time(dcpl.get(), &fill_time), 0);
  EXPECT_EQ(fill_time, H5D_FILL_TIME_NEVER);
}

TEST(CkptVerify, CorruptShardDetectedAndRestoreFallsBack) {
  TempDir dir;
  const auto old_model = world4_model(500);
  const auto new_model = world4_model(600);
  save_world4(dir.path(), 100, old_model);
  save_world4(dir.path(), 200, new_model);
  const fs::path bad_shard = dir.path() / "step-000000200" / "shard-00001-of-00004.h5";
  testing::steps::flip_stored_byte(bad_shard, "model/w");

  Checkpoint damaged(dir.path() / "step-000000200");
  const auto problems = damaged.verify_all();
  ASSERT_EQ(problems.size(), 1U);
  EXPECT_NE(problems[0].find("shard-00001-of-00004.h5"), std::string::npos) << problems[0];
  EXPECT_NE(problems[0].find("model/w"), std::string::npos) << problems[0];

  // Reading with verification names file and tensor; the fast path does not hash.
  Checkpoint again(dir.path() / "step-000000200");
  std::vector<std::byte> out(10 * 7 * 4);
  auto whole_w = TensorTarget::whole("model/w", DType::float32, {10, 7}, out.data());
  try {
    again.read(whole_w);
    ADD_FAILURE() << "corruption not detected";
  } catch (const CorruptCheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("shard-00001-of-00004.h5"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("model/w"), std::string::npos);
  }
  EXPECT_NO_THROW(again.read(whole_w, ReadOptions{false}));

  run_ranks(3, [&](int, Communicator& comm) {
    std::vector<std::byte> buffer(10 * 7 * 4);
    auto target = TensorTarget::whole("model/w", DType::float32, {10, 7}, buffer.data());
    const auto restored = restore_latest(dir.path(), std::span(&target, 1), comm);
    ASSERT_TRUE(restored);
    EXPECT_EQ(restored->step, 100U);
    EXPECT_EQ(buffer, old_model[0].bytes);
    ASSERT_FALSE(restored->skipped.empty());
    EXPECT_NE(restored->skipped[0].find("model/w"), std::string::npos);
  });
}

TEST(CkptVerify, TruncatedAndMissingShardsFallBack) {
  TempDir dir;
  const auto model = world4_model(700);
  save_world4(dir.path(), 1, model);
  save_world4(dir.path(), 2, model);
  save_world4(dir.path(), 3, model);
  const fs::path truncated = dir.path() / "step-000000003" / "shard-00002-of-00004.h5";
  fs::resize_file(truncated, fs::file_size(truncated) / 2);
  fs::remove(dir.path() / "step-000000002" / "shard-00000-of-00004.h5");

  Checkpoint step3(dir.path() / "step-000000003");
  try {
    step3.check_files();
    ADD_FAILURE() << "truncation not detected";
  } catch (const CorruptCheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("shard-00002-of-00004.h5"), std::string::npos);
  }
  EXPECT_FALSE(step3.verify_all().empty());
  expect_restore_with_world(dir.path(), model, 2, 1);
  // A step whose index is gone is skipped too.
  fs::remove(dir.path() / "step-000000001" / "index.h5");
  EXPECT_THROW(Checkpoint(dir.path() / "step-000000001"), CorruptCheckpointError);
  // Every step damaged: an error naming each one, never a silent fresh start...
  run_ranks(2, [&](int, Communicator& comm) {
    try {
      restore_latest(dir.path(), {}, comm);
      ADD_FAILURE() << "every step damaged, and restore started afresh";
    } catch (const CorruptCheckpointError& e) {
      const std::string what = e.what();
      for (const char* step : {"step-000000003: rank", "step-000000002: rank", "step-000000001: rank"})
        EXPECT_NE(what.find(step), std::string::npos) << step << " in " << what;
      EXPECT_NE(what.find("all 3 step(s) tried are damaged"), std::string::npos) << what;
      EXPECT_NE(what.find("(node "), std::string::npos) << what;
    }
  });
  // ...unless asked for; and retention keeps what a restore could not read (marked).
  RestoreOptions fresh;
  fresh.allow_fresh_start = true;
  run_ranks(2, [&](int, Communicator& comm) { EXPECT_FALSE(restore_latest(dir.path(), {}, comm, fresh)); });
  for (const char* step : {"step-000000001", "step-000000002", "step-000000003"})
    EXPECT_TRUE(fs::exists(dir.path() / step / kRejectedMarker)) << step;
  save_world4(dir.path(), 4, model);
  apply_retention(dir.path(), 4, 1, 0);
  EXPECT_EQ(list_steps(dir.path()).size(), 4U) << "retention removed a step a restore had rejected";
}

// A rank whose checkpoint directory is another one (node-local storage) sees no steps: restoring
// would start that rank afresh while the others resume. An error names the rank and its node.
TEST(CkptRestore, ARankThatSeesNoStepWhileOthersDoIsAnError) {
  TempDir shared, local;
  const auto model = world4_model(750);
  save_world4(shared.path(), 5, model);
  run_ranks(3, [&](int rank, Communicator& comm) {
    const fs::path root = rank == 2 ? local.path() : shared.path();
    try {
      restore_latest(root, {}, comm);
      ADD_FAILURE() << "rank 2 cannot see the checkpoint and restore went on";
    } catch (const CorruptCheckpointError&) {
      ADD_FAILURE() << "not damage";
    } catch (const CheckpointError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("rank 2 (node "), std::string::npos) << what;
      EXPECT_NE(what.find("shared filesystem"), std::string::npos) << what;
      EXPECT_NE(what.find("newest step 5"), std::string::npos) << what;
    }
  });
}

// A step that some rank does not list (its copy of the directory lags) fails there, but it is not
// damage: it is skipped without the marker that would keep it from retention for good.
TEST(CkptRestore, AStepSomeRankCannotSeeIsSkippedButNotMarked) {
  TempDir shared, lagging;
  const auto model = world4_model(760);
  save_world4(shared.path(), 1, model);
  save_world4(shared.path(), 2, model);
  fs::copy(shared.path() / "step-000000001", lagging.path() / "step-000000001", fs::copy_options::recursive);
  // (the ranks read the path rank 0 names: make step 2 fail for real, as it would on rank 1)
  fs::remove(shared.path() / "step-000000002" / "shard-00001-of-00004.h5");
  run_ranks(2, [&](int rank, Communicator& comm) {
    const auto restored = restore_latest(rank == 1 ? lagging.path() : shared.path(), {}, comm);
    ASSERT_TRUE(restored);
    EXPECT_EQ(restored->step, 1U);
  });
  EXPECT_FALSE(fs::exists(shared.path() / "step-000000002" / kRejectedMarker));
}

TEST(CkptRestore, TargetsThatFitNoStepAreAnErrorNotAFreshStart) {
  TempDir dir;
  const auto model = world4_model(800);
  save_world4(dir.path(), 1, model);
  save_world4(dir.path(), 2, model);
  run_ranks(2, [&](int, Communicator& comm) {
    std::vector<double> buffer(70);
    auto wrong_dtype = TensorTarget::whole("model/w", DType::float64, {10, 7}, buffer.data());
    try {
      restore_latest(dir.path(), std::span(&wrong_dtype, 1), comm);
      ADD_FAILURE() << "a model of another dtype restored or started afresh";
    } catch (const CheckpointMismatchError& e) {
      EXPECT_NE(std::string(e.what()).find("fits these tensors"), std::string::npos) << e.what();
    }
    auto unknown = TensorTarget::whole("model/nope", DType::float64, {10, 7}, buffer.data());
    EXPECT_THROW(restore_latest(dir.path(), std::span(&unknown, 1), comm), CheckpointMismatchError);
  });
}

// Damage that looks like a different model in the newest step only (its manifest says another
// dtype, lists no tensors, or its metadata has the wrong type): restore falls back to the older step.
TEST(CkptRestore, ANewestStepThatDoesNotFitIsSkippedForAnOlderOne) {
  TempDir dir;
  SingleProcessCommunicator comm;
  std::vector<float> good{1, 2, 3};
  std::vector<double> other{7, 8, 9};
  auto v1 = TensorView::replicated("w", DType::float32, {3}, good.data());
  save_checkpoint(dir.path(), 1, std::span(&v1, 1), nlohmann::json{{"step", 1}}, comm);
  auto v2 = TensorView::replicated("w", DType::float64, {3}, other.data());  // "changed dtype"
  save_checkpoint(dir.path(), 2, std::span(&v2, 1), nlohmann::json{{"step", 2}}, comm);
  save_checkpoint(dir.path(), 3, {}, nlohmann::json{{"step", 3}}, comm);  // "emptied tensor list"
  auto v4 = TensorView::replicated("w", DType::float32, {3}, good.data());
  save_checkpoint(dir.path(), 4, std::span(&v4, 1), nlohmann::json("not an object"), comm);  // wrong metadata
  std::vector<float> into(3);
  auto target = TensorTarget::whole("w", DType::float32, {3}, into.data());
  RestoreOptions options;
  options.check_metadata = [](const nlohmann::json& m) { (void)m.at("step").get<std::uint64_t>(); };
  auto restored = restore_latest(dir.path(), std::span(&target, 1), comm, options);
  ASSERT_TRUE(restored);
  EXPECT_EQ(restored->step, 1u);
  EXPECT_EQ(into, good);
  ASSERT_EQ(restored->skipped.size(), 3u);
  EXPECT_NE(restored->skipped[0].find("metadata rejected"), std::string::npos) << restored->skipped[0];
  EXPECT_NE(restored->skipped[1].find("no tensor named 'w'"), std::string::npos) << restored->skipped[1];
  EXPECT_NE(restored->skipped[2].find("is float64 but the target is float32"), std::string::npos)
      << restored->skipped[2];
}

// targets_for: the caller allocates what each step holds (the Python package's fresh optimizer
// state); a step it rejects is skipped, and the step restored is the one whose boxes were filled.
TEST(CkptRestore, TargetsChosenPerStepFromTheOpenedStep) {
  TempDir dir;
  SingleProcessCommunicator comm;
  std::vector<float> two{1, 2};
  std::vector<std::int64_t> three{4, 5, 6};
  auto v1 = TensorView::replicated("a", DType::float32, {2}, two.data());
  save_checkpoint(dir.path(), 1, std::span(&v1, 1), nlohmann::json::object(), comm);
  auto v2 = TensorView::replicated("b", DType::int64, {3}, three.data());
  save_checkpoint(dir.path(), 2, std::span(&v2, 1), nlohmann::json::object(), comm);
  std::map<std::uint64_t, std::vector<std::byte>> buffers;  // step -> memory allocated for it
  RestoreOptions options;
  bool reject_step2 = true;
  options.targets_for = [&](const Checkpoint& checkpoint) {
    if (checkpoint.step() == 2 && reject_step2) throw CheckpointMismatchError("not this one");
    std::vector<TensorTarget> targets;
    for (const auto& info : checkpoint.tensors()) {
      auto& memory = buffers[checkpoint.step()];
      memory.resize(info.bytes());
      targets.push_back(TensorTarget::whole(info.name, info.dtype, info.shape, memory.data()));
    }
    return targets;
  };
  auto restored = restore_latest(dir.path(), {}, comm, options);
  ASSERT_TRUE(restored);
  EXPECT_EQ(restored->step, 1u);
  ASSERT_EQ(restored->skipped.size(), 1u);
  EXPECT_NE(restored->skipped[0].find("not this one"), std::string::npos) << restored->skipped[0];
  EXPECT_EQ(std::memcmp(buffers[1].data(), two.data(), 8), 0);
  reject_step2 = false;
  restored = restore_latest(dir.path(), {}, comm, options);
  ASSERT_TRUE(restored);
  EXPECT_EQ(restored->step, 2u);
  EXPECT_EQ(std::memcmp(buffers[2].data(), three.data(), 24), 0);
}

// HDF5 1.10 refuses attributes past 64 KiB: user metadata is a dataset and round-trips at 1 MiB,
// readable by plain HDF5 at /_elastrun/user_metadata.
TEST(CkptSave, OneMebibyteOfUserMetadataRoundTrips) {
  TempDir dir;
  SingleProcessCommunicator comm;
  std::string blob(1 << 20, 'x');
  for (std::size_t i = 0; i < blob.size(); i += 97) blob[i] = static_cast<char>('a' + i % 26);
  const nlohmann::json metadata{{"blob", blob}, {"step", 3}};
  std::vector<float> w{1, 2, 3};
  auto view = TensorView::replicated("w", DType::float32, {3}, w.data());
  const auto saved = save_checkpoint(dir.path(), 3, std::span(&view, 1), metadata, comm);
  EXPECT_EQ(Checkpoint(saved.path).metadata(), metadata);
  std::vector<float> into(3);
  auto target = TensorTarget::whole("w", DType::float32, {3}, into.data());
  auto restored = restore_latest(dir.path(), std::span(&target, 1), comm);
  ASSERT_TRUE(restored);
  EXPECT_EQ(restored->metadata, metadata);
  h5::Lock lock(h5::library_mutex());
  h5::Handle fapl = h5::file_access(0, 0, false);
  h5::Handle file = h5::make_file(H5Fopen((saved.path / "index.h5").c_str(), H5F_ACC_RDONLY, fapl.get()), "open");
  h5::Handle dataset = h5::make_dataset(H5Dopen2(file.get(), "/_elastrun/user_metadata", H5P_DEFAULT), "open");
  h5::Handle type = h5::make_type(H5Dget_type(dataset.get()), "type");
  std::string text(H5Tget_size(type.get()), '\0');
  ASSERT_GE(H5Dread(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, text.data()), 0);
  EXPECT_EQ(nlohmann::json::parse(text), metadata);
}

TEST(CkptRestore, EmptyDirectoryHasNothingToRestore) {
  TempDir dir;
  SingleProcessCommunicator comm;
  EXPECT_FALSE(restore_latest(dir.path() / "never-created", {}, comm).has_value());
}

}  // namespace
}  // namespace elastrun::ckpt
