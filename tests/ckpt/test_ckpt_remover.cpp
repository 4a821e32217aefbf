// Background removal of retired steps (ckpt/src/remover.cpp), on real HDF5 files: the save
// returns while the old step is still being deleted under a name readers ignore, the next
// save's housekeeping leaves such a path alone but removes genuine crash leftovers, and nothing
// is left once the queue is drained (or the process exits).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "elastrun/ckpt/checkpoint.hpp"
#include "internal.hpp"
#include "test_support.hpp"

namespace elastrun::ckpt {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

SaveOptions keep_last(int k) {
  SaveOptions options;
  options.fsync = false;
  options.keep_last = k;
  return options;
}

SaveResult save_values(const fs::path& root, std::uint64_t step, std::vector<std::int32_t> values,
                       const SaveOptions& options) {
  SingleProcessCommunicator comm;
  auto view = TensorView::replicated("v", DType::int32, {values.size()}, values.data());
  return save_checkpoint(root, step, std::span(&view, 1), {}, comm, options);
}

std::optional<std::pair<std::uint64_t, std::vector<std::int32_t>>> restore_values(const fs::path& root) {
  SingleProcessCommunicator comm;
  std::vector<std::int32_t> out(3, -1);
  auto target = TensorTarget::whole("v", DType::int32, {3}, out.data());
  const auto restored = restore_latest(root, std::span(&target, 1), comm);
  if (!restored) return std::nullopt;
  return std::pair{restored->step, out};
}

std::vector<std::uint64_t> listed_steps(const fs::path& root) {
  std::vector<std::uint64_t> steps;
  for (const auto& entry : list_steps(root)) steps.push_back(entry.step);
  return steps;
}

// Directory entries whose name starts with `prefix`.
std::vector<fs::path> entries_starting_with(const fs::path& root, const std::string& prefix) {
  std::vector<fs::path> found;
  for (const auto& entry : fs::directory_iterator(root)) {
    if (entry.path().filename().string().starts_with(prefix)) found.push_back(entry.path());
  }
  return found;
}

std::vector<std::string> all_names(const fs::path& root) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(root)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// Holds the remover thread at "remover.before_remove" (before it deletes anything) until
// release(). The hook is global and runs on the remover thread: it is installed only while no
// removal is pending, and removed only after release and a drain, so no removal can run the hook
// after this object (which it captures) is gone, even when an assertion returns early.
class BlockingRemoverHook {
 public:
  BlockingRemoverHook() : released_(release_.get_future().share()) {
    detail::wait_for_background_removals();
    detail::set_fault_hook([this](std::string_view point, int) {
      if (point != "remover.before_remove") return;
      if (std::this_thread::get_id() == test_thread_) {
        // Removal on the saving thread: not in the background. Recorded (the test fails),
        // not blocked (the test would hang instead).
        on_test_thread_ = true;
        return;
      }
      {
        std::lock_guard lock(mutex_);
        if (!entered_set_) {
          entered_set_ = true;
          entered_.set_value();
        }
      }
      released_.wait();
    });
  }
  ~BlockingRemoverHook() {
    release();
    detail::wait_for_background_removals();
    detail::set_fault_hook(nullptr);
  }
  BlockingRemoverHook(const BlockingRemoverHook&) = delete;
  BlockingRemoverHook& operator=(const BlockingRemoverHook&) = delete;

  // True once the remover thread is inside a removal (a generous bound, only against hangs).
  bool wait_until_entered() { return entered_future_.wait_for(std::chrono::seconds(60)) == std::future_status::ready; }
  void release() {
    std::call_once(released_once_, [&] { release_.set_value(); });
  }
  bool ran_on_test_thread() const { return on_test_thread_; }

 private:
  const std::thread::id test_thread_ = std::this_thread::get_id();
  std::mutex mutex_;
  std::promise<void> entered_;
  std::future<void> entered_future_ = entered_.get_future();
  bool entered_set_ = false;
  std::promise<void> release_;
  std::shared_future<void> released_;
  std::once_flag released_once_;
  std::atomic<bool> on_test_thread_{false};
};

TEST(CkptRemover, KeepLastOneLeavesOnlyTheNewestStepOnceDrained) {
  TempDir dir;
  for (std::uint64_t step = 1; step <= 5; ++step) {
    const std::int32_t v = static_cast<std::int32_t>(step);
    const SaveResult result = save_values(dir.path(), step, {v, v, v}, keep_last(1));
    EXPECT_TRUE(result.warnings.empty()) << result.warnings.front();
    // Whatever the remover has done so far, readers see exactly the step just saved.
    EXPECT_EQ(listed_steps(dir.path()), (std::vector<std::uint64_t>{step}));
  }
  detail::wait_for_background_removals();
  EXPECT_EQ(all_names(dir.path()), (std::vector<std::string>{"latest", "step-000000005"}));
  const auto restored = restore_values(dir.path());
  ASSERT_TRUE(restored.has_value());
  EXPECT_EQ(restored->first, 5U);
  EXPECT_EQ(restored->second, (std::vector<std::int32_t>{5, 5, 5}));
}

TEST(CkptRemover, SaveReturnsWhileTheRetiredStepIsStillBeingRemoved) {
  TempDir dir;
  save_values(dir.path(), 1, {1, 1, 1}, keep_last(1));
  BlockingRemoverHook hook;
  const SaveResult result = save_values(dir.path(), 2, {2, 2, 2}, keep_last(1));
  // The save has returned; the remover thread is (or will be) held before deleting step 1.
  EXPECT_TRUE(result.warnings.empty()) << result.warnings.front();
  ASSERT_FALSE(hook.ran_on_test_thread()) << "the retired step was removed by the saving thread";
  ASSERT_TRUE(hook.wait_until_entered()) << "the remover never started removing step 1";
  EXPECT_FALSE(fs::exists(dir.path() / "step-000000001"));
  const auto doomed = entries_starting_with(dir.path(), "step-000000001.deleting-");
  ASSERT_EQ(doomed.size(), 1U) << "step 1 was not renamed to a .deleting- name";
  EXPECT_TRUE(fs::exists(doomed[0] / "index.h5")) << "removed before the save returned";
  EXPECT_TRUE(detail::removal_pending(doomed[0]));
  EXPECT_TRUE(detail::removal_pending(dir.path() / "." / doomed[0].filename()));  // same path
  EXPECT_FALSE(detail::removal_pending(dir.path() / "step-000000002"));
  // Readers ignore the .deleting- copy.
  EXPECT_EQ(listed_steps(dir.path()), (std::vector<std::uint64_t>{2}));
  const auto restored = restore_values(dir.path());
  ASSERT_TRUE(restored.has_value());
  EXPECT_EQ(restored->first, 2U);
  EXPECT_EQ(restored->second, (std::vector<std::int32_t>{2, 2, 2}));

  hook.release();
  detail::wait_for_background_removals();
  EXPECT_FALSE(fs::exists(doomed[0]));
  EXPECT_FALSE(detail::removal_pending(doomed[0]));
  EXPECT_EQ(all_names(dir.path()), (std::vector<std::string>{"latest", "step-000000002"}));
}

TEST(CkptRemover, NextSaveLeavesPendingRemovalAloneButRemovesCrashLeftovers) {
  TempDir dir;
  save_values(dir.path(), 1, {1, 1, 1}, keep_last(1));
  BlockingRemoverHook hook;
  save_values(dir.path(), 2, {2, 2, 2}, keep_last(1));
  ASSERT_FALSE(hook.ran_on_test_thread());
  ASSERT_TRUE(hook.wait_until_entered());
  const auto doomed = entries_starting_with(dir.path(), "step-000000001.deleting-");
  ASSERT_EQ(doomed.size(), 1U);
  // A leftover of a process killed while deleting (nobody is removing it).
  const fs::path leftover = dir.path() / "step-000000005.deleting-abc";
  fs::create_directories(leftover / "sub");
  std::ofstream(leftover / "sub" / "shard-00000-of-00001.h5") << "data";
  EXPECT_FALSE(detail::removal_pending(leftover));

  SaveResult result;
  ASSERT_NO_THROW(result = save_values(dir.path(), 3, {3, 3, 3}, keep_last(1)));
  EXPECT_TRUE(result.warnings.empty()) << result.warnings.front();
  EXPECT_FALSE(fs::exists(leftover)) << "the crash leftover was not removed by the next save";
  // Still held by the remover: untouched by the synchronous housekeeping, contents included.
  EXPECT_TRUE(fs::exists(doomed[0] / "index.h5"));
  EXPECT_TRUE(detail::removal_pending(doomed[0]));
  // The same through the public entry point, with the root spelled differently.
  ASSERT_NO_THROW(remove_partial_directories(dir.path() / "."));
  EXPECT_TRUE(fs::exists(doomed[0] / "index.h5"));
  // Step 2 was retired by save 3 and queued behind step 1.
  EXPECT_EQ(entries_starting_with(dir.path(), "step-000000002.deleting-").size(), 1U);
  EXPECT_EQ(listed_steps(dir.path()), (std::vector<std::uint64_t>{3}));
  const auto restored = restore_values(dir.path());
  ASSERT_TRUE(restored.has_value());
  EXPECT_EQ(restored->first, 3U);

  hook.release();
  detail::wait_for_background_removals();
  EXPECT_FALSE(hook.ran_on_test_thread());
  EXPECT_EQ(all_names(dir.path()), (std::vector<std::string>{"latest", "step-000000003"}));
}

// Re-saving a step: the replaced copy leaves its old name (".replaced-" would still count as the
// step if the new one went missing) before the remover deletes it.
struct ExchangeDisabled {
  explicit ExchangeDisabled(bool disabled) { detail::set_rename_exchange_disabled(disabled); }
  ~ExchangeDisabled() { detail::set_rename_exchange_disabled(false); }
  ExchangeDisabled(const ExchangeDisabled&) = delete;
  ExchangeDisabled& operator=(const ExchangeDisabled&) = delete;
};

TEST(CkptRemover, ReplacedCopyIsRenamedBeforeBackgroundRemoval) {
  for (bool exchange_disabled : {false, true}) {
    SCOPED_TRACE(exchange_disabled ? "two-rename fallback" : "RENAME_EXCHANGE");
    TempDir dir;
    save_values(dir.path(), 7, {1, 1, 1}, keep_last(0));
    {
      BlockingRemoverHook hook;
      SaveResult result;
      {
        ExchangeDisabled exchange(exchange_disabled);
        result = save_values(dir.path(), 7, {2, 2, 2}, keep_last(0));
      }
      EXPECT_TRUE(result.warnings.empty()) << result.warnings.front();
      ASSERT_FALSE(hook.ran_on_test_thread());
      ASSERT_TRUE(hook.wait_until_entered());
      EXPECT_TRUE(entries_starting_with(dir.path(), "step-000000007.replaced-").empty());
      EXPECT_TRUE(entries_starting_with(dir.path(), "step-000000007.tmp-").empty());
      const auto doomed = entries_starting_with(dir.path(), "step-000000007.deleting-");
      ASSERT_EQ(doomed.size(), 1U);
      EXPECT_TRUE(detail::removal_pending(doomed[0]));
      const auto steps = list_steps(dir.path());
      ASSERT_EQ(steps.size(), 1U);
      EXPECT_EQ(steps[0].path.filename(), "step-000000007");
      const auto restored = restore_values(dir.path());
      ASSERT_TRUE(restored.has_value());
      EXPECT_EQ(restored->second, (std::vector<std::int32_t>{2, 2, 2}));
    }
    EXPECT_EQ(all_names(dir.path()), (std::vector<std::string>{"latest", "step-000000007"}));
  }
}

// ---- process exit ----------------------------------------------------------------------------

// Set by an atexit handler registered after the remover exists, so it runs before the remover's
// static destructor: the remover's hook waits for it, so the removal happens during exit().
std::atomic<bool> exiting{false};

[[noreturn]] void save_then_exit(const fs::path& root) {
  save_values(root, 1, {1, 1, 1}, keep_last(1));
  save_values(root, 2, {2, 2, 2}, keep_last(1));  // retires step 1: the remover now exists
  detail::wait_for_background_removals();
  std::atexit([] {
    exiting = true;
    exiting.notify_all();
  });
  detail::set_fault_hook([root, saver = std::this_thread::get_id()](std::string_view point, int) {
    if (point != "remover.before_remove") return;
    if (std::this_thread::get_id() == saver) return;  // not in the background: no marker
    exiting.wait(false);
    std::ofstream(root / "removed-during-exit") << "yes";
  });
  save_values(root, 3, {3, 3, 3}, keep_last(1));
  std::exit(0);  // runs static destructors: the remover finishes step 2, then joins
}

TEST(CkptRemoverDeathTest, ExitFinishesQueuedRemovals) {
  // "threadsafe" re-executes the test binary: a fresh process whose remover thread is its own
  // (a plain fork() of a process that already has one removes synchronously instead).
  const std::string style = GTEST_FLAG_GET(death_test_style);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // Named after the parent's pid, so the re-executed child (whose parent is this process)
  // finds the same directory.
  auto root_for = [](pid_t parent) {
    return fs::temp_directory_path() / ("elastrun-ckpt-remover-exit-" + std::to_string(static_cast<long>(parent)));
  };
  const fs::path root = root_for(::getpid());
  std::error_code ec;
  fs::remove_all(root, ec);
  EXPECT_EXIT(save_then_exit(root_for(::getppid())), ::testing::ExitedWithCode(0), "");
  GTEST_FLAG_SET(death_test_style, style);
  EXPECT_TRUE(fs::exists(root / "removed-during-exit")) << "no removal ran during exit()";
  EXPECT_TRUE(fs::exists(root / "step-000000003"));
  if (fs::exists(root)) {
    EXPECT_TRUE(entries_starting_with(root, "step-000000001").empty()) << "left after exit()";
    EXPECT_TRUE(entries_starting_with(root, "step-000000002").empty()) << "left after exit()";
  }
  fs::remove_all(root, ec);
}

}  // namespace
}  // namespace elastrun::ckpt
