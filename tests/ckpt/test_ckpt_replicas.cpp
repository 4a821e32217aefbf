// Replicated tensors must be identical on every rank: a save where ranks hold different values of a
// replicated tensor fails naming it (sampled or full checks, sync and async); identical ones save.
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

TEST(CkptReplicas, RanksHoldingDifferentReplicatedValuesFailTheSave) {
  expect_replica_mismatch({40, 25}, ReplicaCheck::sampled, 777, false);       // small: all bytes
  expect_replica_mismatch({40, 25}, ReplicaCheck::sampled, 777, true);        // AsyncSaver
  expect_replica_mismatch({3, 1 << 20}, ReplicaCheck::full, 1234567, false);  // 3 MiB, full hash
  expect_replica_mismatch({3, 1 << 20}, ReplicaCheck::sampled, 0, false);     // first sample
}

TEST(CkptReplicas, IdenticalReplicasAndCheckOffSave) {
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

}  // namespace
}  // namespace elastrun::ckpt
