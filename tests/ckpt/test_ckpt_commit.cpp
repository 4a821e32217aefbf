// Committing a step, on real HDF5 files: a failure after the commit point is a committed save with
// a warning, a failure before it keeps the old step, and replacing a committed step never loses it
// (also when the process crashes at any point of the exchange).
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

TEST(CkptCommit, FailureAfterTheRenameIsACommittedSaveWithAWarning) {
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

TEST(CkptCommit, ResaveFailureAfterExchangeStillReportsSuccessAndNewData) {
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

TEST(CkptCommit, FailureBeforeTheRenameKeepsTheOldStep) {
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
TEST(CkptCommit, ReplacedCopyLeftByACrashIsStillTheStep) {
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

TEST(CkptCommit, CrashWhileReplacingAStepNeverLosesIt) {
  for (const char* point : {"commit.before_publish", "commit.published"}) {
    expect_step7_survives_crash_at(point, false);
  }
  expect_step7_survives_crash_at("commit.between_renames", true);
}

}  // namespace
}  // namespace elastrun::ckpt
