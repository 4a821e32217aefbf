// The control channel: the worker's reader (worker/include/elastrun/control.hpp) against the
// agent's writer (launcher/src/control_file.hpp) — the file format, atomic replacement, change
// detection by poll(), the "seen" marker, the signal handlers, and progress(step)'s record.
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "control_file.hpp"
#include "elastrun/control.hpp"
#include "hang_watch.hpp"

namespace control = elastrun::control;
namespace fs = std::filesystem;

namespace {

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "elastrun-control-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

}  // namespace

TEST(Control, ParseAndFormatRoundTrip) {
  for (auto request : {control::Request::None, control::Request::Checkpoint, control::Request::CheckpointAndStop}) {
    const control::Status s{request, 42};
    auto back = control::parse(elastrun::launcher::control_line(s));
    ASSERT_TRUE(back.has_value());
    EXPECT_EQ(back->request, request);
    EXPECT_EQ(back->sequence, 42u);
  }
  EXPECT_EQ(elastrun::launcher::control_line({control::Request::CheckpointAndStop, 3}), "3 checkpoint-and-stop\n");
}

TEST(Control, ParseRejectsMalformed) {
  for (const char* text : {"", "checkpoint", "1", "x checkpoint", "1 stop", " 1 none", "1  none", "-1 none"})
    EXPECT_FALSE(control::parse(text).has_value()) << "'" << text << "'";
}

TEST(Control, StatusPredicates) {
  EXPECT_FALSE((control::Status{control::Request::None, 0}).checkpoint());
  EXPECT_TRUE((control::Status{control::Request::Checkpoint, 1}).checkpoint());
  EXPECT_FALSE((control::Status{control::Request::Checkpoint, 1}).stop());
  EXPECT_TRUE((control::Status{control::Request::CheckpointAndStop, 2}).stop());
  EXPECT_EQ(control::kCheckpointedExitCode, 85);
}

TEST(Control, PollSeesEveryAtomicReplacement) {
  TempDir dir;
  const std::string path = (dir.path() / "control").string();
  control::Channel channel(path);
  ASSERT_TRUE(channel.enabled());
  EXPECT_EQ(channel.poll().request, control::Request::None);  // no file yet: the initial state
  EXPECT_TRUE(fs::exists(path + control::kSeenSuffix)) << "first poll() must leave the .seen marker";

  ASSERT_TRUE(elastrun::launcher::write_control_file(path, {control::Request::None, 0}));
  EXPECT_EQ(channel.poll().sequence, 0u);
  ASSERT_TRUE(elastrun::launcher::write_control_file(path, {control::Request::Checkpoint, 1}));
  auto s = channel.poll();
  EXPECT_EQ(s.request, control::Request::Checkpoint);
  EXPECT_EQ(s.sequence, 1u);
  EXPECT_EQ(channel.poll().sequence, 1u);  // unchanged file: same answer
  ASSERT_TRUE(elastrun::launcher::write_control_file(path, {control::Request::CheckpointAndStop, 2}));
  s = channel.poll();
  EXPECT_TRUE(s.stop());
  EXPECT_EQ(s.sequence, 2u);
  // no temporary file left behind by write_file
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 2);  // control, control.seen
}

TEST(Control, MalformedOrMissingFileKeepsLastState) {
  TempDir dir;
  const std::string path = (dir.path() / "control").string();
  control::Channel channel(path);
  ASSERT_TRUE(elastrun::launcher::write_control_file(path, {control::Request::Checkpoint, 5}));
  EXPECT_EQ(channel.poll().sequence, 5u);
  std::ofstream(path) << "garbage that is not a request\n";
  EXPECT_EQ(channel.poll().sequence, 5u);
  fs::remove(path);
  EXPECT_EQ(channel.poll().request, control::Request::Checkpoint);
  ASSERT_TRUE(elastrun::launcher::write_control_file(path, {control::Request::CheckpointAndStop, 6}));
  EXPECT_TRUE(channel.poll().stop());
}

TEST(Control, DisabledWithoutEnvironment) {
  ::unsetenv(control::kControlFileEnv);
  control::Channel channel;
  EXPECT_FALSE(channel.enabled());
  EXPECT_EQ(channel.poll().request, control::Request::None);
}

TEST(Control, ChannelFromEnvironment) {
  TempDir dir;
  const std::string path = (dir.path() / "control").string();
  ::setenv(control::kControlFileEnv, path.c_str(), 1);
  ::setenv(control::kCheckpointDirEnv, "/ckpt/dir", 1);
  control::Channel channel;
  EXPECT_EQ(channel.path(), path);
  ASSERT_TRUE(elastrun::launcher::write_control_file(path, {control::Request::CheckpointAndStop, 1}));
  EXPECT_TRUE(channel.poll().stop());
  EXPECT_EQ(control::checkpoint_dir(), "/ckpt/dir");
  ::unsetenv(control::kControlFileEnv);
  ::unsetenv(control::kCheckpointDirEnv);
}

// Last: installs process-wide handlers and raises SIGUSR1 (which would otherwise kill the test).
TEST(Control, SignalHandlersTurnSignalsIntoStopRequests) {
  ASSERT_TRUE(control::install_signal_handlers());
  EXPECT_EQ(control::signal_received(), 0);
  ASSERT_EQ(::raise(SIGUSR1), 0);
  EXPECT_EQ(control::signal_received(), SIGUSR1);
  EXPECT_TRUE(control::poll().stop());  // no control file in the environment: the signal alone
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig : {SIGUSR1, SIGUSR2, SIGTERM}) ::sigaction(sig, &dfl, nullptr);
}

namespace {

// progress(step) is the worker's half of the hang watch: the agent reads the step back.
TEST(Progress, StepRecordReadByTheAgent) {
  TempDir dir;
  const auto path = (dir.path() / "progress").string();
  ASSERT_EQ(::setenv("ELASTRUN_PROGRESS_FILE", path.c_str(), 1), 0);
  EXPECT_FALSE(elastrun::launcher::read_progress_step(path).has_value());  // no file yet
  control::progress();                                                     // without a step: the file exists, no step
  EXPECT_TRUE(fs::exists(path));
  EXPECT_FALSE(elastrun::launcher::read_progress_step(path).has_value());
  control::progress(7);
  EXPECT_EQ(elastrun::launcher::read_progress_step(path), 7);
  control::progress(123456789012);
  EXPECT_EQ(elastrun::launcher::read_progress_step(path), 123456789012);
  control::progress();  // keeps the step
  EXPECT_EQ(elastrun::launcher::read_progress_step(path), 123456789012);
  EXPECT_EQ(fs::file_size(path), elastrun::contract::kProgressRecordSize);
  EXPECT_FALSE(elastrun::launcher::parse_progress_record("garbage").has_value());
}

}  // namespace
