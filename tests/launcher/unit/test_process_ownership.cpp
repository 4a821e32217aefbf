// Who owns which child of the agent: the reaper hands each exit to the part that started the
// process, an unowned child is an adopted orphan (reaped; ended by kill_unowned once the workers
// are gone), and a WorkerGroup started through the exec backend stops its own workers without
// touching a process another part owns (a long-lived preloader must survive every attempt).
// Real processes, this test process as the subreaper.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <thread>

#include "node_runtime.hpp"
#include "reaper.hpp"
#include "workers.hpp"

namespace elastrun::launcher {
namespace {

using namespace std::chrono_literals;

pid_t start_child(int exit_code, std::chrono::milliseconds after) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::this_thread::sleep_for(after);
    ::_exit(exit_code);
  }
  return pid;
}

bool alive(pid_t pid) { return ::kill(pid, 0) == 0; }

// Reaps until `done` or 10 s.
template <class Done>
void reap_until(Reaper& reaper, Done done) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!done() && std::chrono::steady_clock::now() < deadline) {
    reaper.reap();
    std::this_thread::sleep_for(5ms);
  }
}

WorkerSpec shell_worker(int local_rank, const std::string& script) {
  WorkerSpec spec;
  spec.local_rank = spec.global_rank = local_rank;
  spec.path = "/bin/sh";
  spec.argv = {"sh", "-c", script};
  spec.env = {"PATH=/usr/bin:/bin"};
  spec.console_stdout = spec.console_stderr = false;
  return spec;
}

TEST(Reaper, HandsEachExitToItsOwner) {
  Reaper reaper;
  std::map<pid_t, int> seen;
  const pid_t a = start_child(3, 0ms), b = start_child(0, 50ms);
  reaper.own(a, [&](pid_t pid, int status) { seen[pid] = WEXITSTATUS(status); });
  reaper.own(b, [&](pid_t pid, int status) { seen[pid] = WEXITSTATUS(status) + 100; });
  reap_until(reaper, [&] { return seen.size() == 2; });
  EXPECT_EQ(seen[a], 3);
  EXPECT_EQ(seen[b], 100);
  EXPECT_FALSE(reaper.owns(a)) << "an owner hears of an exit once";
}

TEST(Reaper, UnownedChildIsReapedAsAnOrphan) {
  Reaper reaper;
  const pid_t orphan = start_child(7, 0ms);
  bool owner_called = false;
  const pid_t owned = start_child(0, 2000ms);
  reaper.own(owned, [&](pid_t, int) { owner_called = true; });
  reap_until(reaper, [&] { return ::waitpid(orphan, nullptr, WNOHANG) < 0 && errno == ECHILD; });
  EXPECT_LT(::waitpid(orphan, nullptr, WNOHANG), 0) << "the orphan was reaped by reap()";
  EXPECT_FALSE(owner_called);
  EXPECT_TRUE(reaper.owns(owned));
  ::kill(owned, SIGKILL);
  reap_until(reaper, [&] { return owner_called; });
  EXPECT_TRUE(owner_called);
}

TEST(Reaper, KillUnownedSparesOwnedChildren) {
  Reaper reaper;
  const pid_t orphan = start_child(0, 60'000ms), owned = start_child(0, 60'000ms);
  int owned_status = -1;
  reaper.own(owned, [&](pid_t, int status) { owned_status = status; });
  const auto killed = reaper.kill_unowned();
  ASSERT_EQ(killed, std::vector<pid_t>{orphan});
  EXPECT_FALSE(alive(orphan));
  EXPECT_TRUE(alive(owned));
  ::kill(owned, SIGKILL);
  reap_until(reaper, [&] { return owned_status != -1; });
  EXPECT_TRUE(WIFSIGNALED(owned_status) && WTERMSIG(owned_status) == SIGKILL);
}

// The exec backend behind a WorkerGroup: exits classified, an exec failure named, and stopping
// the group ends what a worker left behind (setsid: reparented to us) but not another part's
// long-lived process -- which still hears of its own exit afterwards.
TEST(WorkerGroup, ExecBackendStopsItsOwnAndSparesOthers) {
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  NodeRuntime runtime(1000ms);
  int long_lived_status = -1;
  const pid_t long_lived = start_child(0, 60'000ms);  // e.g. a preloader
  runtime.reaper().own(long_lived, [&](pid_t, int status) { long_lived_status = status; });

  std::vector<WorkerSpec> specs = {shell_worker(0, "exit 3"), shell_worker(1, "exec sleep 60"),
                                   shell_worker(2, "exit 85"), shell_worker(3, "setsid sleep 61 & exit 0")};
  WorkerSpec missing = shell_worker(4, "");
  missing.path = "/nonexistent/elastrun-test-program";
  specs.push_back(missing);
  WorkerGroup group(std::move(specs), runtime.process_backend());
  std::map<int, WorkerExit> exits;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (exits.size() < 4 && std::chrono::steady_clock::now() < deadline) {
    for (auto& e : group.poll_exits()) exits[e.local_rank] = e;
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(exits.size(), 4u) << "every worker but the sleeper exited";
  EXPECT_EQ(classify(exits[0]), ExitKind::Failed);
  EXPECT_EQ(exits[0].exit_code, 3);
  EXPECT_EQ(classify(exits[2]), ExitKind::Checkpointed);
  EXPECT_EQ(classify(exits[3]), ExitKind::Finished);
  EXPECT_EQ(exits[4].exit_code, 127);
  EXPECT_NE(exits[4].exec_error.find("cannot execute /nonexistent/elastrun-test-program"), std::string::npos);
  EXPECT_FALSE(group.all_exited());

  std::vector<pid_t> before = Reaper::children();
  const auto stopped = group.stop(100ms);
  ASSERT_EQ(stopped.size(), 1u);
  EXPECT_EQ(stopped[0].local_rank, 1);
  EXPECT_EQ(stopped[0].signal, SIGTERM);
  EXPECT_TRUE(alive(long_lived)) << "a process another part owns survives the group's stop";
  EXPECT_EQ(Reaper::children().size(), 2u) << "left: the watchdog and the long-lived process";
  EXPECT_GT(before.size(), 2u) << "the setsid sleeper was a child of ours before the stop";

  ::kill(long_lived, SIGKILL);
  reap_until(runtime.reaper(), [&] { return long_lived_status != -1; });
  EXPECT_TRUE(WIFSIGNALED(long_lived_status)) << "its exit reached its owner, not the group";
  EXPECT_EQ(runtime.status_reply().value("process_backend", ""), "exec");
}

TEST(ExitClassification, TallyAfterACheckpointRequest) {
  auto exit_with = [](int code, int sig = 0) {
    WorkerExit e;
    e.exit_code = code;
    e.signal = sig;
    return e;
  };
  auto t = tally_checkpoint({exit_with(85), exit_with(0)}, 2);
  EXPECT_TRUE(t.complete);
  EXPECT_FALSE(t.all_finished);
  t = tally_checkpoint({exit_with(0), exit_with(0)}, 2);
  EXPECT_TRUE(t.all_finished);
  EXPECT_FALSE(t.complete) << "nothing checkpointed: the training ended";
  t = tally_checkpoint({exit_with(85), exit_with(0, SIGKILL)}, 2);
  EXPECT_FALSE(t.complete) << "a rank that died has no checkpoint";
  EXPECT_EQ(t.checkpointed, 1);
  EXPECT_EQ(to_string(classify(exit_with(85, SIGTERM))), "failed");
  EXPECT_EQ(to_string(classify(exit_with(1))), "failed");
}

}  // namespace
}  // namespace elastrun::launcher
