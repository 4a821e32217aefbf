// AsyncSaver: same bytes as a synchronous save, snapshot semantics, errors surface.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <atomic>
#include <map>

#include "elastrun/ckpt/async_saver.hpp"
#include "elastrun/ckpt/safetensors.hpp"
#include "fault_hook_guard.hpp"
#include "test_support.hpp"

namespace elastrun::ckpt {
namespace {

namespace fs = std::filesystem;
using testing::extract_box;
using testing::run_ranks;
using testing::TempDir;

// (name -> per-shard hashes) and every tensor's bytes, read back with verification.
std::map<std::string, std::vector<std::byte>> read_everything(const fs::path& step_dir) {
  Checkpoint checkpoint(step_dir);
  std::map<std::string, std::vector<std::byte>> out;
  for (const auto& t : checkpoint.tensors()) {
    auto& bytes = out[t.name];
    bytes.resize(t.bytes());
    checkpoint.read(TensorTarget::whole(t.name, t.dtype, t.shape, bytes.data()));
  }
  return out;
}

// Every child process a test started has been reaped.
bool no_unreaped_children() { return ::waitpid(-1, nullptr, WNOHANG) < 0 && errno == ECHILD; }

void check_async_equals_sync(const SaveOptions& options) {
  TempDir sync_dir;
  TempDir async_dir;
  const auto model = testing::world4_model(900);
  testing::save_world4(sync_dir.path(), 7, model);
  run_ranks(4, [&](int rank, Communicator& comm) {
    // Each rank's own copies of its slices, scribbled over right after save() returns.
    std::vector<std::vector<std::byte>> slices;
    std::vector<TensorView> views;
    slices.reserve(model.size());
    for (const auto& t : model) {
      Shape offset(t.shape.size(), 0), extent = t.shape;
      if (t.placement == Placement::sharded) std::tie(offset, extent) = testing::world4_slice(t, rank);
      slices.push_back(extract_box(t.bytes, t.shape, offset, extent, dtype_size(t.dtype)));
      views.push_back(t.placement == Placement::sharded
                          ? TensorView::sharded(t.name, t.dtype, t.shape, offset, extent, slices.back().data())
                          : TensorView::replicated(t.name, t.dtype, t.shape, slices.back().data()));
    }
    AsyncSaver saver(async_dir.path(), comm, options);
    saver.save(7, views, {{"step_meta", 7}});
    for (auto& s : slices) std::fill(s.begin(), s.end(), std::byte{0x77});
    const auto result = saver.wait();
    ASSERT_TRUE(result.has_value());
    EXPECT_EQ(result->path, async_dir.path() / "step-000000007");
    // The snapshot's own memory is reported: the staging arena, or the writer process's copy.
    EXPECT_GT(result->snapshot_bytes, 0U);
    // Staging buffers are reused for the next save (same sizes): still correct data.
    saver.save(8, views, {{"step_meta", 8}});
    EXPECT_NO_THROW(saver.wait());
  });
  const auto sync_data = read_everything(sync_dir.path() / "step-000000007");
  const auto async_data = read_everything(async_dir.path() / "step-000000007");
  EXPECT_EQ(sync_data, async_data);
  Checkpoint sync_ck(sync_dir.path() / "step-000000007");
  Checkpoint async_ck(async_dir.path() / "step-000000007");
  for (const auto& t : sync_ck.tensors()) {
    const auto& other = async_ck.tensor(t.name);
    ASSERT_EQ(t.shards.size(), other.shards.size()) << t.name;
    for (std::size_t i = 0; i < t.shards.size(); ++i) {
      EXPECT_EQ(t.shards[i].xxh3, other.shards[i].xxh3) << t.name;
    }
  }
  // Step 8 holds the scribbled bytes: the snapshot happens at save(), not before.
  const auto step8 = read_everything(async_dir.path() / "step-000000008");
  EXPECT_EQ(step8.at("model/bias"), std::vector<std::byte>(10, std::byte{0x77}));
}

TEST(CkptAsync, AsyncSaveEqualsSyncSaveAndSnapshotsBeforeReturning) { check_async_equals_sync({}); }

TEST(CkptAsync, ForkSnapshotEqualsSyncSaveAndSnapshotsBeforeReturning) {
  SaveOptions options;
  options.async_snapshot = AsyncSnapshot::fork;
  check_async_equals_sync(options);
  EXPECT_TRUE(no_unreaped_children());
}

using testing::FaultHookGuard;

std::vector<std::int32_t> restore_values(const fs::path& root, std::uint64_t expected_step) {
  SingleProcessCommunicator comm;
  std::vector<std::int32_t> out(4, -1);
  auto target = TensorTarget::whole("v", DType::int32, {4}, out.data());
  const auto restored = restore_latest(root, std::span(&target, 1), comm);
  EXPECT_TRUE(restored.has_value());
  if (restored) {
    EXPECT_EQ(restored->step, expected_step);
  }
  return out;
}

// The fork writer copies, then gives up its mapping of the tensors; views aliasing one buffer
// (e.g. a flat parameter buffer and views into it) must all be copied before any is given up.
TEST(CkptAsync, ForkSnapshotOfAliasingViewsKeepsEveryViewsBytes) {
  TempDir dir;
  SingleProcessCommunicator comm;
  SaveOptions options;
  options.async_snapshot = AsyncSnapshot::fork;
  std::vector<std::int32_t> flat(1 << 16);  // several pages
  for (std::size_t i = 0; i < flat.size(); ++i) flat[i] = static_cast<std::int32_t>(i);
  const std::vector<std::int32_t> expected = flat;
  const std::size_t half = flat.size() / 2;
  std::vector<TensorView> views = {TensorView::replicated("flat", DType::int32, {flat.size()}, flat.data()),
                                   TensorView::replicated("upper", DType::int32, {half}, flat.data() + half)};
  AsyncSaver saver(dir.path(), comm, options);
  saver.save(1, views, {});
  std::fill(flat.begin(), flat.end(), -1);
  ASSERT_NO_THROW(saver.wait());
  const auto saved = read_everything(dir.path() / "step-000000001");
  ASSERT_EQ(saved.at("flat").size(), expected.size() * sizeof(std::int32_t));
  EXPECT_EQ(std::memcmp(saved.at("flat").data(), expected.data(), saved.at("flat").size()), 0);
  ASSERT_EQ(saved.at("upper").size(), half * sizeof(std::int32_t));
  EXPECT_EQ(std::memcmp(saved.at("upper").data(), expected.data() + half, saved.at("upper").size()), 0);
  EXPECT_TRUE(no_unreaped_children());
}

TEST(CkptAsync, ForkSnapshotWriterKilledOrFailingFailsTheSaveAndKeepsThePrevious) {
  TempDir dir;
  SingleProcessCommunicator comm;
  SaveOptions options;
  options.async_snapshot = AsyncSnapshot::fork;
  std::vector<std::int32_t> values = {1, 2, 3, 4};
  auto view = TensorView::replicated("v", DType::int32, {4}, values.data());
  AsyncSaver saver(dir.path(), comm, options);
  saver.save(1, std::span(&view, 1), {});
  ASSERT_NO_THROW(saver.wait());
  values = {5, 6, 7, 8};
  {
    // The hook runs only in the forked writer: it dies there as if OOM-killed.
    FaultHookGuard hook([](std::string_view point, int) {
      if (point == "async.fork_child") ::raise(SIGKILL);
    });
    saver.save(2, std::span(&view, 1), {});
    try {
      saver.wait();
      ADD_FAILURE() << "a killed snapshot writer must fail the save";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("killed by signal 9"), std::string::npos) << e.what();
    }
  }
  {
    FaultHookGuard hook([](std::string_view point, int) {
      if (point == "async.fork_child") throw CheckpointError("injected failure in the writer process");
    });
    saver.save(3, std::span(&view, 1), {});
    try {
      saver.wait();
      ADD_FAILURE() << "a failing snapshot writer must fail the save";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("injected failure in the writer process"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(list_steps(dir.path()).size(), 1U);
  EXPECT_EQ(restore_values(dir.path(), 1), (std::vector<std::int32_t>{1, 2, 3, 4}));
  saver.save(4, std::span(&view, 1), {});  // the saver still works
  ASSERT_NO_THROW(saver.wait());
  EXPECT_EQ(restore_values(dir.path(), 4), values);
  EXPECT_TRUE(no_unreaped_children());
}

TEST(CkptAsync, StagingGrowsWhenTheStateGrowsAndOddSizesKeepTheirBytes) {
  TempDir dir;
  SingleProcessCommunicator comm;
  AsyncSaver saver(dir.path(), comm);
  // Odd byte counts: every staged piece after the first starts at a padded offset.
  std::vector<std::uint8_t> small(3, 1);
  std::vector<double> medium(5, 2.5);
  std::vector<std::int16_t> large(300'000);
  for (std::size_t i = 0; i < large.size(); ++i) large[i] = static_cast<std::int16_t>(i * 7);
  std::vector<TensorView> views = {TensorView::replicated("small", DType::uint8, {3}, small.data()),
                                   TensorView::replicated("medium", DType::float64, {5}, medium.data())};
  saver.save(1, views, {});
  ASSERT_NO_THROW(saver.wait());
  views.push_back(TensorView::replicated("large", DType::int16, {large.size()}, large.data()));
  saver.save(2, views, {});  // larger than the first arena: a new one
  std::fill(large.begin(), large.end(), std::int16_t{0});
  ASSERT_NO_THROW(saver.wait());
  const auto step2 = read_everything(dir.path() / "step-000000002");
  std::vector<std::int16_t> expected(300'000);
  for (std::size_t i = 0; i < expected.size(); ++i) expected[i] = static_cast<std::int16_t>(i * 7);
  const auto& stored = step2.at("large");
  ASSERT_EQ(stored.size(), expected.size() * sizeof(std::int16_t));
  EXPECT_EQ(std::memcmp(stored.data(), expected.data(), stored.size()), 0);
  EXPECT_EQ(step2.at("small"), std::vector<std::byte>(3, std::byte{1}));
  const auto& medium_bytes = step2.at("medium");
  ASSERT_EQ(medium_bytes.size(), 5 * sizeof(double));
  EXPECT_EQ(std::memcmp(medium_bytes.data(), medium.data(), medium_bytes.size()), 0);
}

TEST(CkptAsync, ErrorsSurfaceOnNextCallAndAreNotLost) {
  TempDir dir;
  const fs::path not_a_directory = dir.path() / "file";
  { std::ofstream(not_a_directory) << "x"; }
  SingleProcessCommunicator comm;
  std::vector<float> values = {1, 2, 3};
  auto view = TensorView::replicated("v", DType::float32, {3}, values.data());
  AsyncSaver saver(not_a_directory, comm);
  saver.save(1, std::span(&view, 1), {});
  EXPECT_THROW(saver.wait(), CheckpointError);
  EXPECT_NO_THROW(saver.wait());  // reported once
  saver.save(2, std::span(&view, 1), {});
  EXPECT_THROW(saver.save(3, std::span(&view, 1), {}), CheckpointError);  // step 2's error
  EXPECT_FALSE(saver.busy());
}

TEST(CkptAsync, OneRanksBadInputFailsEveryRankWithoutHanging) {
  TempDir dir;
  std::vector<float> values(8, 2.0F);
  std::atomic<int> failures = 0;
  run_ranks(3, [&](int rank, Communicator& comm) {
    // Rank 1's slice runs past the end of the tensor.
    const Shape extent = rank == 1 ? Shape{7} : Shape{2};
    auto view = TensorView::sharded("x", DType::float32, {6}, {2ULL * rank}, extent, values.data());
    AsyncSaver saver(dir.path(), comm);
    saver.save(1, std::span(&view, 1), {});
    try {
      saver.wait();
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
      ++failures;
    }
  });
  EXPECT_EQ(failures.load(), 3);
  EXPECT_TRUE(list_steps(dir.path()).empty());
}

TEST(CkptAsync, ReplicatedSnapshotHoldsOnlyThisRanksPieceYetSavesEverything) {
  TempDir dir;
  // [2, 6, 3]: pieces split dimension 1, so they are not contiguous in the source (gathered).
  const auto awkward = testing::make_tensor(5, DType::int16, {2, 6, 3});
  const auto plain = testing::make_tensor(6, DType::float64, {7});
  run_ranks(3, [&](int, Communicator& comm) {
    const std::vector<TensorView> views = {TensorView::replicated("awkward", DType::int16, {2, 6, 3}, awkward.data()),
                                           TensorView::replicated("plain", DType::float64, {7}, plain.data())};
    AsyncSaver saver(dir.path(), comm);
    saver.save(4, views, {});
    EXPECT_NO_THROW(saver.wait());
  });
  const auto saved = read_everything(dir.path() / "step-000000004");
  EXPECT_EQ(saved.at("awkward"), awkward);
  EXPECT_EQ(saved.at("plain"), plain);
}

TEST(CkptExport, SafetensorsHeaderAndBytes) {
  TempDir dir;
  const auto model = testing::world4_model(1234);
  testing::save_world4(dir.path(), 5, model);
  Checkpoint checkpoint(dir.path() / "step-000000005");
  const fs::path out = dir.path() / "model.safetensors";
  export_safetensors(checkpoint, out);
  std::ifstream stream(out, std::ios::binary);
  std::string file((std::istreambuf_iterator<char>(stream)), std::istreambuf_iterator<char>());
  ASSERT_GE(file.size(), 8U);
  std::uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | static_cast<unsigned char>(file[i]);
  EXPECT_EQ(header_length % 8, 0U);
  const auto header = nlohmann::json::parse(file.substr(8, header_length));
  EXPECT_EQ(header.at("__metadata__").at("step"), "5");
  const std::size_t data_start = 8 + header_length;
  for (const auto& t : model) {
    const auto& entry = header.at(t.name);
    EXPECT_EQ(entry.at("dtype"), safetensors_dtype(t.dtype));
    EXPECT_EQ(entry.at("shape").get<Shape>(), t.shape);
    const auto begin = entry.at("data_offsets")[0].get<std::size_t>();
    const auto end = entry.at("data_offsets")[1].get<std::size_t>();
    ASSERT_EQ(end - begin, t.bytes.size()) << t.name;
    EXPECT_EQ(0, std::memcmp(file.data() + data_start + begin, t.bytes.data(), t.bytes.size())) << t.name;
  }
}

}  // namespace
}  // namespace elastrun::ckpt
