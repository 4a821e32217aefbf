// libtorch adapter: state-dict style save from 2 thread-ranks, restore into existing tensors
// (contiguous in place, non-contiguous via staging) on 1 and 3 ranks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <fmt/format.h>

#include <functional>
#include <thread>

#include "elastrun/ckpt/async_saver.hpp"
#include "elastrun/ckpt/c10d_store_comm.hpp"
#include "elastrun/ckpt/torch_adapter.hpp"
#include "test_support.hpp"

namespace elastrun::ckpt {
namespace {

using namespace torch_adapter;

struct Model {
  at::Tensor weight = torch::randn({6, 4});
  at::Tensor bias = torch::randn({4}).to(torch::kBFloat16);
  at::Tensor transposed = torch::randn({3, 5}).to(torch::kHalf).t();  // non-contiguous
  at::Tensor mask = torch::rand({5}) > 0.5;
  at::Tensor step = torch::tensor(int64_t{1234});
};

TEST(CkptTorch, SaveShardedAndReplicatedRestoreIntoExistingTensors) {
  testing::TempDir dir;
  torch::manual_seed(7);
  const Model model;
  testing::run_ranks(2, [&](int rank, Communicator& comm) {
    SaveViews views;
    views.add_sharded("model/weight", model.weight.narrow(0, 3 * rank, 3), {6, 4}, {3ULL * rank, 0});
    views.add_replicated("model/bias", model.bias);
    views.add_replicated("model/transposed", model.transposed);
    views.add_replicated("model/mask", model.mask);
    views.add_replicated("step", model.step);
    save_checkpoint(dir.path(), 3, views.views(), {{"epoch", 1}}, comm);
  });

  // World 1: restore into fresh tensors; `transposed_into` is a non-contiguous destination.
  at::Tensor weight = torch::zeros({6, 4});
  at::Tensor bias = torch::zeros({4}, torch::kBFloat16);
  at::Tensor storage = torch::zeros({3, 5}, torch::kHalf);
  at::Tensor transposed_into = storage.t();
  ASSERT_FALSE(transposed_into.is_contiguous());
  at::Tensor mask = torch::zeros({5}, torch::kBool);
  at::Tensor step = torch::zeros({}, torch::kLong);
  const void* weight_memory = weight.data_ptr();
  RestoreTargets targets;
  targets.add_whole("model/weight", weight);
  targets.add_whole("model/bias", bias);
  targets.add_whole("model/transposed", transposed_into);
  targets.add_whole("model/mask", mask);
  targets.add_whole("step", step);
  SingleProcessCommunicator single;
  const auto restored = restore_latest(dir.path(), targets.targets(), single);
  ASSERT_TRUE(restored.has_value());
  targets.finish();
  EXPECT_EQ(weight.data_ptr(), weight_memory);  // restored in place
  EXPECT_TRUE(torch::equal(weight, model.weight));
  EXPECT_TRUE(torch::equal(bias, model.bias));
  EXPECT_TRUE(torch::equal(transposed_into, model.transposed));
  EXPECT_TRUE(torch::equal(mask, model.mask));
  EXPECT_EQ(step.item<int64_t>(), 1234);

  // World 3: each rank restores its 2 rows of the weight.
  testing::run_ranks(3, [&](int rank, Communicator& comm) {
    at::Tensor rows = torch::zeros({2, 4});
    RestoreTargets mine;
    mine.add_box("model/weight", rows, {2ULL * rank, 0});
    ASSERT_TRUE(restore_latest(dir.path(), mine.targets(), comm).has_value());
    mine.finish();
    EXPECT_TRUE(torch::equal(rows, model.weight.narrow(0, 2 * rank, 2)));
  });
}

// Threads as ranks, voting through a c10d store instead of InProcessGroup: save on 3, restore on 2.
void run_store_ranks(c10d::Store& store, int world, const std::string& prefix,
                     const std::function<void(int, Communicator&)>& fn) {
  std::vector<std::jthread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      C10dStoreCommunicator comm(store, rank, world, prefix);
      fn(rank, comm);
    });
  }
}

TEST(CkptTorch, C10dStoreCommunicatorDrivesSaveAndRestore) {
  testing::TempDir dir;
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(60));
  const at::Tensor weight = torch::arange(36, torch::kFloat).reshape({9, 4});
  const at::Tensor bias = torch::arange(4, torch::kLong);
  run_store_ranks(*store, 3, "gen0/save", [&](int rank, Communicator& comm) {
    SaveViews views;
    views.add_sharded("w", weight.narrow(0, 3 * rank, 3), {9, 4}, {3ULL * rank, 0});
    views.add_replicated("b", bias);
    EXPECT_NO_THROW(save_checkpoint(dir.path(), 1, views.views(), {}, comm));
    EXPECT_NO_THROW(save_checkpoint(dir.path(), 2, views.views(), {}, comm));
  });
  run_store_ranks(*store, 2, "gen1/restore", [&](int rank, Communicator& comm) {
    const auto [begin, rows] = testing::split(9, 2, rank);
    at::Tensor mine = torch::zeros({static_cast<int64_t>(rows), 4});
    at::Tensor b = torch::zeros({4}, torch::kLong);
    RestoreTargets targets;
    targets.add_box("w", mine, {begin, 0});
    targets.add_whole("b", b);
    const auto restored = restore_latest(dir.path(), targets.targets(), comm);
    ASSERT_TRUE(restored.has_value());
    EXPECT_EQ(restored->step, 2U);
    EXPECT_TRUE(torch::equal(mine, weight.narrow(0, static_cast<int64_t>(begin), static_cast<int64_t>(rows))));
    EXPECT_TRUE(torch::equal(b, bias));
  });
  // Every call cleans up after itself: no key survives.
  EXPECT_EQ(store->getNumKeys(), 0);
}

// Copy-on-write async snapshots in a libtorch process (intra-op thread pool and the store's
// threads alive during fork): the writer processes see the tensors as they were at save().
TEST(CkptTorch, ForkSnapshotOfTensorsThatChangeRightAfterSave) {
  testing::TempDir dir;
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(60));
  const at::Tensor expected = torch::rand({64, 256});
  (void)torch::matmul(expected, expected.t());  // start the intra-op thread pool
  run_store_ranks(*store, 2, "fork/save", [&](int rank, Communicator& comm) {
    at::Tensor mine = expected.narrow(0, 32 * rank, 32).clone();
    SaveViews views;
    views.add_sharded("w", mine, {64, 256}, {32ULL * rank, 0});
    SaveOptions options;
    options.async_snapshot = AsyncSnapshot::fork;
    AsyncSaver saver(dir.path(), comm, options);
    saver.save(1, views.views(), {});
    mine.mul_(-3.0);
    EXPECT_NO_THROW(saver.wait());
  });
  Checkpoint checkpoint(dir.path() / "step-000000001");
  at::Tensor whole = torch::zeros({64, 256});
  checkpoint.read(TensorTarget::whole("w", DType::float32, {64, 256}, whole.data_ptr()));
  EXPECT_TRUE(torch::equal(whole, expected));
}

// Calls are keyed by their sequence number and leave no keys behind, so a new group reusing
// the prefix (or a later save) never reads an earlier call's values.
TEST(CkptTorch, C10dStoreCommunicatorNeverReadsStaleKeys) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(60));
  for (const char* group : {"first", "second", "third"}) {
    run_store_ranks(*store, 3, "job/ckpt", [&](int rank, Communicator& comm) {
      for (int call = 0; call < 3; ++call) {
        const std::string mine = fmt::format("{}-{}-{}", group, call, rank);
        const auto all = comm.allgather(mine);
        ASSERT_EQ(all.size(), 3U);
        for (int r = 0; r < 3; ++r) {
          EXPECT_EQ(all[static_cast<std::size_t>(r)], fmt::format("{}-{}-{}", group, call, r));
        }
        const auto gathered = comm.gather(mine);
        if (rank == 0) {
          ASSERT_EQ(gathered.size(), 3U);
          EXPECT_EQ(gathered[2], fmt::format("{}-{}-2", group, call));
        } else {
          EXPECT_TRUE(gathered.empty());
        }
        EXPECT_EQ(comm.broadcast(mine), fmt::format("{}-{}-0", group, call));
      }
    });
    EXPECT_EQ(store->getNumKeys(), 0) << group;
  }
}

TEST(CkptTorch, DTypeMapping) {
  for (auto type : {torch::kHalf, torch::kBFloat16, torch::kFloat, torch::kDouble, torch::kChar, torch::kShort,
                    torch::kInt, torch::kLong, torch::kByte, torch::kBool}) {
    EXPECT_EQ(to_scalar_type(to_dtype(type)), type);
    EXPECT_EQ(dtype_size(to_dtype(type)), c10::elementSize(type));
  }
  EXPECT_THROW(to_dtype(torch::kComplexFloat), CheckpointError);
}

}  // namespace
}  // namespace elastrun::ckpt
