// The torch variables of a task, computed from Slurm variables as a step's tasks see them
// (values taken from the testbed, Slurm 22.05).
#include <gtest/gtest.h>

#include <map>
#include <sstream>

#include "torch_env.hpp"

using namespace elastrun::spank;
using elastrun::rdzv::EnvMap;

namespace {

// n[1-2], n1,n2, n[1-3]: enough hostlist syntax for these tests.
std::optional<std::vector<std::string>> fake_expand(std::string_view text) {
  if (text == "n[1-2]" || text == "n1,n2") return std::vector<std::string>{"n1", "n2"};
  if (text == "n[1-3]") return std::vector<std::string>{"n1", "n2", "n3"};
  if (text == "n[2-3]") return std::vector<std::string>{"n2", "n3"};
  if (text.find('[') == std::string_view::npos && text.find(',') == std::string_view::npos)
    return std::vector<std::string>{std::string(text)};
  return std::nullopt;
}

EnvMap step_task(int procid, int nodeid, int localid) {
  return {{"SLURM_JOB_ID", "11"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_JOB_NODELIST", "n[1-2]"},
          {"SLURM_STEP_NODELIST", "n[1-2]"},
          {"SLURM_STEP_NUM_NODES", "2"},
          {"SLURM_STEP_NUM_TASKS", "4"},
          {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"},
          {"SLURM_PROCID", std::to_string(procid)},
          {"SLURM_NODEID", std::to_string(nodeid)},
          {"SLURM_LOCALID", std::to_string(localid)},
          {"SLURMD_NODENAME", nodeid == 0 ? "n1" : "n2"}};
}

std::map<std::string, std::string> as_map(const EnvVars& vars) { return {vars.begin(), vars.end()}; }

}  // namespace

TEST(TorchEnvironment, TaskOfAPlainStep) {
  auto d = detect_step(step_task(3, 1, 1), fake_expand);
  EXPECT_EQ(master_node(d), "n1");
  auto v = as_map(torch_environment(d, "127.0.0.1", RunIdMode::Step));
  EXPECT_EQ(v["RANK"], "3");
  EXPECT_EQ(v["LOCAL_RANK"], "1");
  EXPECT_EQ(v["WORLD_SIZE"], "4");
  EXPECT_EQ(v["LOCAL_WORLD_SIZE"], "2");
  EXPECT_EQ(v["GROUP_RANK"], "1");
  EXPECT_EQ(v["NODE_RANK"], "1");
  EXPECT_EQ(v["GROUP_WORLD_SIZE"], "2");
  EXPECT_EQ(v["ROLE_RANK"], "3");
  EXPECT_EQ(v["ROLE_WORLD_SIZE"], "4");
  EXPECT_EQ(v["MASTER_ADDR"], "127.0.0.1");
  // propose_endpoint: 24000 + (11 * 32 + 0) % 8000
  EXPECT_EQ(v["MASTER_PORT"], "24352");
  EXPECT_EQ(v["TORCHELASTIC_RUN_ID"], "11.0.r0");
  EXPECT_EQ(v["TORCHELASTIC_RESTART_COUNT"], "0");
  EXPECT_EQ(as_map(torch_environment(d, "x", RunIdMode::Job))["TORCHELASTIC_RUN_ID"], "11.r0");
  for (const auto& name : torch_variable_names()) EXPECT_TRUE(v.count(name)) << name;
}

TEST(TorchEnvironment, StaleTorchAndMpiVariablesAreIgnored) {
  auto env = step_task(2, 1, 0);
  env["RANK"] = "7";
  env["WORLD_SIZE"] = "9";
  env["MASTER_PORT"] = "1";
  env["TORCHELASTIC_RUN_ID"] = "stale";
  env["OMPI_COMM_WORLD_RANK"] = "5";
  env["OMPI_COMM_WORLD_SIZE"] = "6";
  auto v = as_map(torch_environment(detect_step(env, fake_expand), "a", RunIdMode::Step));
  EXPECT_EQ(v["RANK"], "2");
  EXPECT_EQ(v["WORLD_SIZE"], "4");
  EXPECT_EQ(v["MASTER_PORT"], "24352");
  EXPECT_EQ(v["TORCHELASTIC_RUN_ID"], "11.0.r0");
}

TEST(TorchEnvironment, ConcurrentStepsGetDistinctPorts) {
  auto a = step_task(0, 0, 0);
  auto b = a;
  b["SLURM_STEP_ID"] = "1";
  auto va = as_map(torch_environment(detect_step(a, fake_expand), "a", RunIdMode::Step));
  auto vb = as_map(torch_environment(detect_step(b, fake_expand), "a", RunIdMode::Step));
  EXPECT_NE(va["MASTER_PORT"], vb["MASTER_PORT"]);
  EXPECT_NE(va["TORCHELASTIC_RUN_ID"], vb["TORCHELASTIC_RUN_ID"]);
}

TEST(TorchEnvironment, RestartCountInRunId) {
  auto env = step_task(0, 0, 0);
  env["SLURM_RESTART_COUNT"] = "2";
  auto d = detect_step(env, fake_expand);
  EXPECT_EQ(run_id(d, RunIdMode::Step), "11.0.r2");
  EXPECT_EQ(run_id(d, RunIdMode::Job), "11.r2");
}

TEST(TorchEnvironment, HeterogeneousStepHasGlobalRanks) {
  // srun -N1 -n1 : -N1 -n2 on the testbed: job 8 (+9), legacy PACK_GROUP variables only.
  EnvMap env = {{"SLURM_JOB_ID", "8"},
                {"SLURM_STEP_ID", "0"},
                {"SLURM_HET_SIZE", "2"},
                {"SLURM_PACK_SIZE", "2"},
                {"SLURM_JOB_ID_PACK_GROUP_0", "8"},
                {"SLURM_JOB_NODELIST_PACK_GROUP_0", "n1"},
                {"SLURM_JOB_ID_PACK_GROUP_1", "9"},
                {"SLURM_JOB_NODELIST_PACK_GROUP_1", "n2"},
                {"SLURM_JOB_NODELIST", "n[1-2]"},
                {"SLURM_STEP_NODELIST", "n[1-2]"},
                {"SLURM_STEP_TASKS_PER_NODE", "1,2"},
                {"SLURM_STEP_NUM_TASKS", "3"},
                {"SLURM_STEP_NUM_NODES", "2"},
                {"SLURM_PROCID", "2"},
                {"SLURM_NODEID", "1"},
                {"SLURM_LOCALID", "1"},
                {"SLURMD_NODENAME", "n2"}};
  auto d = detect_step(env, fake_expand);
  EXPECT_EQ(master_node(d), "n1");
  auto v = as_map(torch_environment(d, "127.0.0.1", RunIdMode::Step));
  EXPECT_EQ(v["RANK"], "2");
  EXPECT_EQ(v["WORLD_SIZE"], "3");
  EXPECT_EQ(v["LOCAL_WORLD_SIZE"], "2");
  EXPECT_EQ(v["GROUP_RANK"], "1");
  EXPECT_EQ(v["MASTER_PORT"], "24256");  // 24000 + 8 * 32
}

TEST(TorchEnvironment, NotAStep) {
  EnvMap batch = {{"SLURM_JOB_ID", "11"}, {"SLURM_JOB_NODELIST", "n[1-2]"}, {"SLURM_NODEID", "0"}};
  EXPECT_THROW(detect_step(batch, fake_expand), OptionError);
  EXPECT_THROW(detect_step({}, fake_expand), OptionError);
  auto bad = step_task(0, 0, 0);
  bad["SLURM_PROCID"] = "4";  // not below SLURM_STEP_NUM_TASKS
  EXPECT_THROW(detect_step(bad, fake_expand), elastrun::rdzv::EnvError);
}

TEST(TaskDevice, GpuAndNcclVariablesOfATaskLikeTheAgentsWorkers) {
  // --gpus-per-task=1, local rank 2: its one GPU is device 0; NCCL fails fast; the NIC when given
  const EnvMap task{{"CUDA_VISIBLE_DEVICES", "2"}, {"SLURM_GPUS_ON_NODE", "4"}};
  const auto vars = task_device_environment(task, 2, "ib0");
  const std::map<std::string, std::string> got(vars.begin(), vars.end());
  EXPECT_EQ(got, (std::map<std::string, std::string>{{"ELASTRUN_DEVICE", "0"},
                                                     {"NCCL_ASYNC_ERROR_HANDLING", "1"},
                                                     {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"},
                                                     {"NCCL_SOCKET_IFNAME", "ib0"},
                                                     {"GLOO_SOCKET_IFNAME", "ib0"}}));
  // what the user set stays; no GPUs: no ELASTRUN_DEVICE
  const auto user = task_device_environment({{"NCCL_ASYNC_ERROR_HANDLING", "0"}}, 1, "");
  const std::map<std::string, std::string> kept(user.begin(), user.end());
  EXPECT_EQ(kept, (std::map<std::string, std::string>{{"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"}}));
}
