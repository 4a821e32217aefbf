// Pieces larger than the write/hash chunk (4 MiB) are written and hashed in runs, and read back
// and verified whole.
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

TEST(CkptLargePieces, LargePiecesRoundTripAndVerify) {
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

}  // namespace
}  // namespace elastrun::ckpt
