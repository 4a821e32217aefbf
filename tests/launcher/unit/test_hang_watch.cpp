// Hung workers (hang_watch.hpp): torch's FileTimer requests and table, the FIFO server, is_hung.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <string>

#include "hang_watch.hpp"
#include "temp_dir.hpp"

namespace elastrun::launcher {
namespace {

using test_support::TempDir;

TEST(HangWatch, ParsesWhatFileTimerClientWrites) {
  // torch.distributed.elastic.timer.FileTimerRequest.to_json()
  auto r = parse_timer_request(
      R"({"version": 1, "pid": 42, "scope_id": "step", "expiration_time": 1700000000.5, "signal": 9})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->pid, 42);
  EXPECT_EQ(r->scope, "step");
  EXPECT_DOUBLE_EQ(r->expiration, 1700000000.5);
  EXPECT_EQ(r->signal, 9);
  auto release =
      parse_timer_request(R"({"version": 1, "pid": 42, "scope_id": "step", "expiration_time": -1, "signal": 0})");
  ASSERT_TRUE(release);
  EXPECT_LT(release->expiration, 0);
  for (const char* bad : {"", "[]", "{}", R"({"pid": "42", "scope_id": "s", "expiration_time": 1})",
                          R"({"pid": 0, "scope_id": "s", "expiration_time": 1})", "not json {"})
    EXPECT_FALSE(parse_timer_request(bad)) << bad;
}

TEST(HangWatch, TimerTableExpiresPerPidAndReleases) {
  TimerTable t;
  t.apply({10, "a", 100, 9});
  t.apply({10, "b", 90, 0});  // earlier, but asks for no signal
  t.apply({11, "a", 200, 15});
  t.apply({12, "x", 50, 9});
  t.apply({12, "x", -1, 0});  // released
  EXPECT_TRUE(t.take_expired(80).empty());
  auto expired = t.take_expired(150);
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].pid, 10);
  EXPECT_EQ(expired[0].scope, "a") << "the earliest timer that carries a signal";
  EXPECT_EQ(expired[0].signal, 9);
  EXPECT_EQ(t.size(), 1u) << "all of pid 10's timers are cleared";
  expired = t.take_expired(300);
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].pid, 11);
  EXPECT_EQ(t.size(), 0u);
}

TEST(HangWatch, FileTimerServerReadsTheFifoAsTheClientWritesIt) {
  TempDir dir;
  const auto fifo = dir.path() / "watchdog_timer";
  FileTimerServer server(fifo);
  // FileTimerClient: open O_WRONLY|O_NONBLOCK per request, one line, close
  auto send = [&](const std::string& line) {
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, line.data(), line.size()), static_cast<ssize_t>(line.size()));
    ::close(fd);
  };
  send(R"({"version": 1, "pid": 77, "scope_id": "s", "expiration_time": 1000, "signal": 9})"
       "\n");
  send(R"({"version": 1, "pid": 78, "scope_id": "s", "expiration_time": 5000, "signal": 9})"
       "\n"
       "garbage line\n");
  EXPECT_TRUE(server.poll(999).empty());
  auto expired = server.poll(1001);
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].pid, 77);
  send(R"({"version": 1, "pid": 78, "scope_id": "s", "expiration_time": -1, "signal": 0})"
       "\n");
  EXPECT_TRUE(server.poll(6000).empty()) << "released before it expired";
}

TEST(HangWatch, HungOnlyAfterProgressWasReportedOnce) {
  EXPECT_FALSE(is_hung(std::nullopt, 1000, 5)) << "never reported: not watched (opt-in)";
  EXPECT_FALSE(is_hung(996, 1000, 5));
  EXPECT_TRUE(is_hung(994, 1000, 5));
  EXPECT_FALSE(is_hung(900, 1000, 0)) << "no --hang-timeout";
}

TEST(HangWatch, NativeStacksOfALiveProcessNameItsThreads) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  const auto stacks = native_stacks(child, 60);
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_FALSE(stacks.empty());
  EXPECT_TRUE(stacks.find("Thread ") != std::string::npos || stacks.find("wchan") != std::string::npos) << stacks;
}

}  // namespace
}  // namespace elastrun::launcher
