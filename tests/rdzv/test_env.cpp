// Table-driven tests of environment detection. The hostlist expander is libslurm's real one.
#include <gtest/gtest.h>

#include "elastrun/rdzv/env.hpp"
#include "elastrun/rdzv/hostlist.hpp"

namespace {

using namespace elastrun::rdzv;

DetectedEnv detect(const EnvMap& env) { return detect_environment(env, expand_hostlist); }

// A 4-node, 8-task srun step as seen by task 3 (node n2, second task there).
EnvMap slurm_step() {
  return {{"SLURM_JOB_ID", "4242"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_PROCID", "3"},
          {"SLURM_LOCALID", "1"},
          {"SLURM_NODEID", "1"},
          {"SLURM_STEP_NUM_TASKS", "8"},
          {"SLURM_NTASKS", "8"},
          {"SLURM_STEP_NUM_NODES", "4"},
          {"SLURM_STEP_NODELIST", "n[1-4]"},
          {"SLURM_JOB_NODELIST", "n[1-4]"},
          {"SLURM_STEP_TASKS_PER_NODE", "2(x4)"},
          {"SLURM_TASKS_PER_NODE", "2(x4)"},
          {"SLURMD_NODENAME", "n2"},
          {"SLURM_CLUSTER_NAME", "tb"}};
}

// Task 3 (on n3) of "srun --het-group=0,1" in a het job "-N1 -n1 : -N2 -n4" (as on the testbed).
EnvMap het_step() {
  return {{"SLURM_JOB_ID", "3"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_PROCID", "3"},
          {"SLURM_LOCALID", "0"},
          {"SLURM_NODEID", "2"},
          {"SLURM_STEP_NUM_TASKS", "5"},
          {"SLURM_STEP_NUM_NODES", "3"},
          {"SLURM_STEP_NODELIST", "n[1-3]"},
          {"SLURM_STEP_TASKS_PER_NODE", "1,2(x2)"},
          {"SLURM_JOB_NODELIST", "n1"},
          {"SLURMD_NODENAME", "n3"},
          {"SLURM_HET_SIZE", "2"},
          {"SLURM_PACK_SIZE", "2"},
          {"SLURM_JOB_ID_HET_GROUP_0", "3"},
          {"SLURM_JOB_ID_HET_GROUP_1", "4"},
          {"SLURM_JOB_NODELIST_HET_GROUP_0", "n1"},
          {"SLURM_JOB_NODELIST_HET_GROUP_1", "n[2-3]"},
          {"SLURM_NTASKS_HET_GROUP_0", "1"},
          {"SLURM_NTASKS_HET_GROUP_1", "4"},
          {"SLURM_TASKS_PER_NODE_HET_GROUP_0", "1"},
          {"SLURM_TASKS_PER_NODE_HET_GROUP_1", "2(x2)"}};
}

EnvMap with(EnvMap env, std::initializer_list<std::pair<const std::string, std::string>> set,
            std::initializer_list<std::string> unset = {}) {
  for (const auto& k : unset) env.erase(k);
  for (const auto& [k, v] : set) env[k] = v;
  return env;
}

struct Expect {
  RankSource source;
  int rank, world, local_rank, local_world, node_rank, num_nodes;
};

struct GoodCase {
  const char* name;
  EnvMap env;
  Expect expect;
};

class DetectGood : public testing::TestWithParam<GoodCase> {};

TEST_P(DetectGood, Placement) {
  const auto& c = GetParam();
  auto d = detect(c.env);
  const auto& p = d.placement;
  EXPECT_EQ(p.source, c.expect.source) << to_string(p.source);
  EXPECT_EQ(p.rank, c.expect.rank);
  EXPECT_EQ(p.world_size, c.expect.world);
  EXPECT_EQ(p.local_rank, c.expect.local_rank);
  EXPECT_EQ(p.local_world_size, c.expect.local_world);
  EXPECT_EQ(p.node_rank, c.expect.node_rank);
  EXPECT_EQ(p.num_nodes, c.expect.num_nodes);
}

INSTANTIATE_TEST_SUITE_P(
    Table, DetectGood,
    testing::Values(
        GoodCase{"nothing_is_standalone", {}, {RankSource::Standalone, 0, 1, 0, 1, 0, 1}},
        GoodCase{"srun_step", slurm_step(), {RankSource::Slurm, 3, 8, 1, 2, 1, 4}},
        GoodCase{"het_step_global_ranks", het_step(), {RankSource::Slurm, 3, 5, 0, 2, 2, 3}},
        GoodCase{"uneven_tasks_per_node",
                 with(slurm_step(), {{"SLURM_STEP_TASKS_PER_NODE", "3,2(x2),1"},
                                     {"SLURM_PROCID", "7"},
                                     {"SLURM_NODEID", "3"},
                                     {"SLURM_LOCALID", "0"},
                                     {"SLURMD_NODENAME", "n4"}}),
                 {RankSource::Slurm, 7, 8, 0, 1, 3, 4}},
        GoodCase{"zero_padded_nodes",
                 with(slurm_step(), {{"SLURM_STEP_NODELIST", "gpu[09-12]"},
                                     {"SLURM_JOB_NODELIST", "gpu[09-12]"},
                                     {"SLURMD_NODENAME", "gpu10"}}),
                 {RankSource::Slurm, 3, 8, 1, 2, 1, 4}},
        GoodCase{"legacy_spellings",
                 with(slurm_step(), {{"SLURM_JOBID", "4242"}, {"SLURM_NPROCS", "8"}},
                      {"SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"}),
                 {RankSource::Slurm, 3, 8, 1, 2, 1, 4}},
        GoodCase{"batch_script_is_one_process",
                 {{"SLURM_JOB_ID", "77"},
                  {"SLURM_JOB_NODELIST", "n[1-2]"},
                  {"SLURM_NNODES", "2"},
                  {"SLURM_TASKS_PER_NODE", "4(x2)"},
                  {"SLURM_NTASKS", "8"},
                  {"SLURM_PROCID", "0"},
                  {"SLURM_NODEID", "0"},
                  {"SLURM_LOCALID", "0"},
                  {"SLURMD_NODENAME", "n1"}},
                 {RankSource::Slurm, 0, 1, 0, 1, 0, 2}},
        GoodCase{"openmpi_overrides_enclosing_batch_step",
                 {{"SLURM_JOB_ID", "77"},
                  {"SLURM_JOB_NODELIST", "n[1-2]"},
                  {"SLURM_PROCID", "0"},
                  {"OMPI_COMM_WORLD_RANK", "5"},
                  {"OMPI_COMM_WORLD_SIZE", "8"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                  {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                  {"PMIX_RANK", "5"},
                  {"PMIX_NAMESPACE", "prterun-x-1@1"}},
                 {RankSource::OpenMPI, 5, 8, 1, 4, 1, 2}},
        GoodCase{"pmix_under_srun_agrees_with_slurm",
                 with(slurm_step(), {{"PMIX_RANK", "3"}, {"PMIX_NAMESPACE", "slurm.pmix.4242.0"}}),
                 {RankSource::Slurm, 3, 8, 1, 2, 1, 4}},
        GoodCase{"pmi2_without_slurm", {{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}}, {RankSource::PMI2, 2, 4, 0, 1, 2, 4}},
        GoodCase{"torch_worker_variables_win",
                 with(slurm_step(), {{"RANK", "5"},
                                     {"WORLD_SIZE", "16"},
                                     {"LOCAL_RANK", "1"},
                                     {"LOCAL_WORLD_SIZE", "4"},
                                     {"GROUP_RANK", "1"},
                                     {"GROUP_WORLD_SIZE", "4"},
                                     {"MASTER_ADDR", "n1"},
                                     {"MASTER_PORT", "29500"}}),
                 {RankSource::Torchrun, 5, 16, 1, 4, 1, 4}}),
    [](const auto& info) { return std::string(info.param.name); });

struct BadCase {
  const char* name;
  EnvMap env;
  const char* must_name;  // the variable the one-line error must name
};

class DetectBad : public testing::TestWithParam<BadCase> {};

TEST_P(DetectBad, OneLineErrorNamingTheVariable) {
  const auto& c = GetParam();
  try {
    detect(c.env);
    FAIL() << "accepted an inconsistent environment";
  } catch (const EnvError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(c.must_name), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "multi-line: " << msg;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Table, DetectBad,
    testing::Values(
        BadCase{"procid_not_below_ntasks", with(slurm_step(), {{"SLURM_PROCID", "8"}}), "SLURM_PROCID"},
        BadCase{"procid_not_a_number", with(slurm_step(), {{"SLURM_PROCID", "three"}}), "SLURM_PROCID"},
        BadCase{"procid_negative", with(slurm_step(), {{"SLURM_PROCID", "-1"}}), "SLURM_PROCID"},
        BadCase{"nodeid_without_nodelist", with(slurm_step(), {}, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"}),
                "SLURM_NODEID"},
        BadCase{"unparsable_nodelist", with(slurm_step(), {{"SLURM_STEP_NODELIST", "n[1-"}}), "SLURM_STEP_NODELIST"},
        BadCase{"unparsable_job_nodelist", with(slurm_step(), {{"SLURM_JOB_NODELIST", "n[x]"}}), "SLURM_JOB_NODELIST"},
        BadCase{"nodeid_beyond_nodes", with(slurm_step(), {{"SLURM_NODEID", "4"}}), "SLURM_NODEID"},
        BadCase{"node_count_mismatch", with(slurm_step(), {{"SLURM_STEP_NUM_NODES", "3"}}), "SLURM_STEP_NUM_NODES"},
        BadCase{"tasks_per_node_garbage", with(slurm_step(), {{"SLURM_STEP_TASKS_PER_NODE", "2(x"}}),
                "SLURM_STEP_TASKS_PER_NODE"},
        BadCase{"tasks_per_node_wrong_node_count", with(slurm_step(), {{"SLURM_STEP_TASKS_PER_NODE", "2(x3)"}}),
                "SLURM_STEP_TASKS_PER_NODE"},
        BadCase{"tasks_per_node_wrong_sum", with(slurm_step(), {{"SLURM_STEP_TASKS_PER_NODE", "3(x4)"}}),
                "SLURM_STEP_NUM_TASKS"},
        BadCase{"localid_beyond_node_tasks", with(slurm_step(), {{"SLURM_LOCALID", "2"}}), "SLURM_LOCALID"},
        BadCase{"nodename_contradicts_nodeid", with(slurm_step(), {{"SLURMD_NODENAME", "n3"}}), "SLURMD_NODENAME"},
        BadCase{"step_vars_without_job_id", with(slurm_step(), {}, {"SLURM_JOB_ID"}), "SLURM_JOB_ID"},
        BadCase{"job_id_not_a_number", with(slurm_step(), {{"SLURM_JOB_ID", "abc"}}), "SLURM_JOB_ID"},
        BadCase{"job_without_nodelist", {{"SLURM_JOB_ID", "5"}}, "SLURM_JOB_NODELIST"},
        BadCase{"het_size_without_components", with(slurm_step(), {{"SLURM_HET_SIZE", "2"}}), "SLURM_HET_SIZE"},
        BadCase{"pmix_contradicts_slurm", with(slurm_step(), {{"PMIX_RANK", "4"}}), "PMIX_RANK"},
        BadCase{"pmi2_contradicts_slurm", with(slurm_step(), {{"PMI_RANK", "0"}, {"PMI_SIZE", "8"}}), "PMI_RANK"},
        BadCase{
            "het_components_outside_the_step",
            with(het_step(), {{"SLURM_JOB_NODELIST_HET_GROUP_0", "x1"}, {"SLURM_JOB_NODELIST_HET_GROUP_1", "x[2-3]"}}),
            "SLURM_HET_SIZE"},
        BadCase{"het_component_nodelist_garbage", with(het_step(), {{"SLURM_JOB_NODELIST_HET_GROUP_1", "n[2-"}}),
                "SLURM_JOB_NODELIST_HET_GROUP_1"},
        BadCase{"pmix_alone_has_no_size", {{"PMIX_RANK", "0"}}, "PMIX_RANK"},
        BadCase{"pmi_rank_not_below_size", {{"PMI_RANK", "4"}, {"PMI_SIZE", "4"}}, "PMI_RANK"},
        BadCase{"ompi_rank_without_size", {{"OMPI_COMM_WORLD_RANK", "1"}}, "OMPI_COMM_WORLD_SIZE"},
        BadCase{"ompi_rank_not_below_size",
                {{"OMPI_COMM_WORLD_RANK", "8"}, {"OMPI_COMM_WORLD_SIZE", "8"}},
                "OMPI_COMM_WORLD_RANK"},
        BadCase{"rank_without_world_size", {{"RANK", "0"}}, "WORLD_SIZE"},
        BadCase{"rank_not_below_world_size", {{"RANK", "2"}, {"WORLD_SIZE", "2"}}, "RANK"},
        BadCase{
            "master_port_out_of_range", {{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}}, "MASTER_PORT"}),
    [](const auto& info) { return std::string(info.param.name); });

// One run-id format for the agent and both plugin modes (rdzv::format_run_id).
TEST(RunId, JobWideAndPerStep) {
  EXPECT_EQ(format_run_id("17", std::nullopt, "0"), "17.r0");
  EXPECT_EQ(format_run_id("17", std::nullopt, ""), "17.r0");
  EXPECT_EQ(format_run_id("17", "2", "3"), "17.2.r3");
}

TEST(TasksPerNode, ParsesSlurmCompressedForm) {
  EXPECT_EQ(parse_tasks_per_node("2(x3),1"), (std::vector<int>{2, 2, 2, 1}));
  EXPECT_EQ(parse_tasks_per_node("8"), (std::vector<int>{8}));
  EXPECT_EQ(parse_tasks_per_node("1,2,3"), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(parse_tasks_per_node("4(x2),3(x1)"), (std::vector<int>{4, 4, 3}));
  for (const char* bad : {"", ",", "2(x0)", "2(3)", "x", "2(x3", "1,,2", "2(x3)junk", "-1"})
    EXPECT_THROW(parse_tasks_per_node(bad), std::invalid_argument) << bad;
}

TEST(Endpoint, DeterministicPerJobAndStepInsideDocumentedRange) {
  auto a = propose_endpoint("n1", 4242, 0);
  auto b = propose_endpoint("n1", 4242, 0);
  auto c = propose_endpoint("n1", 4242, 1);
  auto d = propose_endpoint("n1", 4243, 0);
  EXPECT_EQ(a.port, b.port);
  EXPECT_NE(a.port, c.port);
  EXPECT_NE(a.port, d.port);
  for (const auto& e : {a, c, d}) {
    EXPECT_GE(e.port, kPortBase);
    EXPECT_LT(e.port, kPortBase + kPortSpan);
    ASSERT_EQ(e.fallback_ports.size(), static_cast<std::size_t>(kPortFallbacks));
    for (auto p : e.fallback_ports) {
      EXPECT_NE(p, e.port);
      EXPECT_GE(p, kPortBase);
      EXPECT_LT(p, kPortBase + kPortSpan);
    }
  }
  auto wrap = propose_endpoint("n1", 0, kPortSpan - 1);  // step wraps within 32; still in range
  EXPECT_LT(wrap.port, kPortBase + kPortSpan);
}

TEST(Detect, SlurmStepProposesFirstNodeAndJobRunId) {
  auto d = detect(with(slurm_step(), {{"SLURM_RESTART_COUNT", "2"}}));
  ASSERT_TRUE(d.rdzv_endpoint);
  EXPECT_EQ(d.rdzv_endpoint->host, "n1");
  EXPECT_EQ(d.rdzv_endpoint->port, propose_endpoint("n1", 4242, 0).port);
  EXPECT_EQ(d.run_id, "4242.r2");
  ASSERT_TRUE(d.slurm);
  EXPECT_EQ(d.slurm->restart_count, 2);
  EXPECT_EQ(d.slurm->tasks_per_node, (std::vector<int>{2, 2, 2, 2}));
}

TEST(Detect, HetStepComponentsAndOffsets) {
  auto d = detect(het_step());
  ASSERT_TRUE(d.slurm);
  const auto& s = *d.slurm;
  EXPECT_EQ(s.het_size, 2);
  EXPECT_EQ(s.het_component, 1);
  ASSERT_EQ(s.het_components.size(), 2u);
  EXPECT_EQ(s.het_components[0].job_id, "3");
  EXPECT_EQ(s.het_components[0].task_offset, 0);
  EXPECT_EQ(s.het_components[0].ntasks, 1);
  EXPECT_EQ(s.het_components[1].job_id, "4");
  EXPECT_EQ(s.het_components[1].nodes, (std::vector<std::string>{"n2", "n3"}));
  EXPECT_EQ(s.het_components[1].task_offset, 1);
  EXPECT_EQ(s.het_components[1].node_offset, 1);
  EXPECT_EQ(s.het_components[1].ntasks, 4);
  ASSERT_TRUE(d.rdzv_endpoint);
  EXPECT_EQ(d.rdzv_endpoint->host, "n1");
}

TEST(Detect, HetStepOfOneComponentOnly) {
  // srun --het-group=1: only component 1 takes part; ranks start at 0 there.
  auto d = detect(with(het_step(), {{"SLURM_STEP_NODELIST", "n[2-3]"},
                                    {"SLURM_STEP_NUM_NODES", "2"},
                                    {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"},
                                    {"SLURM_STEP_NUM_TASKS", "4"},
                                    {"SLURM_PROCID", "2"},
                                    {"SLURM_NODEID", "1"},
                                    {"SLURM_JOB_NODELIST", "n[2-3]"}}));
  ASSERT_TRUE(d.slurm);
  ASSERT_EQ(d.slurm->het_components.size(), 1u);
  EXPECT_EQ(d.slurm->het_components[0].index, 1);
  EXPECT_EQ(d.slurm->het_components[0].task_offset, 0);
  EXPECT_EQ(d.slurm->het_component, 1);
  EXPECT_EQ(d.placement.world_size, 4);
  EXPECT_EQ(d.placement.node_rank, 1);
  EXPECT_EQ(d.rdzv_endpoint->host, "n2");
}

TEST(Detect, LegacyPackGroupNames) {
  EnvMap env = het_step();
  for (int g = 0; g < 2; ++g)
    for (std::string base : {"SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NTASKS", "SLURM_TASKS_PER_NODE"}) {
      auto het = base + "_HET_GROUP_" + std::to_string(g);
      env[base + "_PACK_GROUP_" + std::to_string(g)] = env.at(het);
      env.erase(het);
    }
  env.erase("SLURM_HET_SIZE");
  auto d = detect(env);
  ASSERT_TRUE(d.slurm);
  EXPECT_EQ(d.slurm->het_components.size(), 2u);
  EXPECT_EQ(d.slurm->het_component, 1);
}

TEST(Detect, NoSlurmMeansNoEndpointAndNoLocalhostFallback) {
  auto d = detect({{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}});
  EXPECT_FALSE(d.rdzv_endpoint.has_value());
  EXPECT_TRUE(d.run_id.empty());
}

TEST(Detect, PetOverridesBecomeFlags) {
  auto d = detect({{"PET_NNODES", "2:4"}, {"PET_NPROC_PER_NODE", "2"}, {"PETS", "cat"}});
  EXPECT_EQ(d.pet_overrides.at("nnodes"), "2:4");
  EXPECT_EQ(d.pet_overrides.at("nproc_per_node"), "2");
  EXPECT_EQ(d.pet_overrides.size(), 2u);
}

TEST(Detect, MpiLaunchersAreAllReported) {
  auto d = detect(with(slurm_step(), {{"PMIX_RANK", "3"}, {"PMIX_NAMESPACE", "slurm.pmix.4242.0"}}));
  ASSERT_EQ(d.mpi.size(), 1u);
  EXPECT_EQ(d.mpi[0].kind, "pmix");
  EXPECT_EQ(d.mpi[0].nspace, "slurm.pmix.4242.0");
}

}  // namespace
