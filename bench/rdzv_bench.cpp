// rdzv_bench: rendezvous figures on this machine, printed against the goals of the Rendezvous
// issue. Never asserts; run by hand or from scripts/bench.
//   round completion for 4, 64 and 1024 simulated members (threads, real sockets)  goal 1024 < 1 s
//   detection latency of a member process killed with SIGKILL (real processes)       goal < 100 ms
//   detection latency of a silent (SIGSTOPped) member                                goal <= hb + 0.5 s
#include <fcntl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <atomic>
#include <cstdlib>
#include <string_view>
#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include "elastrun/rdzv/rendezvous.hpp"
#include "elastrun/rdzv/store.hpp"

extern char** environ;
using namespace elastrun::rdzv;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// Time from the first join to every member holding the round result. max = N, so the round
// closes as soon as the last member joins (no last-call wait in the figure).
double round_time_ms(int members, bool detail = false) {
  StoreServerOptions o;
  o.bind_address = "127.0.0.1";
  o.run_id = "bench";
  StoreServer server(o);
  std::vector<std::unique_ptr<Rendezvous>> rdzv;
  rdzv.reserve(static_cast<std::size_t>(members));
  for (int i = 0; i < members; ++i) {
    MemberInfo me;
    me.node_name = fmt::format("n{}", i);
    me.address = "127.0.0.1";
    me.node_index = i;
    RendezvousConfig cfg;
    cfg.run_id = "bench";
    cfg.min_nodes = members;
    cfg.max_nodes = members;
    cfg.join_timeout = 120s;
    cfg.last_call_timeout = 1s;
    cfg.heartbeat_timeout = 30s;
    auto kv = std::make_unique<StoreClient>("127.0.0.1", server.port(), AuthConfig{}, "bench");
    auto hb = std::make_unique<StoreClient>("127.0.0.1", server.port(), AuthConfig{}, "bench");
    rdzv.push_back(std::make_unique<Rendezvous>(std::move(kv), std::move(hb), cfg, me));
  }
  // Threads are created before the clock starts (creating 1024 threads takes seconds here and
  // says nothing about the rendezvous); they all start joining when released.
  std::promise<void> go;
  std::shared_future<void> start = go.get_future().share();
  std::vector<std::future<void>> done;
  std::vector<double> finished(rdzv.size());
  Clock::time_point t0;
  // Threads stay alive until every member has its result: 1024 thread exits inside the
  // measured window would cost 1024 stack unmaps with cross-CPU TLB flushes, an artefact of
  // simulating 1024 nodes in one process.
  std::promise<void> all_done;
  std::shared_future<void> release = all_done.get_future().share();
  std::atomic<int> remaining{members};
  std::promise<void> last;
  for (std::size_t i = 0; i < rdzv.size(); ++i)
    done.push_back(std::async(std::launch::async, [&, i, start, release] {
      start.wait();
      std::exception_ptr error;
      try {
        rdzv[i]->next_round();
      } catch (...) {
        error = std::current_exception();  // rethrown by get() below, after the others finish
      }
      finished[i] = ms_since(t0);
      if (remaining.fetch_sub(1) == 1) last.set_value();
      release.wait();
      if (error) std::rethrow_exception(error);
    }));
  std::this_thread::sleep_for(200ms);  // let every thread reach the start line
  rusage before{}, after{};
  getrusage(RUSAGE_SELF, &before);
  t0 = Clock::now();
  go.set_value();
  last.get_future().wait();
  const double total = ms_since(t0);
  getrusage(RUSAGE_SELF, &after);
  all_done.set_value();
  for (auto& f : done) f.get();
  if (detail) {
    std::sort(finished.begin(), finished.end());
    auto cpu_ms = [](const rusage& u) {
      return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e3;
    };
    fmt::print("  members done: first {:.1f} ms, median {:.1f} ms, last {:.1f} ms; cpu {:.0f} ms, {} minor faults\n",
               finished.front(), finished[finished.size() / 2], finished.back(), cpu_ms(after) - cpu_ms(before),
               after.ru_minflt - before.ru_minflt);
  }
  return total;
}

struct Proc {
  pid_t pid = -1;
  int out = -1;
  std::string buf;
  ~Proc() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      kill(pid, SIGCONT);
      waitpid(pid, nullptr, 0);
    }
    if (out >= 0) close(out);
  }
  bool wait_event(const std::string& needle, std::chrono::milliseconds timeout) {
    auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      auto nl = buf.find('\n');
      if (nl != std::string::npos) {
        bool hit = buf.substr(0, nl).find(needle) != std::string::npos;
        buf.erase(0, nl + 1);
        if (hit) return true;
        continue;
      }
      pollfd p{out, POLLIN, 0};
      if (poll(&p, 1, 50) <= 0) continue;
      char b[4096];
      auto n = read(out, b, sizeof b);
      if (n <= 0) return false;
      buf.append(b, static_cast<std::size_t>(n));
    }
    return false;
  }
};

std::unique_ptr<Proc> spawn_member(const std::string& exe, std::vector<std::string> args) {
  auto p = std::make_unique<Proc>();
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  args.insert(args.begin(), exe);
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  if (posix_spawn(&p->pid, exe.c_str(), &fa, nullptr, argv.data(), environ) != 0)
    throw std::runtime_error("spawn " + exe);
  posix_spawn_file_actions_destroy(&fa);
  close(fds[1]);
  p->out = fds[0];
  return p;
}

// Kills (or stops) one of three members and measures until a survivor reports the change.
double detection_ms(const std::string& exe, int signal, int hb_ms, int port) {
  auto ep = fmt::format("127.0.0.1:{}", port);
  auto common = [&](const char* node, const char* index) {
    return std::vector<std::string>{"--endpoint",     ep,    "--node",   node,   "--index", index,
                                    "--min",          "2",   "--max",    "3",    "--hb-ms", std::to_string(hb_ms),
                                    "--last-call-ms", "200", "--run-id", "bench"};
  };
  auto host_args = common("n0", "0");
  host_args.push_back("--serve");
  auto host = spawn_member(exe, host_args);
  if (!host->wait_event("\"store\"", 10s)) return -1;
  auto b = spawn_member(exe, common("n1", "1"));
  auto victim = spawn_member(exe, common("n2", "2"));
  for (auto* p : {host.get(), b.get(), victim.get()})
    if (!p->wait_event("\"round\"", 30s)) return -1;
  auto t0 = Clock::now();
  kill(victim->pid, signal);
  if (!b->wait_event("member lost", 30s)) return -1;
  return ms_since(t0);
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_level(spdlog::level::warn);
  // Each simulated member holds two connections; 1024 members need ~2100 descriptors.
  rlimit lim{};
  getrlimit(RLIMIT_NOFILE, &lim);
  lim.rlim_cur = lim.rlim_max;
  setrlimit(RLIMIT_NOFILE, &lim);
  // `rdzv_bench --round N [runs]`: only the round-formation figure for N members (profiling).
  if (argc > 2 && std::string_view(argv[1]) == "--round") {
    const int n = std::atoi(argv[2]);
    const int runs = argc > 3 ? std::atoi(argv[3]) : 3;
    for (int i = 0; i < runs; ++i) fmt::print("round complete, {} members: {:.1f} ms\n", n, round_time_ms(n, true));
    return 0;
  }
  // rdzv_bench MEMBER_EXE [--members 4,64,1024] [--runs N] [--json OUT]
  std::string member_exe = argc > 1 ? argv[1] : "build/bin/rdzv_member";
  std::vector<int> sizes = {4, 64, 1024};
  int runs_per_size = 0;  // 0: 5 (3 from 1024 members on)
  std::string json_file;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string_view flag = argv[i];
    if (flag == "--json") {
      json_file = argv[i + 1];
    } else if (flag == "--runs") {
      runs_per_size = std::max(1, std::atoi(argv[i + 1]));
    } else if (flag == "--members") {
      sizes.clear();
      for (std::string_view list = argv[i + 1]; !list.empty();) {
        const auto comma = list.find(',');
        sizes.push_back(std::atoi(std::string(list.substr(0, comma)).c_str()));
        list = comma == std::string_view::npos ? std::string_view{} : list.substr(comma + 1);
      }
    }
  }
  nlohmann::json raw = {{"rounds_ms", nlohmann::json::object()}, {"limits", nlohmann::json::object()}};
  raw["limits"]["nofile"] = lim.rlim_cur;
  raw["limits"]["store_max_connections"] = StoreServerOptions{}.max_connections;

  fmt::print("elastrun rendezvous benchmark ({} cores)\n", std::thread::hardware_concurrency());
  fmt::print("{:<44}{:>12}{:>14}{:>10}\n", "measure", "elastrun", "goal", "ratio");
  for (int n : sizes) {
    std::vector<double> runs;
    // ~2 connections per member (and both ends in this process): say why a size cannot run
    const std::uint64_t fds_needed = 4ULL * static_cast<std::uint64_t>(n) + 64;
    if (fds_needed > lim.rlim_cur || 2ULL * static_cast<std::uint64_t>(n) >= StoreServerOptions{}.max_connections) {
      raw["rounds_ms"][std::to_string(n)] = {
          {"not_measured", fmt::format("{} members need ~{} descriptors in one process (limit {}) and {} store "
                                       "connections (cap {})",
                                       n, fds_needed, lim.rlim_cur, 2 * n, StoreServerOptions{}.max_connections)}};
      fmt::print("{:<44}{:>12}\n", fmt::format("round complete, {} members", n), "not measured");
      continue;
    }
    const int count = runs_per_size > 0 ? runs_per_size : (n >= 1024 ? 3 : 5);
    for (int i = 0; i < count; ++i) runs.push_back(round_time_ms(n));
    raw["rounds_ms"][std::to_string(n)] = runs;
    std::sort(runs.begin(), runs.end());
    double median = runs[runs.size() / 2];
    fmt::print("{:<44}{:>9.1f} ms{:>14}{:>10}\n", fmt::format("round complete, {} members (median)", n), median,
               n == 1024 ? "< 1000 ms" : "-", n == 1024 ? fmt::format("{:.2f}", median / 1000.0) : "-");
  }
  int port = 29777;
  std::vector<double> death, silent;
  const int detect_runs = runs_per_size > 0 ? runs_per_size : 5;
  for (int i = 0; i < detect_runs; ++i) death.push_back(detection_ms(member_exe, SIGKILL, 3000, port++));
  for (int i = 0; i < std::min(detect_runs, 3); ++i) silent.push_back(detection_ms(member_exe, SIGSTOP, 1000, port++));
  raw["detect_killed_ms"] = death;
  raw["detect_silent_ms"] = silent;
  raw["heartbeat_s"] = 1.0;
  if (!json_file.empty()) std::ofstream(json_file) << raw.dump(1) << "\n";
  std::sort(death.begin(), death.end());
  std::sort(silent.begin(), silent.end());
  double d = death[death.size() / 2], s = silent[silent.size() / 2];
  fmt::print("{:<44}{:>9.1f} ms{:>14}{:>10.2f}\n", "detect SIGKILLed member (median of 5)", d, "< 100 ms", d / 100.0);
  fmt::print("{:<44}{:>9.1f} ms{:>14}{:>10.2f}\n", "detect silent member, hb 1 s (median of 3)", s, "<= 1500 ms",
             s / 1500.0);
  fmt::print(
      "reference: torchrun's dynamic rendezvous needs ~15 s of missed heartbeats + 30 s last call, and never\n"
      "detects a dead node directly (workers must first time out in a collective).\n");
  return 0;
}
