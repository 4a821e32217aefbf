// The event log: line format, appends from several writers, and the real agent's log of a run
// with a worker failure and a restart (standalone, real processes).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "events.hpp"
#include "options.hpp"
#include "temp_dir.hpp"

namespace elastrun::launcher {
namespace {

namespace fs = std::filesystem;

using test_support::TempDir;

std::vector<nlohmann::json> read_events(const fs::path& path) {
  std::vector<nlohmann::json> events;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    EXPECT_TRUE(j.is_object()) << "not a JSON object: " << line;
    if (j.is_object()) {
      EXPECT_EQ(j.value("v", 0), 1) << "not schema v1: " << line;
      events.push_back(std::move(j));
    }
  }
  return events;
}

TEST(Events, LineFormat) {
  const auto line = event_line(1700000000.12345, "n2", "12.r0", "round", {{"world_size", 6}});
  const auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j["v"], 1) << "schema v1 (docs/events.md)";
  EXPECT_EQ(line.rfind(R"({"v":1,"time":)", 0), 0u) << "the schema version comes first: " << line;
  EXPECT_DOUBLE_EQ(j["time"].get<double>(), 1700000000.123);
  EXPECT_EQ(j["node"], "n2");
  EXPECT_EQ(j["run_id"], "12.r0");
  EXPECT_EQ(j["event"], "round");
  EXPECT_EQ(j["world_size"], 6);
  EXPECT_EQ(line.find('\n'), std::string::npos);
  // a damaged message never throws
  EXPECT_NO_THROW(event_line(0, "n", "r", "x", {{"detail", std::string("bad \xff byte")}}));
}

TEST(Events, ManyWritersOneFileWholeLines) {
  TempDir dir;
  const auto path = (dir.path() / "sub" / "events.jsonl").string();  // the directory is created
  std::vector<std::thread> writers;
  for (int w = 0; w < 4; ++w)
    writers.emplace_back([&, w] {
      EventLog log(path, "n" + std::to_string(w), "run");
      for (int i = 0; i < 200; ++i) log.emit("tick", {{"i", i}, {"pad", std::string(300, 'x')}});
    });
  for (auto& t : writers) t.join();
  const auto events = read_events(path);
  EXPECT_EQ(events.size(), 800u);
}

TEST(Events, UnwritablePathThrows) {
  EXPECT_THROW(EventLog("/proc/no/such/events.jsonl", "n", "r"), std::system_error);
  EventLog off;
  EXPECT_FALSE(off.enabled());
  off.emit("nothing");  // no-op
}

// Runs the agent; returns its exit code.
int run(const std::string& command) {
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(EventsAgent, RestartIsInTheLog) {
  TempDir dir;
  const auto events = dir.path() / "events.jsonl";
  const auto cmd = fmt::format(
      "env -u SLURM_JOB_ID -u SLURM_STEP_ID -u SLURM_PROCID TEST_WORKER_FAIL_RANK=1 TEST_WORKER_FAIL_ONCE={}/once "
      "TEST_WORKER_EXIT_CODE=5 {} --standalone --nproc-per-node=2 --max-restarts=1 --events {} {} >{}/out 2>{}/err",
      dir.path().string(), ELASTRUN_BIN, events.string(), TEST_WORKER_BIN, dir.path().string(), dir.path().string());
  ASSERT_EQ(run(cmd), 0) << std::ifstream(dir.path() / "err").rdbuf();
  const auto log = read_events(events);
  auto count = [&](const std::string& event, auto&& pred) {
    return std::count_if(log.begin(), log.end(),
                         [&](const nlohmann::json& j) { return j["event"] == event && pred(j); });
  };
  const auto any = [](const nlohmann::json&) { return true; };
  EXPECT_EQ(count("round", [](const nlohmann::json& j) { return j["world_size"] == 2; }), 2) << "two rounds of world 2";
  EXPECT_EQ(count("worker_exit", [](const nlohmann::json& j) { return j["rank"] == 1 && j["exit_code"] == 5; }), 1);
  EXPECT_EQ(count("failure_decision", [](const nlohmann::json& j) { return j["action"] == "restart"; }), 1);
  EXPECT_EQ(count("state", [](const nlohmann::json& j) { return j["state"] == "RESTART"; }), 1);
  EXPECT_EQ(count("state", [](const nlohmann::json& j) { return j["state"] == "SUCCEEDED"; }), 1);
  EXPECT_EQ(count("exit", [](const nlohmann::json& j) { return j["code"] == 0; }), 1);
  EXPECT_GE(count("workers_started", any), 2);
  for (const auto& j : log) {
    EXPECT_TRUE(j.contains("time") && j.contains("node") && j.contains("run_id")) << j.dump();
  }
  // time never goes backwards in one agent's log
  for (std::size_t i = 1; i < log.size(); ++i)
    EXPECT_GE(log[i]["time"].get<double>(), log[i - 1]["time"].get<double>());
}

TEST(EventsAgent, WorkersGetTheFileAndAnUnwritableOneIsAUsageError) {
  TempDir dir;
  const auto events = dir.path() / "events.jsonl";
  const auto ok =
      fmt::format("{} --standalone --events {} /bin/sh -c 'echo \"$ELASTRUN_EVENTS_FILE\" > {}/seen' >/dev/null 2>&1",
                  ELASTRUN_BIN, events.string(), dir.path().string());
  ASSERT_EQ(run(ok), 0);
  std::string seen;
  std::getline(std::ifstream(dir.path() / "seen"), seen);
  EXPECT_EQ(seen, events.string());
  const auto bad =
      fmt::format("{} --standalone --events /proc/nope/e.jsonl /bin/true 2>{}/err", ELASTRUN_BIN, dir.path().string());
  EXPECT_EQ(run(bad), 2);
  std::string err;
  std::getline(std::ifstream(dir.path() / "err"), err);
  EXPECT_NE(err.find("--events"), std::string::npos) << err;
}

std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// `sh -c "exec COMMAND"`: the pid is the agent's.
pid_t spawn_shell(const std::string& command) {
  const std::string exec = "exec " + command;
  const char* argv[] = {"/bin/sh", "-c", exec.c_str(), nullptr};
  pid_t pid = 0;
  EXPECT_EQ(::posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char* const*>(argv), environ), 0);
  return pid;
}

TEST(EventsAgent, MemberLostSaysHowItWasDetected) {
  TempDir dir;
  const auto d = dir.path().string();
  const auto port = free_port();
  const auto agent = [&](int node, const std::string& extra) {
    return fmt::format(
        "env TEST_WORKER_SLEEP=60 TEST_WORKER_SLEEP_WORLD_SIZE=4 TEST_WORKER_OUT_DIR={0}/out {1} --nnodes=1:2 "
        "--nproc-per-node=2 --rdzv-endpoint=127.0.0.1:{2} --rdzv-auth=none --rdzv-id=lost --node-rank={3} {4} "
        "--monitor-interval=0.05 --events {0}/events-{3}.jsonl {5} >{0}/{3}.out 2>{0}/{3}.err",
        d, ELASTRUN_BIN, port, node, extra, TEST_WORKER_BIN);
  };
  fs::create_directories(dir.path() / "out");
  const pid_t a = spawn_shell(agent(0, "--rdzv-conf=is_host=1,last_call_timeout=2"));
  const pid_t b = spawn_shell(agent(1, "--rdzv-conf=is_host=0"));
  struct Reaper {  // on a failed assertion: kill and reap both agents (their workers die with them)
    std::vector<pid_t> pids;
    ~Reaper() {
      for (pid_t p : pids)
        if (::kill(p, SIGKILL) == 0) ::waitpid(p, nullptr, 0);
    }
  } reaper{{a, b}};
  // both agents' workers running in a round of 4
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  auto started = [&] {
    std::error_code ec;
    int n = 0;
    for (const auto& e : fs::directory_iterator(dir.path() / "out", ec))
      n += e.path().filename().string().starts_with("rank");
    return n >= 4;
  };
  while (!started() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(started()) << std::ifstream(dir.path() / "0.err").rdbuf();
  ::kill(b, SIGKILL);
  int status = 0;
  ::waitpid(b, &status, 0);
  ::waitpid(a, &status, 0);
  reaper.pids.clear();
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << std::ifstream(dir.path() / "0.err").rdbuf();
  const auto log = read_events(dir.path() / "events-0.jsonl");
  const auto lost =
      std::find_if(log.begin(), log.end(), [](const nlohmann::json& j) { return j["event"] == "member_lost"; });
  ASSERT_NE(lost, log.end());
  EXPECT_EQ((*lost)["how"], "holder disconnected") << lost->dump();
  EXPECT_TRUE((*lost)["since_heartbeat_ms"].is_number_integer()) << lost->dump();
  EXPECT_TRUE(std::any_of(log.begin(), log.end(), [](const nlohmann::json& j) {
    return j["event"] == "round" && j["world_size"] == 2;
  })) << "the survivor re-formed alone";
}

}  // namespace
}  // namespace elastrun::launcher
