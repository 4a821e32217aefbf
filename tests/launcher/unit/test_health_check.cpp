// The node's health checks (health_check.hpp): each judgement over canned readings (a faked
// clock offset, a faked /proc/meminfo, GPU counts), the site command run for real, and the
// checkpoint directory check between "nodes" that share a real store but not the directory.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>

#include "elastrun/rdzv/store.hpp"
#include <thread>

#include "health_check.hpp"
#include "reaper.hpp"
#include "temp_dir.hpp"

namespace elastrun::launcher {
namespace {

using namespace std::chrono_literals;
using test_support::TempDir;

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(HealthCheck, ACommandPassesWhenItExitsZeroAndFailsWithWhatItSaidLast) {
  const auto ok = run_captured({"/bin/sh", "-c", "echo fine"}, 10s);
  EXPECT_TRUE(judge_command("true-ish", ok, 10s).ok);
  const auto bad =
      run_captured({"/bin/sh", "-c", "echo checking; echo 'GPU 2: 3 uncorrectable ECC errors' >&2; exit 3"}, 10s);
  EXPECT_EQ(bad.exit_code, 3);
  const auto v = judge_command("/site/check", bad, 10s);
  EXPECT_FALSE(v.ok);
  EXPECT_EQ(v.check, "command");
  EXPECT_EQ(v.what, "'/site/check' exited 3: GPU 2: 3 uncorrectable ECC errors");
}

TEST(HealthCheck, ACommandThatHangsIsKilledAtTheDeadlineWithWhatItStartedAndFails) {
  const auto t0 = std::chrono::steady_clock::now();
  // the command backgrounds a child of its own: the whole group goes
  const auto out = run_captured({"/bin/sh", "-c", "sleep 60 & echo waiting; sleep 60"}, 300ms);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_TRUE(out.timed_out);
  const auto v = judge_command("slow", out, 300ms);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(has(v.what, "did not finish within")) << v.what;
  EXPECT_TRUE(has(v.what, "waiting")) << v.what;
}

TEST(HealthCheck, ACommandThatCannotRunOrIsKilledFails) {
  auto missing = run_captured({"/nonexistent/check"}, 5s);
  EXPECT_EQ(missing.exit_code, 127);
  EXPECT_FALSE(judge_command("/nonexistent/check", missing, 5s).ok);
  auto killed = run_captured({"/bin/sh", "-c", "kill -9 $$"}, 5s);
  const auto v = judge_command("k", killed, 5s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(has(v.what, "killed by SIGKILL")) << v.what;
}

TEST(HealthCheck, GpusAllocatedMustBeThere) {
  GpuSet four{{"0", "1", "2", "3"}, "SLURM_STEP_GPUS", true};
  EXPECT_TRUE(judge_gpus(GpuSet{}, 0, std::nullopt, "").ok);  // none asked for
  EXPECT_TRUE(judge_gpus(four, 4, 4, "").ok);
  EXPECT_TRUE(judge_gpus(four, 8, std::nullopt, "").ok);  // no nvidia-smi: the device files
  const auto fewer_files = judge_gpus(four, 3, std::nullopt, "");
  EXPECT_FALSE(fewer_files.ok);
  EXPECT_TRUE(has(fewer_files.what, "4 GPU(s) allocated (SLURM_STEP_GPUS) but this node has 3")) << fewer_files.what;
  const auto fallen_off = judge_gpus(four, 4, 3, "");  // "GPU has fallen off the bus": smi lists fewer
  EXPECT_FALSE(fallen_off.ok);
  EXPECT_TRUE(has(fallen_off.what, "nvidia-smi -L lists 3")) << fallen_off.what;
  const auto smi_failed = judge_gpus(four, 4, 0, "NVIDIA-SMI has failed because it couldn't communicate");
  EXPECT_FALSE(smi_failed.ok);
  EXPECT_TRUE(has(smi_failed.what, "nvidia-smi -L failed: NVIDIA-SMI has failed")) << smi_failed.what;
}

TEST(HealthCheck, MemoryForTheMemoryTierFromAFakedMeminfo) {
  TempDir dir;
  const auto meminfo = dir.path() / "meminfo";
  std::ofstream(meminfo) << "MemTotal:       65536000 kB\nMemFree:         1000000 kB\nMemAvailable:    2097152 kB\n";
  const auto available = mem_available_bytes(meminfo);
  ASSERT_TRUE(available);
  EXPECT_EQ(*available, 2097152ull * 1024);
  EXPECT_TRUE(judge_memory(std::nullopt, available).ok);  // no memory tier
  EXPECT_TRUE(judge_memory(1ull << 30, available).ok);
  const auto v = judge_memory(4ull << 30, available);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(has(v.what, "MemAvailable is 2048 MiB, less than the memory tier's budget of 4096 MiB")) << v.what;
  EXPECT_FALSE(mem_available_bytes(dir.path() / "none"));
}

TEST(HealthCheck, AFullDevShmFails) {
  EXPECT_FALSE(judge_shm(FsSpace{64ull << 30, 10ull << 20}).ok);  // 10 MiB of 64 GiB
  EXPECT_TRUE(judge_shm(FsSpace{64ull << 30, 1ull << 30}).ok);
  EXPECT_TRUE(judge_shm(FsSpace{64ull << 20, 64ull << 20}).ok);  // docker's 64 MiB default, empty
  EXPECT_FALSE(judge_shm(FsSpace{64ull << 20, 1ull << 20}).ok);
  EXPECT_TRUE(judge_shm(std::nullopt).ok);
  EXPECT_TRUE(fs_space("/"));
}

TEST(HealthCheck, AClockOffFromTheStoreHostByMoreThanASecondFails) {
  using Reading = rdzv::Rendezvous::ClockReading;
  // the store's host answered 2.5 s ahead of the midpoint of a 4 ms round trip
  const auto behind = judge_clock(Reading{1'000'000, 1'002'502, 1'000'004}, "n1");
  EXPECT_FALSE(behind.ok);
  EXPECT_TRUE(has(behind.what, "2.500 s behind the store's host n1 (+-2 ms)")) << behind.what;
  const auto ahead = judge_clock(Reading{1'000'000, 998'000, 1'000'000}, "n1");
  EXPECT_FALSE(ahead.ok);
  EXPECT_TRUE(has(ahead.what, "2.000 s ahead of the store's host n1")) << ahead.what;
  EXPECT_TRUE(judge_clock(Reading{1'000'000, 1'000'300, 1'000'010}, "n1").ok);
  // 1.5 s off, but a 3 s round trip cannot tell: not failed on a guess
  EXPECT_TRUE(judge_clock(Reading{1'000'000, 1'003'000, 1'003'000}, "n1").ok);
  const auto etcd = judge_clock(std::nullopt, "etcd");
  EXPECT_TRUE(etcd.ok);
  EXPECT_TRUE(has(etcd.what, "not checked")) << etcd.what;
}

// An embedded store and a member on it, as an agent has them before it joins.
struct StoreAndMember {
  rdzv::StoreServer server{[] {
    rdzv::StoreServerOptions o;
    o.bind_address = "127.0.0.1";
    o.run_id = "hc";
    return o;
  }()};
  std::unique_ptr<rdzv::Rendezvous> member(const std::string& name) {
    rdzv::MemberInfo me;
    me.node_name = name;
    me.address = "127.0.0.1";
    rdzv::RendezvousConfig cfg;
    cfg.run_id = "hc";
    return std::make_unique<rdzv::Rendezvous>(
        std::make_unique<rdzv::StoreClient>("127.0.0.1", server.port(), rdzv::AuthConfig{}, "hc"),
        std::make_unique<rdzv::StoreClient>("127.0.0.1", server.port(), rdzv::AuthConfig{}, "hc"), cfg, me);
  }
};

TEST(HealthCheck, TheStoreSaysItsTimeAndThisMachineAgreesWithItself) {
  StoreAndMember s;
  auto n1 = s.member("n1");
  const auto reading = n1->store_clock();
  ASSERT_TRUE(reading);
  EXPECT_LE(reading->before_ms, reading->store_ms + 5);
  EXPECT_LE(reading->store_ms, reading->after_ms + 5);
  EXPECT_TRUE(judge_clock(reading, "n1").ok);
}

TEST(HealthCheck, TheCheckpointDirectoryMustBeTheOneTheOtherNodesSee) {
  StoreAndMember s;
  TempDir shared, local;
  auto n1 = s.member("n1"), n2 = s.member("n2"), n3 = s.member("n3");
  std::filesystem::path m1, m2, m3;
  const auto first = check_checkpoint_dir((shared.path() / "ckpt").string(), *n1, "n1", "hc", m1);
  EXPECT_TRUE(first.ok) << first.what;
  EXPECT_TRUE(has(first.what, "the first node to check it")) << first.what;
  EXPECT_TRUE(std::filesystem::exists(m1));
  const auto second = check_checkpoint_dir((shared.path() / "ckpt").string(), *n2, "n2", "hc", m2);
  EXPECT_TRUE(second.ok) << second.what;
  EXPECT_TRUE(has(second.what, "shared with n1")) << second.what;
  // n3 mounted nothing there: its own directory of the same name holds no marker of the others
  const auto odd = check_checkpoint_dir((local.path() / "ckpt").string(), *n3, "n3", "hc", m3);
  EXPECT_FALSE(odd.ok);
  EXPECT_EQ(odd.check, "checkpoint-dir");
  EXPECT_TRUE(has(odd.what, "is not the directory n1, n2 see(s)")) << odd.what;
  // a node that leaves withdraws its marker first: nobody looks for it after
  remove_checkpoint_dir_marker(m1, n1.get(), "n1");
  EXPECT_FALSE(std::filesystem::exists(m1));
  std::filesystem::path m3_again;
  const auto again = check_checkpoint_dir((shared.path() / "ckpt").string(), *n3, "n3", "hc", m3_again);
  EXPECT_TRUE(again.ok) << again.what;
  EXPECT_TRUE(has(again.what, "shared with n2")) << again.what;
  // not writable
  std::filesystem::path none;
  const auto ro = check_checkpoint_dir("/proc/elastrun-ckpt", *n2, "n2", "hc", none);
  EXPECT_FALSE(ro.ok);
}

// While workers run (--health-check-interval) the command runs in the background: the agent's
// reaper reaps it in its rounds and hands its status over; nothing blocks meanwhile.
TEST(HealthCheck, ABackgroundCommandIsReapedByTheReaperAndKilledAtItsDeadline) {
  Reaper reaper;
  const auto finish = [&](BackgroundCommand& c) {
    for (int i = 0; i < 500; ++i) {
      reaper.reap();
      if (auto out = c.poll()) return out;
      std::this_thread::sleep_for(10ms);
    }
    return std::optional<CommandOutput>();
  };
  BackgroundCommand failing({"/bin/sh", "-c", "echo 'GPU 1: XID 79'; exit 4"}, 10s, reaper);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(BackgroundCommand({"/bin/sh", "-c", "sleep 5"}, 10s, reaper).poll()) << "a running one: not done";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s) << "starting and polling do not wait for it";
  const auto out = finish(failing);
  ASSERT_TRUE(out);
  EXPECT_EQ(out->exit_code, 4);
  EXPECT_EQ(judge_command("gpu-ok", *out, 10s).what, "'gpu-ok' exited 4: GPU 1: XID 79");
  BackgroundCommand slow({"/bin/sh", "-c", "sleep 30"}, 200ms, reaper);
  const auto killed = finish(slow);
  ASSERT_TRUE(killed);
  EXPECT_TRUE(killed->timed_out);
  EXPECT_FALSE(judge_command("slow", *killed, 200ms).ok);
  BackgroundCommand missing({"/nonexistent/check"}, 5s, reaper);
  const auto not_run = finish(missing);
  ASSERT_TRUE(not_run);
  EXPECT_EQ(not_run->exit_code, 127);
  for (int i = 0; i < 100 && !Reaper::children().empty(); ++i) {  // the sleep 5 killed by its destructor
    reaper.reap();
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(Reaper::children().empty()) << "a child left running";
}

TEST(HealthCheck, ChecksRunInOrderAndStopAtTheFirstFailure) {
  HealthContext c;
  c.commands = {"exit 0", "echo 'disk /scratch read-only'; exit 1", "touch /should/not/run"};
  std::filesystem::path marker;
  const auto verdicts = run_health_checks(c, marker);
  ASSERT_EQ(verdicts.size(), 2u);
  EXPECT_TRUE(verdicts[0].ok);
  EXPECT_FALSE(verdicts[1].ok);
  EXPECT_EQ(verdicts[1].what, "'echo 'disk /scratch read-only'; exit 1' exited 1: disk /scratch read-only");
}

}  // namespace
}  // namespace elastrun::launcher
