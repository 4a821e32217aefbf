// The worker environment and output routing (worker_env.hpp), failures and the job-wide summary
// (failure_report.hpp), and reading PyTorch's @record error files (error_file.hpp).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include "failure_report.hpp"
#include "worker_env.hpp"
#include "temp_dir.hpp"

namespace elastrun::launcher {
namespace {

namespace fs = std::filesystem;

using test_support::TempDir;

std::map<std::string, std::string> as_map(const std::vector<std::string>& env) {
  std::map<std::string, std::string> m;
  for (const auto& kv : env) {
    auto eq = kv.find('=');
    EXPECT_TRUE(m.emplace(kv.substr(0, eq), kv.substr(eq + 1)).second) << "set twice: " << kv;
  }
  return m;
}

rdzv::RoundResult second_node_of_three() {
  rdzv::RoundResult r;
  r.generation = 4;
  r.group_rank = 1;
  r.group_world_size = 3;
  r.rank_offset = 2;
  r.world_size = 6;
  r.role_rank_offset = 2;
  r.role_world_size = 6;
  r.master_addr = "10.1.0.1";
  r.master_port = 29511;
  return r;
}

AttemptContext attempt_in(const AgentOptions& o, const rdzv::RoundResult& round, const fs::path& dir) {
  return {.options = o,
          .round = round,
          .run_id = "",
          .node_name = "",
          .control_file = "",
          .events_file = "",
          .restart_count = 0,
          .attempt_dir = dir,
          .program_path = "",
          .argv = {},
          .agent_tag = "",
          .argv_program_end = 1,
          .numa_nodes = {},
          .timer_file = ""};
}

TEST(WorkerEnv, InheritedEnvironmentDropsOursOnly) {
  std::vector<std::string> entries = {"PATH=/bin", "RANK=7",          "MASTER_PORT=1",
                                      "HOME=/h",   "ELASTRUN_NODE=x", "RANKING=kept"};
  std::vector<char*> raw;
  for (auto& e : entries) raw.push_back(e.data());
  raw.push_back(nullptr);
  EXPECT_EQ(inherited_environment(raw.data()), (std::vector<std::string>{"PATH=/bin", "HOME=/h", "RANKING=kept"}));
}

// torchrun's static form: the workers keep --master-port (their c10d store goes there, and a
// script may name it in init_method="tcp://..."); the agents' store moved to the next port.
TEST(WorkerEnv, StaticFormGivesTheWorkersTheMasterPort) {
  TempDir dir;
  AgentOptions o;
  o.master_addr = "localhost";
  o.master_port = 31000;
  ASSERT_TRUE(o.static_form());
  EXPECT_EQ(o.static_store_port(), 31001);
  const auto round = second_node_of_three();
  auto env = as_map(worker_specs(attempt_in(o, round, dir.path() / "a"), {}).at(0).env);
  EXPECT_EQ(env["MASTER_PORT"], "31000");
  o.rdzv_endpoint = "localhost:31000";  // an endpoint: the round's reserved port, as always
  EXPECT_FALSE(o.static_form());
  env = as_map(worker_specs(attempt_in(o, round, dir.path() / "b"), {}).at(0).env);
  EXPECT_EQ(env["MASTER_PORT"], "29511");
  AgentOptions top;
  top.master_addr = "h";
  top.master_port = 65535;
  EXPECT_EQ(top.static_store_port(), 65534);
}

TEST(WorkerEnv, Torchrun2LocalRankArgumentVirtualLocalRankAndPrefix) {
  TempDir dir;
  AgentOptions o;
  o.nproc_per_node = 2;
  o.role = "trainer";
  o.local_rank_arg = "--local_rank";
  o.virtual_local_rank = true;
  o.log_line_prefix_template = "[${role_name}${local_rank}|${rank}@${hostname}]:";
  const auto round = second_node_of_three();
  auto a = attempt_in(o, round, dir.path() / "a");
  a.node_name = "n2";
  a.argv = {"python3", "-u", "train.py", "--out=r${local_rank}.txt"};
  a.argv_program_end = 3;
  a.gpus = {{"4", "6"}, "CUDA_VISIBLE_DEVICES", false};  // the agent's, detect_gpus
  const auto specs = worker_specs(a, {"CUDA_VISIBLE_DEVICES=4,6"});
  ASSERT_EQ(specs.size(), 2u);
  EXPECT_EQ(specs[1].argv, (std::vector<std::string>{"python3", "-u", "train.py", "--local_rank=1", "--out=r1.txt"}));
  auto env = as_map(specs[1].env);
  EXPECT_EQ(env["LOCAL_RANK"], "0");
  EXPECT_EQ(env["CUDA_VISIBLE_DEVICES"], "6");
  EXPECT_EQ(env["ELASTRUN_DEVICE"], "0");
  EXPECT_EQ(env["RANK"], "3");
  EXPECT_EQ(specs[1].console_prefix, "[trainer1|3@n2]:");
  EXPECT_EQ(console_prefix("", 5, 1, "default", "n"), "[rank 5] ");
}

TEST(WorkerEnv, NumaCpuListsAndSpread) {
  EXPECT_EQ(parse_cpu_list("0-3,8,10-11\n"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_TRUE(parse_cpu_list("3-1").empty());
  EXPECT_TRUE(parse_cpu_list("a").empty());
  const std::vector<std::vector<int>> two = {{0, 1}, {2, 3}};
  EXPECT_EQ(numa_cpus_for(0, 4, two), (std::vector<int>{0, 1}));
  EXPECT_EQ(numa_cpus_for(1, 4, two), (std::vector<int>{0, 1}));
  EXPECT_EQ(numa_cpus_for(2, 4, two), (std::vector<int>{2, 3}));
  EXPECT_EQ(numa_cpus_for(3, 4, two), (std::vector<int>{2, 3}));
  EXPECT_TRUE(numa_cpus_for(0, 4, {{0, 1, 2, 3}}).empty()) << "one NUMA node: no binding";
  TempDir sys;
  for (int n : {0, 1}) {
    fs::create_directories(sys.path() / ("node" + std::to_string(n)));
    std::ofstream(sys.path() / ("node" + std::to_string(n)) / "cpulist") << (n == 0 ? "0-1\n" : "2-3\n");
  }
  EXPECT_EQ(read_numa_nodes(sys.path()), two);
}

// A faked sysfs and driver tree: two NUMA nodes (CPUs 0-3 and 4-7), four GPUs, 0 and 1 on node
// 1 and 2 and 3 on node 0 (the spread by local rank would get them backwards).
struct FakedGpuTopology {
  TempDir root;
  fs::path proc() const { return root.path() / "proc"; }
  fs::path pci() const { return root.path() / "pci"; }
  fs::path nodes() const { return root.path() / "node"; }
  FakedGpuTopology() {
    for (int n : {0, 1}) {
      fs::create_directories(nodes() / ("node" + std::to_string(n)));
      std::ofstream(nodes() / ("node" + std::to_string(n)) / "cpulist") << (n == 0 ? "0-3\n" : "4-7\n");
    }
    const char* bus[] = {"0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0", "0000:af:00.0"};
    for (int minor = 0; minor < 4; ++minor) {
      fs::create_directories(proc() / bus[minor]);
      fs::create_directories(pci() / bus[minor]);
      std::ofstream(proc() / bus[minor] / "information")
          << "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 0\nGPU UUID: \t GPU-uuid-" << minor
          << "\nVideo BIOS: \t ??.??.??.??.??\nBus Type: \t PCIe\nDevice Minor: \t " << minor << "\n";
      std::ofstream(pci() / bus[minor] / "numa_node") << (minor < 2 ? 1 : 0) << "\n";
    }
  }
};

TEST(WorkerEnv, NumaBindingPutsEachWorkerNextToItsGpu) {
  FakedGpuTopology topo;
  const auto gpus_topo = read_gpu_numa_nodes(topo.proc(), topo.pci());
  ASSERT_EQ(gpus_topo.size(), 4u);
  EXPECT_EQ(numa_node_of_gpu("0", gpus_topo), 1);
  EXPECT_EQ(numa_node_of_gpu("GPU-uuid-3", gpus_topo), 0);
  EXPECT_FALSE(numa_node_of_gpu("7", gpus_topo));
  TempDir dir;
  AgentOptions o;
  o.nproc_per_node = 4;
  o.numa_binding = "node";
  const auto round = second_node_of_three();
  auto a = attempt_in(o, round, dir.path());
  a.numa_nodes = read_numa_nodes(topo.nodes());
  // unconstrained: global indices in CUDA_VISIBLE_DEVICES
  a.gpus = detect_gpus(
      [](const std::string& n) -> std::optional<std::string> {
        if (n == "CUDA_VISIBLE_DEVICES") return "0,1,2,3";
        return std::nullopt;
      },
      4);
  a.gpu_cpus = cpus_near_gpus(a.gpus, gpus_topo, topo.nodes());
  const auto specs = worker_specs(a, {});
  const std::vector<int> node0{0, 1, 2, 3}, node1{4, 5, 6, 7};
  EXPECT_EQ(specs[0].cpus, node1);
  EXPECT_EQ(specs[1].cpus, node1);
  EXPECT_EQ(specs[2].cpus, node0);
  EXPECT_EQ(specs[3].cpus, node0);
  // a site that constrains devices: CUDA_VISIBLE_DEVICES 0-based, Slurm's global ids beside it
  auto constrained = detect_gpus(
      [](const std::string& n) -> std::optional<std::string> {
        if (n == "CUDA_VISIBLE_DEVICES") return "0,1";
        if (n == "SLURM_STEP_GPUS") return "2,0";
        return std::nullopt;
      },
      4);
  const auto near = cpus_near_gpus(constrained, gpus_topo, topo.nodes());
  EXPECT_EQ(near, (std::vector<std::vector<int>>{node0, node1}));
  // no topology (no NVIDIA driver): the even spread
  a.gpu_cpus = cpus_near_gpus(a.gpus, {}, topo.nodes());
  EXPECT_EQ(worker_specs(a, {})[0].cpus, node0);
  EXPECT_EQ(worker_specs(a, {})[3].cpus, node1);
}

TEST(WorkerEnv, TorchVariablesForEachLocalRank) {
  TempDir dir;
  AgentOptions o;
  o.nproc_per_node = 2;
  o.max_restarts = 3;
  o.role = "trainer";
  o.checkpoint_dir = "/ckpt";
  const auto round = second_node_of_three();
  const AttemptContext a{.options = o,
                         .round = round,
                         .run_id = "12.r0",
                         .node_name = "n2",
                         .control_file = "/c/control",
                         .events_file = "/l/events-n2.jsonl",
                         .restart_count = 1,
                         .attempt_dir = dir.path() / "attempt_0",
                         .program_path = "/bin/true",
                         .argv = {"true", "x"},
                         .agent_tag = "ELASTRUN_AGENT_TAG=7-00ff",
                         .argv_program_end = 1,
                         .numa_nodes = {},
                         .timer_file = ""};
  const auto specs = worker_specs(a, {"PATH=/bin", "RANKING=kept"});
  ASSERT_EQ(specs.size(), 2u);
  for (int local = 0; local < 2; ++local) {
    const auto& s = specs[static_cast<std::size_t>(local)];
    EXPECT_EQ(s.local_rank, local);
    EXPECT_EQ(s.global_rank, 2 + local);
    EXPECT_EQ(s.path, "/bin/true");
    EXPECT_EQ(s.argv, (std::vector<std::string>{"true", "x"}));
    auto env = as_map(s.env);
    EXPECT_EQ(env["PATH"], "/bin");
    EXPECT_EQ(env["RANK"], std::to_string(2 + local));
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(local));
    EXPECT_EQ(env["GROUP_RANK"], "1");
    EXPECT_EQ(env["ROLE_RANK"], std::to_string(2 + local));
    EXPECT_EQ(env["ROLE_NAME"], "trainer");
    EXPECT_EQ(env["ELASTRUN_AGENT_TAG"], "7-00ff");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(env["WORLD_SIZE"], "6");
    EXPECT_EQ(env["GROUP_WORLD_SIZE"], "3");
    EXPECT_EQ(env["ROLE_WORLD_SIZE"], "6");
    EXPECT_EQ(env["MASTER_ADDR"], "10.1.0.1");
    EXPECT_EQ(env["MASTER_PORT"], "29511");
    EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "1");
    EXPECT_EQ(env["TORCHELASTIC_MAX_RESTARTS"], "3");
    EXPECT_EQ(env["TORCHELASTIC_RUN_ID"], "12.r0");
    EXPECT_EQ(env["TORCHELASTIC_USE_AGENT_STORE"], "False");
    EXPECT_EQ(env["ELASTRUN_GENERATION"], "4");
    EXPECT_EQ(env["ELASTRUN_NODE"], "n2");
    EXPECT_EQ(env["ELASTRUN_CONTROL_FILE"], "/c/control");
    EXPECT_EQ(env["ELASTRUN_CHECKPOINT_DIR"], "/ckpt");
    EXPECT_EQ(env["ELASTRUN_CHECKPOINTED_EXIT_CODE"], "85");
    EXPECT_EQ(env["ELASTRUN_EVENTS_FILE"], "/l/events-n2.jsonl");
    EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
    EXPECT_EQ(env["TORCHELASTIC_ERROR_FILE"], s.error_file);
    EXPECT_EQ(s.error_file, (dir.path() / "attempt_0" / std::to_string(local) / "error.json").string());
    EXPECT_TRUE(fs::is_directory(fs::path(s.error_file).parent_path()));
    // no --log-dir: everything on the console, no files
    EXPECT_TRUE(s.console_stdout);
    EXPECT_TRUE(s.console_stderr);
    EXPECT_TRUE(s.stdout_file.empty());
  }
}

TEST(WorkerEnv, UserThreadsAndSingleWorker) {
  TempDir dir;
  AgentOptions o;
  o.nproc_per_node = 2;
  const auto round = second_node_of_three();
  const auto a = attempt_in(o, round, dir.path());
  auto env = as_map(worker_variables(a, 0, "e", {"OMP_NUM_THREADS=4"}));
  EXPECT_FALSE(env.contains("OMP_NUM_THREADS")) << "the user's value is inherited, not overridden";
  EXPECT_FALSE(env.contains("ELASTRUN_CHECKPOINT_DIR"));
  EXPECT_FALSE(env.contains("ELASTRUN_EVENTS_FILE"));
  o.nproc_per_node = 1;
  EXPECT_FALSE(as_map(worker_variables(a, 0, "e", {})).contains("OMP_NUM_THREADS"));
}

TEST(WorkerEnv, ThreadsAreTheAgentsCpusSharedAmongItsWorkers) {
  EXPECT_EQ(omp_threads_per_worker(16, 4), 4);
  EXPECT_EQ(omp_threads_per_worker(18, 4), 4) << "an equal share, rounded down";
  EXPECT_EQ(omp_threads_per_worker(2, 3), 1) << "at least one";
  EXPECT_EQ(omp_threads_per_worker(0, 4), 1) << "unknown: torchrun's 1";
  EXPECT_EQ(cpus_for_workers(64, "16"), 16) << "srun --cpus-per-task=16 without task affinity: the mask is the node's";
  EXPECT_EQ(cpus_for_workers(8, "16"), 8) << "a narrower mask wins";
  EXPECT_EQ(cpus_for_workers(8, std::nullopt), 8);
  EXPECT_EQ(cpus_for_workers(8, "x"), 8);
  TempDir dir;
  AgentOptions o;
  o.nproc_per_node = 4;
  const auto round = second_node_of_three();
  auto a = attempt_in(o, round, dir.path());
  a.cpus = 32;  // e.g. srun --cpus-per-task=32: the agent's affinity mask
  EXPECT_EQ(as_map(worker_variables(a, 3, "e", {}))["OMP_NUM_THREADS"], "8");
}

TEST(WorkerEnv, CollectiveLibraryDefaultsAndTheUsersValuesWin) {
  TempDir dir;
  AgentOptions o;
  o.nproc_per_node = 2;
  const auto round = second_node_of_three();
  auto a = attempt_in(o, round, dir.path());
  a.socket_ifname = "ib0";
  auto env = as_map(worker_variables(a, 1, "e", {"TORCH_NCCL_ASYNC_ERROR_HANDLING=0"}));
  EXPECT_EQ(env["NCCL_ASYNC_ERROR_HANDLING"], "1");
  EXPECT_FALSE(env.contains("TORCH_NCCL_ASYNC_ERROR_HANDLING")) << "the user's 0 is inherited, not overridden";
  EXPECT_EQ(env["NCCL_SOCKET_IFNAME"], "ib0");
  EXPECT_EQ(env["GLOO_SOCKET_IFNAME"], "ib0");
  a.socket_ifname = "";
  EXPECT_FALSE(as_map(worker_variables(a, 1, "e", {})).contains("NCCL_SOCKET_IFNAME"));
}

TEST(WorkerEnv, EachWorkerFindsItsGpuAndACpuNodeGetsNoDevice) {
  TempDir dir;
  AgentOptions o;
  o.nproc_per_node = 2;
  const auto round = second_node_of_three();
  auto a = attempt_in(o, round, dir.path());
  EXPECT_FALSE(as_map(worker_variables(a, 1, "e", {})).contains("ELASTRUN_DEVICE")) << "no GPU: nothing to say";
  a.gpus = {{"2", "3"}, "CUDA_VISIBLE_DEVICES", false};  // Slurm's, inherited by the workers
  auto env = as_map(worker_variables(a, 1, "e", {"CUDA_VISIBLE_DEVICES=2,3"}));
  EXPECT_EQ(env["ELASTRUN_DEVICE"], "1");
  EXPECT_EQ(env["LOCAL_RANK"], "1");
  EXPECT_FALSE(env.contains("CUDA_VISIBLE_DEVICES")) << "inherited as Slurm set it";
  a.gpus = {{"1", "3"}, "SLURM_JOB_GPUS", true};  // no CUDA_VISIBLE_DEVICES in the environment
  EXPECT_EQ(as_map(worker_variables(a, 0, "e", {}))["CUDA_VISIBLE_DEVICES"], "1,3");
  o.gpus_per_worker = 1;
  a.gpus = {{"2", "3"}, "CUDA_VISIBLE_DEVICES", false};
  const auto specs = worker_specs(a, {"CUDA_VISIBLE_DEVICES=2,3"});
  env = as_map(specs.at(1).env);  // one CUDA_VISIBLE_DEVICES: ours replaced the inherited one
  EXPECT_EQ(env["CUDA_VISIBLE_DEVICES"], "3");
  EXPECT_EQ(env["ELASTRUN_DEVICE"], "0");
  EXPECT_EQ(env["LOCAL_RANK"], "1") << "still the node-local index";
}

TEST(WorkerEnv, EventsFileOursReplacesTheUsers) {
  TempDir dir;
  AgentOptions o;
  const auto round = second_node_of_three();
  auto a = attempt_in(o, round, dir.path());
  const std::vector<std::string> user = {"ELASTRUN_EVENTS_FILE=/user/events.jsonl"};
  EXPECT_EQ(as_map(worker_specs(a, user)[0].env)["ELASTRUN_EVENTS_FILE"], "/user/events.jsonl")
      << "without an agent event log the user's variable is inherited";
  a.events_file = "/agent/events-n2.jsonl";
  EXPECT_EQ(as_map(worker_specs(a, user)[0].env)["ELASTRUN_EVENTS_FILE"], "/agent/events-n2.jsonl");
}

TEST(WorkerEnv, StaleErrorFileIsRemoved) {
  TempDir dir;
  AgentOptions o;
  const auto round = second_node_of_three();
  const auto a = attempt_in(o, round, dir.path());
  fs::create_directories(dir.path() / "0");
  std::ofstream(dir.path() / "0" / "error.json") << "{}";
  const auto specs = worker_specs(a, {});
  EXPECT_FALSE(fs::exists(specs[0].error_file));
}

TEST(WorkerEnv, RedirectsTeeAndRankFilter) {
  TempDir dir;
  AgentOptions o;
  o.nproc_per_node = 3;
  o.log_dir = dir.path().string();
  o.redirects = parse_stream_spec("-r", "0:3,1:1");
  o.tee = parse_stream_spec("-t", "1:2");
  o.local_ranks_filter = std::set<int>{0, 1};
  const auto round = second_node_of_three();
  const auto a = attempt_in(o, round, dir.path() / "attempt_0");
  const auto s = worker_specs(a, {});
  // rank 0: both redirected: files only
  EXPECT_FALSE(s[0].console_stdout);
  EXPECT_FALSE(s[0].console_stderr);
  EXPECT_FALSE(s[0].stdout_file.empty());
  EXPECT_FALSE(s[0].stderr_file.empty());
  // rank 1: stdout redirected, stderr teed
  EXPECT_FALSE(s[1].console_stdout);
  EXPECT_TRUE(s[1].console_stderr);
  EXPECT_FALSE(s[1].stdout_file.empty());
  EXPECT_FALSE(s[1].stderr_file.empty());
  // rank 2: filtered from the console, no files
  EXPECT_FALSE(s[2].console_stdout);
  EXPECT_FALSE(s[2].console_stderr);
  EXPECT_TRUE(s[2].stdout_file.empty());
  // without --log-dir, -r and -t have no effect
  o.log_dir.clear();
  o.local_ranks_filter.reset();
  for (const auto& spec : worker_specs(a, {})) {
    EXPECT_TRUE(spec.console_stdout);
    EXPECT_TRUE(spec.stdout_file.empty());
  }
}

// ---- error files and failures ----

TEST(ErrorFile, TorchRecordFormatAndLenientForms) {
  TempDir dir;
  const auto write = [&](const std::string& text) {
    const auto p = (dir.path() / "error.json").string();
    std::ofstream(p, std::ios::trunc) << text;
    return p;
  };
  auto info = read_error_file(write(
      R"({"message": {"message": "RuntimeError: boom\nsecond line", "extraInfo": {"py_callstack": "Traceback...\n  x", "timestamp": "1700000000"}}})"));
  ASSERT_TRUE(info);
  EXPECT_EQ(info->message, "RuntimeError: boom");
  EXPECT_EQ(info->traceback, "Traceback...\n  x");
  EXPECT_EQ(info->timestamp, "1700000000");
  EXPECT_EQ(read_error_file(write(R"({"message": "plain"})"))->message, "plain");
  EXPECT_EQ(read_error_file(write("\n  not json at all\nmore"))->message, "not json at all");
  EXPECT_EQ(read_error_file(write("[1,2]"))->message, "[1,2]");
  EXPECT_FALSE(read_error_file(write("  \n")));
  EXPECT_FALSE(read_error_file((dir.path() / "missing.json").string()));
}

TEST(Failures, OneLineAndJsonRoundTrip) {
  WorkerExit e;
  e.local_rank = 1;
  e.global_rank = 3;
  e.exit_code = 5;
  e.when = std::chrono::system_clock::time_point(std::chrono::milliseconds(1'700'000'000'123));
  auto f = failure_from_exit(e, "n2", 1, "");
  EXPECT_EQ(f.one_line(), "rank 3 (local rank 1, node n2) exited with code 5");
  f.signal = SIGSEGV;
  EXPECT_EQ(f.how(), "killed by SIGSEGV (11)");
  f.error = ErrorFileInfo{"OOM", "tb", {}};
  f.error_file = "/e.json";
  auto back = Failure::from_json(f.to_json().dump());
  ASSERT_TRUE(back);
  EXPECT_EQ(back->one_line(), "rank 3 (local rank 1, node n2) killed by SIGSEGV (11): OOM");
  EXPECT_EQ(back->when, f.when);
  EXPECT_EQ(back->error_file, "/e.json");
  EXPECT_EQ(back->error->traceback, "tb");
  EXPECT_FALSE(Failure::from_json("[]"));
  EXPECT_FALSE(Failure::from_json("{oops"));
  EXPECT_EQ(iso_time(f.when), "2023-11-14T22:13:20.123Z");
}

TEST(Failures, SummaryNamesTheEarliestAsRootCause) {
  const auto at = [](int ms) { return std::chrono::system_clock::time_point(std::chrono::milliseconds(ms)); };
  Failure late;
  late.when = at(2000);
  late.node = "n1";
  late.exit_code = 1;
  Failure root;
  root.when = at(1000);
  root.node = "n3";
  root.rank = 5;
  root.local_rank = 1;
  root.signal = SIGKILL;
  root.restart_count = 2;
  root.error_file = "/x/error.json";
  root.error = ErrorFileInfo{"CUDA out of memory", "line 1\nline 2", {}};
  const auto lines = summary_lines("job9", {late, root}, /*job_wide=*/true, 3);
  ASSERT_GE(lines.size(), 10u);
  const auto has = [&](const std::string& text) {
    return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l == text; });
  };
  EXPECT_EQ(lines.front(), "================ elastrun: job failed (run 'job9') ================");
  EXPECT_TRUE(has("  node       : n3"));
  EXPECT_TRUE(has("  rank       : 5 (local rank 1)"));
  EXPECT_TRUE(has("  signal     : SIGKILL (9)"));
  EXPECT_TRUE(has("  restart    : 2 of 3"));
  EXPECT_TRUE(has("  message    : CUDA out of memory"));
  EXPECT_TRUE(has("    line 2"));
  EXPECT_TRUE(has("other failures (all nodes, by time):"));
  EXPECT_TRUE(has("  1970-01-01T00:00:02.000Z rank 0 (local rank 0, node n1) exited with code 1"));
  EXPECT_TRUE(summary_lines("job9", {}, true, 0).empty());
  // an error file that was never written points to @record
  Failure unwritten;
  unwritten.error_file = "/y/error.json";
  const auto one = summary_lines("r", {unwritten}, false, 0);
  EXPECT_TRUE(std::any_of(one.begin(), one.end(), [](const std::string& l) {
    return l.find("(not written; decorate main with torch.distributed.elastic.multiprocessing.errors.record)") !=
           std::string::npos;
  }));
  EXPECT_FALSE(
      std::any_of(one.begin(), one.end(), [](const std::string& l) { return l.starts_with("other failures"); }));
}

TEST(Failures, ALostNodeBeforeTheFailuresItCausedIsTheRootCauseAndListedOnce) {
  const auto at = [](int ms) { return std::chrono::system_clock::time_point(std::chrono::milliseconds(ms)); };
  Failure collateral;  // a survivor's worker: "Connection reset by peer"
  collateral.when = at(1000);
  collateral.node = "n2";
  collateral.rank = 1;
  collateral.exit_code = 1;
  Failure lost, lost_again;  // every survivor records the loss just before its own failures
  lost.when = at(999);
  lost.node = lost_again.node = "n3";
  lost.rank = lost_again.rank = -1;
  lost.lost = lost_again.lost = "its agent did not answer within 3000 ms of worker failures on n2";
  lost_again.when = at(1200);
  const auto back = Failure::from_json(lost.to_json().dump());
  ASSERT_TRUE(back);
  EXPECT_EQ(back->lost, lost.lost);
  EXPECT_EQ(lost.one_line(), "node n3 lost: its agent did not answer within 3000 ms of worker failures on n2");
  const auto lines = summary_lines("job9", {collateral, lost_again, lost}, /*job_wide=*/true, 0);
  const auto count = [&](const std::string& text) {
    return std::count_if(lines.begin(), lines.end(),
                         [&](const std::string& l) { return l.find(text) != std::string::npos; });
  };
  EXPECT_EQ(count("  node       : n3"), 1);
  EXPECT_EQ(count("  lost       : its agent did not answer"), 1);
  EXPECT_EQ(count("rank       :"), 0) << "a lost node has no rank";
  EXPECT_EQ(count("node n3 lost"), 0) << "the same loss recorded by another survivor is not listed again";
  EXPECT_EQ(count("rank 1 (local rank 0, node n2) exited with code 1"), 1);
}

}  // namespace
}  // namespace elastrun::launcher
