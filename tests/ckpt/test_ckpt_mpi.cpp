// Run under `mpirun -np 4`: both layouts saved through MpiCommunicator, shared-file layout via
// collective MPI-IO, read back with resharding, verified, and read through the index's virtual
// datasets with plain HDF5.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <mpi.h>

#include <memory>

#include <fmt/format.h>

#include "elastrun/ckpt/async_saver.hpp"
#include "elastrun/ckpt/checkpoint.hpp"
#include "elastrun/ckpt/mpi_comm.hpp"
#include "h5.hpp"
#include "internal.hpp"
#include "fault_hook_guard.hpp"
#include "test_support.hpp"

namespace elastrun::ckpt {
namespace {

namespace fs = std::filesystem;
using testing::extract_box;
using testing::GlobalTensor;

// Rank 0 makes a temp dir (shared by all ranks of this node-local test) and removes it.
class SharedTempDir {
 public:
  explicit SharedTempDir(Communicator& comm) : comm_(comm) {
    std::string path;
    if (comm.rank() == 0) {
      owned_.emplace();
      path = owned_->path().string();
    }
    path_ = comm.allgather(path).at(0);
  }
  ~SharedTempDir() { comm_.barrier(); }  // nobody reads after rank 0's TempDir removes it
  const fs::path& path() const { return path_; }

 private:
  Communicator& comm_;
  std::optional<testing::TempDir> owned_;
  fs::path path_;
};

std::vector<TensorView> views_for_rank(const std::vector<GlobalTensor>& model, int rank,
                                       std::vector<std::vector<std::byte>>& slices) {
  std::vector<TensorView> views;
  slices.clear();
  slices.reserve(model.size());
  for (const auto& t : model) {
    if (t.placement == Placement::replicated) {
      views.push_back(TensorView::replicated(t.name, t.dtype, t.shape, t.bytes.data()));
      continue;
    }
    auto [offset, extent] = testing::world4_slice(t, rank);
    slices.push_back(extract_box(t.bytes, t.shape, offset, extent, dtype_size(t.dtype)));
    views.push_back(TensorView::sharded(t.name, t.dtype, t.shape, offset, extent, slices.back().data()));
  }
  return views;
}

// Each rank restores its columns-split (dim -1) boxes and compares bit-exactly.
void expect_restores(const fs::path& root, const std::vector<GlobalTensor>& model, Communicator& comm,
                     std::uint64_t step) {
  std::vector<std::vector<std::byte>> buffers, expected;
  std::vector<TensorTarget> targets;
  buffers.reserve(model.size());
  for (const auto& t : model) {
    Shape offset(t.shape.size(), 0), extent = t.shape;
    if (!t.shape.empty()) {
      const auto [b, n] = testing::split(t.shape.back(), comm.size(), comm.rank());
      offset.back() = b;
      extent.back() = n;
    }
    expected.push_back(extract_box(t.bytes, t.shape, offset, extent, dtype_size(t.dtype)));
    buffers.emplace_back(expected.back().size(), std::byte{0xcd});
    targets.push_back(TensorTarget::box(t.name, t.dtype, offset, extent, buffers.back().data()));
  }
  const auto restored = restore_latest(root, targets, comm);
  ASSERT_TRUE(restored.has_value());
  EXPECT_EQ(restored->step, step);
  for (std::size_t i = 0; i < model.size(); ++i) {
    EXPECT_EQ(buffers[i], expected[i]) << model[i].name << " rank " << comm.rank();
  }
}

// Reads a whole tensor through index.h5's virtual dataset with plain HDF5 calls.
std::vector<std::byte> read_through_index(const fs::path& step_dir, const GlobalTensor& t) {
  std::vector<std::byte> out(t.bytes.size());
  h5::Lock lock(h5::library_mutex());
  h5::Handle file = h5::make_file(H5Fopen((step_dir / "index.h5").c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), "open index");
  h5::Handle dataset = h5::make_dataset(H5Dopen2(file.get(), t.name.c_str(), H5P_DEFAULT), t.name);
  h5::Handle type = h5::storage_type(t.dtype);
  if (!out.empty()) {
    h5::check(H5Dread(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()), "read " + t.name);
  }
  return out;
}

class CkptMpi : public ::testing::Test {
 protected:
  void SetUp() override {
    if (comm.size() != 4) GTEST_SKIP() << "run with mpirun -np 4";
  }
  MpiCommunicator comm{MPI_COMM_WORLD};
};

TEST_F(CkptMpi, SharedFileLayoutRoundTripReshardAndIndex) {
  SharedTempDir dir(comm);
  const auto model = testing::world4_model(31);
  std::vector<std::vector<std::byte>> slices;
  const auto views = views_for_rank(model, comm.rank(), slices);
  SaveOptions options;
  options.layout = Layout::shared_file;
  options.alignment = 4096;
  const SaveResult saved = save_checkpoint(dir.path(), 9, views, {{"epoch", 2}}, comm, options);
  EXPECT_TRUE(fs::exists(saved.path / "data.h5"));
  EXPECT_FALSE(fs::exists(saved.path / "shard-00000-of-00004.h5"));
  expect_restores(dir.path(), model, comm, 9);
  if (comm.rank() == 0) {
    {
      Checkpoint checkpoint(saved.path);
      EXPECT_EQ(checkpoint.layout(), "shared-file");
      EXPECT_EQ(checkpoint.world_size(), 4);
      EXPECT_TRUE(checkpoint.verify_all().empty());
    }  // closes data.h5: HDF5 will not reopen it as a VDS source with different access flags
    for (const auto& t : model) {
      EXPECT_EQ(read_through_index(saved.path, t), t.bytes) << t.name;
    }
  }
}

TEST_F(CkptMpi, FilePerRankOverMpiAndLayoutsMix) {
  SharedTempDir dir(comm);
  const auto old_model = testing::world4_model(41);
  const auto new_model = testing::world4_model(51);
  std::vector<std::vector<std::byte>> slices;
  SaveOptions shared;
  shared.layout = Layout::shared_file;
  save_checkpoint(dir.path(), 1, views_for_rank(old_model, comm.rank(), slices), {}, comm, shared);
  save_checkpoint(dir.path(), 2, views_for_rank(new_model, comm.rank(), slices), {}, comm);
  expect_restores(dir.path(), new_model, comm, 2);
  if (comm.rank() == 0) {
    for (const auto& t : new_model) {
      EXPECT_EQ(read_through_index(dir.path() / "step-000000002", t), t.bytes) << t.name;
    }
    // Damage the newest (file-per-rank) step: restore falls back to the shared-file step.
    fs::resize_file(dir.path() / "step-000000002" / "shard-00003-of-00004.h5", 100);
  }
  comm.barrier();
  expect_restores(dir.path(), old_model, comm, 1);
}

// Copy-on-write snapshots under a real MPI job: each rank's forked writer writes its shard while
// the parent (MPI initialised, progress threads running) scribbles over its tensors; the shared-
// file layout (MPI-IO in the writer) takes a copy snapshot instead.
TEST_F(CkptMpi, ForkSnapshotUnderMpiAndSharedFileFallsBackToCopy) {
  SharedTempDir dir(comm);
  const auto model = testing::world4_model(61);
  for (const Layout layout : {Layout::file_per_rank, Layout::shared_file}) {
    std::vector<std::vector<std::byte>> slices;
    const auto views = views_for_rank(model, comm.rank(), slices);
    SaveOptions options;
    options.layout = layout;
    options.async_snapshot = AsyncSnapshot::fork;
    const std::uint64_t step = layout == Layout::file_per_rank ? 1 : 2;
    {
      AsyncSaver saver(dir.path(), comm, options);
      saver.save(step, views, {});
      for (auto& slice : slices) std::fill(slice.begin(), slice.end(), std::byte{0x5a});
      const auto result = saver.wait();
      ASSERT_TRUE(result.has_value());
    }
    expect_restores(dir.path(), model, comm, step);
    comm.barrier();
  }
  EXPECT_EQ(::waitpid(-1, nullptr, WNOHANG), -1) << "a snapshot writer was not reaped";
}

TEST_F(CkptMpi, SharedFileRejectsDisagreementOnEveryRank) {
  SharedTempDir dir(comm);
  std::vector<float> values(8, 1.0F);
  const Shape shape = comm.rank() == 2 ? Shape{9} : Shape{8};
  const auto [b, n] = testing::split(8, 4, comm.rank());
  auto view = TensorView::sharded("x", DType::float32, shape, {b}, {n}, values.data() + b);
  SaveOptions options;
  options.layout = Layout::shared_file;
  EXPECT_THROW(save_checkpoint(dir.path(), 1, std::span(&view, 1), {}, comm, options), CheckpointError);
  EXPECT_TRUE(list_steps(dir.path()).empty());
}

using testing::FaultHookGuard;

// A failure on one rank at `point` of the collective shared-file write must make every rank
// throw an error naming that rank (not block the others in the next collective call), and keep
// the previous step.
void expect_one_rank_failure_fails_all(MpiCommunicator& comm, const std::string& point, int failing_rank, bool async) {
  SharedTempDir dir(comm);
  const auto model = testing::world4_model(61);
  std::vector<std::vector<std::byte>> slices;
  const auto views = views_for_rank(model, comm.rank(), slices);
  SaveOptions options;
  options.layout = Layout::shared_file;
  options.fsync = false;
  save_checkpoint(dir.path(), 1, views, {}, comm, options);
  std::string message;
  {
    FaultHookGuard hook([&](std::string_view p, int rank) {
      if (p == point && rank == failing_rank) {
        throw CheckpointError("injected failure at " + point);
      }
    });
    try {
      if (async) {
        AsyncSaver saver(dir.path(), comm, options);
        saver.save(2, views, {});
        saver.wait();
      } else {
        save_checkpoint(dir.path(), 2, views, {}, comm, options);
      }
    } catch (const CheckpointError& e) {
      message = e.what();
    }
  }
  EXPECT_NE(message.find(fmt::format("rank {}", failing_rank)), std::string::npos) << point << ": " << message;
  EXPECT_NE(message.find("injected failure at " + point), std::string::npos) << message;
  comm.barrier();
  const auto steps = list_steps(dir.path());
  ASSERT_EQ(steps.size(), 1U) << point;
  EXPECT_EQ(steps[0].step, 1U);
  comm.barrier();
}

TEST_F(CkptMpi, SharedFileFailureOnOneRankFailsEveryRankWithoutDeadlock) {
  expect_one_rank_failure_fails_all(comm, "shared.write", 2, false);  // a failed write
  expect_one_rank_failure_fails_all(comm, "shared.prepare", 1, false);
  expect_one_rank_failure_fails_all(comm, "shared.create", 3, false);
  expect_one_rank_failure_fails_all(comm, "shared.create_dataset", 0, false);
  expect_one_rank_failure_fails_all(comm, "shared.close", 2, false);
}

TEST_F(CkptMpi, SharedFileAsyncSnapshotFailureOnOneRankFailsEveryRank) {
  expect_one_rank_failure_fails_all(comm, "async.snapshot", 3, true);
  expect_one_rank_failure_fails_all(comm, "shared.write", 1, true);
}

TEST_F(CkptMpi, GatherAndBroadcast) {
  const auto gathered = comm.gather(std::string(static_cast<std::size_t>(comm.rank()) * 3, 'x'));
  if (comm.rank() == 0) {
    ASSERT_EQ(gathered.size(), 4U);
    for (int r = 0; r < 4; ++r) EXPECT_EQ(gathered[static_cast<std::size_t>(r)].size(), 3U * r);
  } else {
    EXPECT_TRUE(gathered.empty());
  }
  EXPECT_EQ(comm.broadcast(comm.rank() == 0 ? "root says" : "nobody listens"), "root says");
}

}  // namespace
}  // namespace elastrun::ckpt

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {  // one rank's report is enough; failures still fail the exit code
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    std::unique_ptr<::testing::TestEventListener> quiet(listeners.Release(listeners.default_result_printer()));
  }
  const int result = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
