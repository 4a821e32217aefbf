// Disk full during a save, on a real (tiny) tmpfs: the save fails with CheckpointError, the
// previous step stays the one restored, and no HDF5 handle of the failed save is left open --
// one was, and HDF5's atexit close of it crashed the worker at exit (SIGSEGV in 2 of 4 runs).
#include <sys/mount.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <hdf5.h>

#include "elastrun/ckpt/async_saver.hpp"
#include "test_support.hpp"

namespace elastrun::ckpt {
namespace {

using testing::TempDir;

// A tmpfs of `bytes` mounted on `path` for the test's lifetime (needs root).
class SmallFilesystem {
 public:
  SmallFilesystem(const std::filesystem::path& path, std::size_t bytes) : path_(path) {
    std::filesystem::create_directories(path);
    const std::string options = "size=" + std::to_string(bytes);
    mounted_ = ::mount("tmpfs", path.c_str(), "tmpfs", 0, options.c_str()) == 0;
  }
  ~SmallFilesystem() {
    if (mounted_) ::umount2(path_.c_str(), MNT_DETACH);
  }
  SmallFilesystem(const SmallFilesystem&) = delete;
  SmallFilesystem& operator=(const SmallFilesystem&) = delete;
  bool mounted() const { return mounted_; }

 private:
  std::filesystem::path path_;
  bool mounted_ = false;
};

ssize_t open_hdf5_objects() { return H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL); }

// 4 thread-ranks, each saving `floats` replicated floats of value `value` at `step`.
void save_replicated(const std::filesystem::path& root, std::uint64_t step, std::size_t floats, float value) {
  testing::run_ranks(4, [&](int, Communicator& comm) {
    std::vector<float> data(floats, value);
    auto view = TensorView::replicated("w", DType::float32, {floats}, data.data());
    save_checkpoint(root, step, std::span(&view, 1), nlohmann::json{{"step", step}}, comm);
  });
}

std::uint64_t restored_step(const std::filesystem::path& root, float* first_value) {
  SingleProcessCommunicator comm;
  std::vector<float> into(16);
  auto target = TensorTarget::whole("w", DType::float32, {16}, into.data());
  auto restored = restore_latest(root, std::span(&target, 1), comm);
  *first_value = into[0];
  return restored ? restored->step : 0;
}

TEST(CkptDiskFull, AFailedSyncSaveKeepsThePreviousStepAndNoHandleOpen) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to mount a small tmpfs";
  TempDir dir;
  SmallFilesystem small(dir.path() / "fs", 512 * 1024);
  if (!small.mounted()) GTEST_SKIP() << "cannot mount tmpfs here";
  const auto root = dir.path() / "fs" / "ckpt";
  save_replicated(root, 1, 16, 1.0f);
  const auto before = open_hdf5_objects();
  try {
    save_replicated(root, 2, 1 << 20, 2.0f);  // 4 MiB: no room
    ADD_FAILURE() << "a save onto a full filesystem succeeded";
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("No space left on device"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << "not one line: " << what;  // HDF5 embeds ctime()'s newline
  }
  EXPECT_EQ(open_hdf5_objects(), before) << "the failed save left HDF5 objects open";
  float value = 0;
  EXPECT_EQ(restored_step(root, &value), 1u);
  EXPECT_EQ(value, 1.0f);
  // and the space of the failed attempt is given back: a small save fits again
  save_replicated(root, 3, 16, 3.0f);
  EXPECT_EQ(restored_step(root, &value), 3u);
}

TEST(CkptDiskFull, AFailedAsyncSaveIsReportedKeepsThePreviousStepAndNoHandleOpen) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to mount a small tmpfs";
  for (auto snapshot : {AsyncSnapshot::copy, AsyncSnapshot::fork}) {
    SCOPED_TRACE(snapshot == AsyncSnapshot::copy ? "copy snapshot" : "fork snapshot");
    TempDir dir;
    SmallFilesystem small(dir.path() / "fs", 512 * 1024);
    if (!small.mounted()) GTEST_SKIP() << "cannot mount tmpfs here";
    const auto root = dir.path() / "fs" / "ckpt";
    save_replicated(root, 1, 16, 1.0f);
    const auto before = open_hdf5_objects();
    SaveOptions options;
    options.async_snapshot = snapshot;
    std::atomic<int> failures{0};
    testing::run_ranks(4, [&](int, Communicator& comm) {
      AsyncSaver saver(root, comm, options);
      std::vector<float> big(1 << 20, 2.0f);
      auto view = TensorView::replicated("w", DType::float32, {big.size()}, big.data());
      saver.save(2, std::span(&view, 1), nlohmann::json{{"step", 2}});
      try {
        saver.wait();
      } catch (const CheckpointError&) {
        ++failures;
      }
    });
    EXPECT_EQ(failures.load(), 4) << "every rank must see the failed save";
    EXPECT_EQ(open_hdf5_objects(), before) << "the failed save left HDF5 objects open";
    float value = 0;
    EXPECT_EQ(restored_step(root, &value), 1u);
  }
}

}  // namespace
}  // namespace elastrun::ckpt
