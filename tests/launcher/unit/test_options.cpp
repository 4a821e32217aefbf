// parse_agent_options: every torchrun flag spelling, PET_* defaults, bad values (exit-2 errors).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "options.hpp"

namespace elastrun::launcher {
namespace {

AgentOptions parse(std::vector<std::string> args, const std::map<std::string, std::string>& pet = {}) {
  args.insert(args.begin(), "elastrun");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  AgentOptions o;
  EXPECT_EQ(parse_agent_options(static_cast<int>(argv.size()), argv.data(), pet, o), ParseOutcome::Run);
  return o;
}

// The error text of a command line that must be refused.
std::string refusal(std::vector<std::string> args, const std::map<std::string, std::string>& pet = {}) {
  args.insert(args.begin(), "elastrun");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  AgentOptions o;
  try {
    parse_agent_options(static_cast<int>(argv.size()), argv.data(), pet, o);
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "not one line: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "accepted";
  return {};
}

TEST(Options, DefaultsAndProgram) {
  auto o = parse({"train.py", "--lr", "0.1"});
  EXPECT_FALSE(o.min_nodes);
  EXPECT_EQ(o.nproc_per_node, 1);
  EXPECT_EQ(o.rdzv_backend, RdzvBackend::C10d);
  EXPECT_EQ(o.max_restarts, 0);
  EXPECT_EQ(o.program, "train.py");
  EXPECT_EQ(o.program_args, (std::vector<std::string>{"--lr", "0.1"}));
  EXPECT_EQ(o.requeue_budget, (std::array<std::int64_t, kFailureClasses>{0, 3, kUnlimited, kUnlimited}));
  EXPECT_TRUE(o.scale_up_checkpoint);
}

TEST(Options, BothSpellingsOfEveryTorchrunFlag) {
  for (const char* sep : {"-", "_"}) {
    auto flag = [&](std::string name) {
      for (auto& c : name)
        if (c == '-') c = *sep;
      return "--" + name;
    };
    auto o = parse({flag("nnodes") + "=2:4", flag("nproc-per-node") + "=3", flag("rdzv-backend") + "=static",
                    flag("rdzv-endpoint") + "=h:1234", flag("rdzv-id") + "=job7", flag("max-restarts") + "=2",
                    flag("monitor-interval") + "=0.5", flag("node-rank") + "=1", flag("local-addr") + "=10.0.0.2",
                    flag("start-method") + "=fork", flag("log-dir") + "=/tmp/l", flag("local-ranks-filter") + "=0,2",
                    flag("exit-barrier-timeout") + "=7", flag("rdzv-conf") + "=join_timeout=9", "x"});
    EXPECT_EQ(*o.min_nodes, 2) << sep;
    EXPECT_EQ(*o.max_nodes, 4);
    EXPECT_EQ(o.nproc_per_node, 3);
    EXPECT_EQ(o.rdzv_backend, RdzvBackend::Static);
    EXPECT_EQ(o.rdzv_endpoint, "h:1234");
    EXPECT_EQ(o.rdzv_id, "job7");
    EXPECT_EQ(o.max_restarts, 2);
    EXPECT_EQ(o.monitor_interval, Millis(500));
    EXPECT_EQ(*o.node_rank, 1);
    EXPECT_EQ(o.local_addr, "10.0.0.2");
    EXPECT_EQ(o.start_method, "fork");
    EXPECT_EQ(o.log_dir, "/tmp/l");
    EXPECT_EQ(*o.local_ranks_filter, (std::set<int>{0, 2}));
    EXPECT_EQ(o.exit_barrier_timeout, Millis(7000));
    EXPECT_EQ(o.join_timeout, Millis(9000));
  }
}

// Every flag of torchrun 2.x's run.py (newest read: docs/launcher.md names the commit), both
// spellings; mapped where it means something here, refused with one line where it cannot.
TEST(Options, Torchrun2FlagsInBothSpellings) {
  for (const char* sep : {"-", "_"}) {
    auto flag = [&](std::string name) {
      for (auto& c : name)
        if (c == '-') c = *sep;
      return "--" + name;
    };
    auto o = parse({flag("shutdown-timeout") + "=30", flag("logs-specs") + "=default",
                    flag("event-log-handler") + "=console", flag("signals-to-handle") + "=SIGTERM, SIGUSR1",
                    flag("numa-binding") + "=socket", flag("virtual-local-rank"),
                    flag("duplicate-stdout-filters") + "=loss,,acc,step", flag("duplicate-stderr-filters") + "=WARN",
                    flag("log-line-prefix-template") + "=[${role_name}${local_rank}]:", "x"});
    EXPECT_EQ(o.stop_grace, Millis(30000)) << sep;
    EXPECT_EQ(o.numa_binding, "socket");
    EXPECT_TRUE(o.virtual_local_rank);
    EXPECT_EQ(o.duplicate_stdout_filters, (std::vector<std::string>{"loss,acc", "step"}));
    EXPECT_EQ(o.duplicate_stderr_filters, (std::vector<std::string>{"WARN"}));
    EXPECT_EQ(o.log_line_prefix_template, "[${role_name}${local_rank}]:");
    EXPECT_EQ(o.notes.size(), 2u) << "a note each for the event handler and the signal list";
  }
  EXPECT_EQ(parse({"--local_rank_arg=--local_rank", "x"}).local_rank_arg, "--local_rank");
  EXPECT_EQ(parse({"--local-rank-arg=--local-rank", "--use_env", "x"}).local_rank_arg, "") << "--use-env cancels it";
  EXPECT_EQ(parse({"x"}, {{"shutdown_timeout", "12"}}).stop_grace, Millis(12000));
  EXPECT_NE(refusal({"--logs-specs=mine", "x"}).find("only 'default'"), std::string::npos);
  EXPECT_NE(refusal({"--event-log-handler=syslog", "x"}).find("not one of null"), std::string::npos);
  EXPECT_NE(refusal({"--signals-to-handle=SIGTERM,SIGFOO", "x"}).find("'SIGFOO'"), std::string::npos);
  EXPECT_NE(refusal({"--numa-binding=rack", "x"}).find("not one of node"), std::string::npos);
  EXPECT_NE(refusal({"--print-completion=bash", "x"}).find("no shell completion"), std::string::npos);
  EXPECT_NE(refusal({"--shutdown-timeout=3", "--stop-grace=4", "x"}).find("same setting"), std::string::npos);
  EXPECT_NE(refusal({"--local-rank-arg=-l", "x"}).find("--local_rank (torch 1.x)"), std::string::npos);
}

TEST(Options, MemoryCheckpointsWithAndWithoutABudget) {
  EXPECT_FALSE(parse({"x"}).memory_checkpoints) << "off by default";
  EXPECT_EQ(parse({"--memory-checkpoints=512M", "x"}).memory_checkpoints, 512u << 20);
  EXPECT_EQ(parse({"--memory_checkpoints=2G", "x"}).memory_checkpoints, 2ull << 30);
  EXPECT_EQ(parse({"x"}, {{"memory_checkpoints", "1G"}}).memory_checkpoints, 1ull << 30) << "PET_MEMORY_CHECKPOINTS";
  const auto automatic = parse({"--memory-checkpoints", "x"}).memory_checkpoints;
  ASSERT_TRUE(automatic) << "the flag alone";
  EXPECT_EQ(*automatic, static_cast<std::uint64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE) / 4);
  EXPECT_EQ(parse({"--memory-checkpoints", "x"}).program, "x") << "the program is not taken for a budget";
  EXPECT_NE(refusal({"--memory-checkpoints=lots", "x"}).find("--memory-checkpoints='lots' is not a size"),
            std::string::npos);
}

TEST(Options, HealthChecksBuiltinAndCommandsRepeatable) {
  const auto none = parse({"x"});
  EXPECT_FALSE(none.health_check_builtin);
  EXPECT_TRUE(none.health_check_commands.empty());
  EXPECT_EQ(none.health_check_timeout, Millis(60'000));
  const auto both =
      parse({"--health-check=builtin", "--health_check", "/site/gpu-ok --quick", "--health-check-timeout=5", "x"});
  EXPECT_TRUE(both.health_check_builtin);
  EXPECT_EQ(both.health_check_commands, std::vector<std::string>{"/site/gpu-ok --quick"});
  EXPECT_EQ(both.health_check_timeout, Millis(5000));
  EXPECT_EQ(both.health_check_interval, Millis(0)) << "off by default";
  EXPECT_EQ(parse({"--health-check-interval=30", "x"}).health_check_interval, Millis(30'000));
  EXPECT_EQ(both.program, "x");
  // PET_HEALTH_CHECK is the default; a flag on the line replaces it instead of adding to it
  EXPECT_EQ(parse({"x"}, {{"health_check", "/site/a"}}).health_check_commands, std::vector<std::string>{"/site/a"});
  const auto replaced = parse({"--health-check=/site/b", "x"}, {{"health_check", "/site/a"}});
  EXPECT_EQ(replaced.health_check_commands, std::vector<std::string>{"/site/b"});
  EXPECT_NE(refusal({"--health-check= ", "x"}).find("--health-check=' ' is blank"), std::string::npos);
  EXPECT_NE(refusal({"--health-check-timeout=0", "x"}).find("--health-check-timeout"), std::string::npos);
}

TEST(Options, MasterPortAloneIsTheStaticFormOnThisMachine) {
  auto o = parse({"--nnodes=1", "--master-port=29600", "x"});  // torchrun's --master-addr default
  EXPECT_EQ(o.master_addr, "127.0.0.1");
  EXPECT_TRUE(o.static_form());
  EXPECT_EQ(o.static_master_port(), 29600);
}

TEST(Options, StaticFormAndSeparateValues) {
  auto o = parse({"--nnodes", "3", "--master_addr", "n1", "--master_port", "29600", "prog"});
  EXPECT_EQ(*o.min_nodes, 3);
  EXPECT_EQ(*o.max_nodes, 3);
  EXPECT_EQ(o.master_addr, "n1");
  EXPECT_EQ(*o.master_port, 29600);
}

TEST(Options, ArgumentsAfterTheProgramAreItsOwn) {
  auto o = parse({"-m", "pkg.main", "--nnodes", "5", "--max-restarts=9"});
  EXPECT_TRUE(o.module);
  EXPECT_FALSE(o.min_nodes);
  EXPECT_EQ(o.max_restarts, 0);
  EXPECT_EQ(o.program_args, (std::vector<std::string>{"--nnodes", "5", "--max-restarts=9"}));
}

TEST(Options, PetVariablesAreDefaultsThatFlagsOverride) {
  auto o = parse({"x"}, {{"nnodes", "1:3"}, {"nproc_per_node", "2"}, {"max_restarts", "4"}});
  EXPECT_EQ(*o.max_nodes, 3);
  EXPECT_EQ(o.nproc_per_node, 2);
  EXPECT_EQ(o.max_restarts, 4);
  o = parse({"--nproc-per-node=5", "x"}, {{"nproc_per_node", "2"}});
  EXPECT_EQ(o.nproc_per_node, 5);
}

TEST(Options, RdzvConf) {
  auto o = parse({"--rdzv-conf",
                  "join_timeout=1.5,last_call_timeout=2,heartbeat_timeout=0.5,is_host=True,"
                  "read_timeout=60,store_type=x",
                  "p"});
  EXPECT_EQ(o.join_timeout, Millis(1500));
  EXPECT_EQ(o.last_call_timeout, Millis(2000));
  EXPECT_EQ(o.heartbeat_timeout, Millis(500));
  EXPECT_EQ(o.is_host, true);
  EXPECT_EQ(o.ignored_rdzv_conf, (std::vector<std::string>{"read_timeout", "store_type"}));
  EXPECT_EQ(parse({"--rdzv-conf=is_host=0", "p"}).is_host, false);
}

TEST(Options, EveryTorchrunRdzvConfKeyIsAcceptedAndMappedWhereItMeansSomething) {
  auto o = parse({"--rdzv-conf",
                  "timeout=900,keep_alive_interval=1,keep_alive_max_attempt=4,read_timeout=60,close_timeout=30,"
                  "store_type=tcp,use_libuv=1",
                  "p"});
  EXPECT_EQ(o.join_timeout, Millis(900'000)) << "torchrun's timeout is the join timeout";
  EXPECT_EQ(o.heartbeat_timeout, Millis(4000)) << "keep_alive_interval x keep_alive_max_attempt";
  EXPECT_EQ(o.ignored_rdzv_conf,
            (std::vector<std::string>{"read_timeout", "close_timeout", "store_type", "use_libuv"}));
  // our own keys win over torchrun's equivalents
  o = parse({"--rdzv-conf=join_timeout=5,timeout=900,heartbeat_timeout=2,keep_alive_interval=9", "p"});
  EXPECT_EQ(o.join_timeout, Millis(5000));
  EXPECT_EQ(o.heartbeat_timeout, Millis(2000));
  // PyTorch's tests pass the quotes literally (torchrun then ignores the quoted keys and runs)
  o = parse({"--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'", "p"});
  EXPECT_EQ(o.join_timeout, Millis(5000));
  EXPECT_EQ(o.last_call_timeout, Millis(1000));
  EXPECT_TRUE(o.unknown_rdzv_conf.empty());
  EXPECT_EQ(parse({"--rdzv-conf=\"heartbeat_timeout=2\"", "p"}).heartbeat_timeout, Millis(2000));
}

TEST(Options, Preload) {
  EXPECT_EQ(parse({"p"}).preload, "");
  EXPECT_EQ(parse({"--preload=torch,numpy", "p"}).preload, "torch,numpy");
  EXPECT_EQ(parse({"p"}, {{"preload", "torch"}}).preload, "torch") << "PET_PRELOAD";
}

TEST(Options, UnknownRdzvConfKeysAreKeptForAWarningNotRefused) {
  auto o = parse({"--rdzv-conf=bogus=1,join_timeout=7,other_backend_key=x", "p"});
  EXPECT_EQ(o.join_timeout, Millis(7000));
  EXPECT_EQ(o.unknown_rdzv_conf, (std::vector<std::string>{"bogus", "other_backend_key"}));
}

TEST(Options, CheckpointAndRequeueFlags) {
  auto o = parse({"--checkpoint-dir=/c", "--checkpoint-timeout=12", "--forward-signals", "--scale-up-checkpoint=no",
                  "--requeue-budget=app:1,timelimit:4,preempt:unlimited", "p"});
  EXPECT_EQ(o.checkpoint_dir, "/c");
  EXPECT_EQ(o.checkpoint_timeout, Millis(12000));
  EXPECT_TRUE(o.forward_signals);
  EXPECT_FALSE(o.scale_up_checkpoint);
  EXPECT_EQ(o.requeue_budget, (std::array<std::int64_t, kFailureClasses>{1, 3, 4, kUnlimited}));
}

TEST(Options, NprocNames) {
  {
    // gpu counts the step's GPUs (Slurm's CUDA_VISIBLE_DEVICES here), per --gpus-per-worker
    const char* saved = std::getenv("CUDA_VISIBLE_DEVICES");
    const std::string was = saved ? saved : "";
    setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7", 1);
    EXPECT_EQ(parse({"--nproc-per-node=gpu", "p"}).nproc_per_node, 4);
    EXPECT_EQ(parse({"--nproc-per-node=gpu", "--gpus-per-worker=2", "p"}).nproc_per_node, 2);
    EXPECT_NE(refusal({"--nproc-per-node=3", "--gpus-per-worker=2", "p"})
                  .find("--gpus-per-worker 2 for 3 worker(s) needs 6 GPUs; this node has 4 for the step "
                        "(CUDA_VISIBLE_DEVICES=4,5,6,7)"),
              std::string::npos);
    setenv("CUDA_VISIBLE_DEVICES", "", 1);
    EXPECT_NE(refusal({"--nproc-per-node=gpu", "p"}).find("no GPU for this step on this node (CUDA_VISIBLE_DEVICES"),
              std::string::npos);
    if (saved)
      setenv("CUDA_VISIBLE_DEVICES", was.c_str(), 1);
    else
      unsetenv("CUDA_VISIBLE_DEVICES");
  }
  EXPECT_GE(parse({"--nproc-per-node=cpu", "p"}).nproc_per_node, 1);
  EXPECT_GE(parse({"--nproc-per-node=auto", "p"}).nproc_per_node, 1);
}

TEST(Options, BadValuesAreOneLineErrorsNamingTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{}, "no program to run"},
      {{"--nnodes=0", "p"}, "--nnodes='0'"},
      {{"--nnodes=4:2", "p"}, "MIN is larger than MAX"},
      {{"--nnodes=a", "p"}, "--nnodes='a'"},
      {{"--nproc-per-node=0", "p"}, "--nproc-per-node='0'"},
      {{"--rdzv-backend=zookeeper", "p"}, "--rdzv-backend='zookeeper'"},
      {{"--rdzv-conf=join_timeout", "p"}, "is not KEY=VALUE"},
      {{"--rdzv-conf=is_host=maybe", "p"}, "is_host='maybe'"},
      {{"--rdzv-conf=heartbeat_timeout=0.1", "p"}, "at least 0.2 s"},
      {{"--monitor-interval=-1", "p"}, "--monitor-interval='-1'"},
      {{"--stop-grace=soon", "p"}, "--stop-grace='soon'"},
      {{"--master-port=70000", "--master-addr=h", "p"}, "--master-port='70000'"},
      {{"--node-rank=-1", "p"}, "--node-rank='-1'"},
      {{"--local-ranks-filter=a", "p"}, "--local-ranks-filter='a'"},
      {{"--start-method=thread", "p"}, "--start-method='thread'"},
      {{"--max-restarts=-1", "p"}, "--max-restarts must be 0 or more"},
      {{"--no-python", "-m", "p"}, "contradict"},
      {{"--standalone", "--rdzv-endpoint=h:1", "p"}, "contradict"},
      {{"--standalone", "--nnodes=1:2", "p"}, "--standalone runs one node"},
      {{"--rdzv-backend=etcd", "p"}, "needs --rdzv-endpoint"},
      {{"--scale-up-checkpoint=perhaps", "p"}, "--scale-up-checkpoint='perhaps'"},
      {{"--requeue-budget=app", "p"}, "is not CLASS:COUNT"},
      {{"--requeue-budget=disk:1", "p"}, "unknown class 'disk'"},
      {{"--requeue-budget=app:-2", "p"}, "is not a count"},
      {{"-r", "4", "p"}, "--redirects='4'"},
      {{"--nnodes", "", "p"}, "--nnodes is empty"},
      {{"--rdzv-id=" + std::string(5000, 'x'), "p"}, "--rdzv-id='xxxx"},
      {{"--role=a\tb", "p"}, "--role='a\\x09b' must be at most 100 printable characters"},
      {{"--rdzv-auth=maybe", "p"}, "--rdzv-auth='maybe' is not one of"},
      {{"--rdzv-endpoint=h:0", "p"}, "--rdzv-endpoint='h:0' is not HOST[:PORT]"},
      {{"--rdzv-endpoint=:29400", "p"}, "--rdzv-endpoint=':29400'"},
      {{"--het-nnodes=1:1,x", "p"}, "'x' is not N or MIN:MAX"},
      {{"--het-nnodes=2:1", "p"}, "'2:1' is not N or MIN:MAX"},
      {{"--het-nnodes=,", "p"}, "--het-nnodes=','"},
      {{"--het-nnodes=1,2", "--nnodes=3", "p"}, "contradict"},
      {{"--het-nnodes=1,2", "--standalone", "p"}, "contradict"},
      {{"--no-such-flag", "p"}, "no-such-flag"},
  };
  for (const auto& [args, want] : cases) {
    const auto error = refusal(args);
    EXPECT_NE(error.find(want), std::string::npos) << "error '" << error << "' lacks '" << want << "'";
  }
  EXPECT_NE(refusal({"p"}, {{"nnodes", "x"}}).find("PET_NNODES='x' (the default for --nnodes): --nnodes='x'"),
            std::string::npos)
      << "a bad PET_ value names the variable";
  EXPECT_EQ(refusal({"--nnodes=y", "p"}, {{"nnodes", "x"}}).find("PET_"), std::string::npos)
      << "the flag on the line is what was wrong";
  EXPECT_NE(refusal({"p"}, {{"nproc_per_node", "0"}}).find("PET_NPROC_PER_NODE='0'"), std::string::npos);
}

TEST(Options, HetNnodesPerComponent) {
  for (const char* flag : {"--het-nnodes=1,2:3", "--het_nnodes=1,2:3"}) {
    auto o = parse({flag, "p"});
    EXPECT_EQ(o.het_nnodes, (std::vector<std::pair<int, int>>{{1, 1}, {2, 3}}));
    EXPECT_FALSE(o.min_nodes) << "the job-wide bounds are the sums, computed at bootstrap";
  }
}

TEST(Options, StreamSpecs) {
  EXPECT_EQ(parse_stream_spec("-r", "3").all, 3);
  const auto spec = parse_stream_spec("-t", "0:1,2:3");
  EXPECT_EQ(spec.all, 0);
  EXPECT_EQ(spec.for_rank(0), 1);
  EXPECT_EQ(spec.for_rank(1), 0);
  EXPECT_EQ(spec.for_rank(2), 3);
  for (const char* bad : {"", "x", "5", "0:", ":1", "0:4", "-1:1", "0:1;1:2"})
    EXPECT_THROW(parse_stream_spec("-r", bad), UsageError) << bad;
}

TEST(Options, RequeueBudgetKeepsUnnamedClasses) {
  const std::array<std::int64_t, kFailureClasses> defaults{0, 3, kUnlimited, kUnlimited};
  EXPECT_EQ(parse_requeue_budget("node:0", defaults),
            (std::array<std::int64_t, kFailureClasses>{0, 0, kUnlimited, kUnlimited}));
  EXPECT_EQ(parse_requeue_budget("preempt:2,app:inf", defaults),
            (std::array<std::int64_t, kFailureClasses>{kUnlimited, 3, kUnlimited, 2}));
}

TEST(Options, EnumNamesRoundTrip) {
  for (auto c : {FailureClass::App, FailureClass::Node, FailureClass::TimeLimit, FailureClass::Preempt})
    EXPECT_EQ(failure_class_from_string(to_string(c)), c);
  EXPECT_FALSE(failure_class_from_string("timeout"));
  for (auto b : {RdzvBackend::C10d, RdzvBackend::Static, RdzvBackend::Etcd, RdzvBackend::EtcdV2})
    EXPECT_EQ(rdzv_backend_from_string(to_string(b)), b);
  EXPECT_TRUE(uses_etcd(RdzvBackend::EtcdV2));
  EXPECT_FALSE(uses_etcd(RdzvBackend::Static));
}

}  // namespace
}  // namespace elastrun::launcher
