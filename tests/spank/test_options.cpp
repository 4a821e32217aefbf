// Option values, their environment form and plugstack.conf site arguments.
#include <gtest/gtest.h>

#include <algorithm>

#include "elastic.hpp"
#include "options.hpp"

using namespace elastrun::spank;

TEST(TorchEnvOption, BareFlagAndBooleans) {
  EXPECT_TRUE(parse_torch_env(nullptr));
  EXPECT_TRUE(parse_torch_env(""));        // environment form with an empty value
  EXPECT_TRUE(parse_torch_env("(null)"));  // sbatch/salloc forward the bare flag like this
  for (const char* yes : {"yes", "YES", "1", "true", "on"}) EXPECT_TRUE(parse_torch_env(yes)) << yes;
  for (const char* no : {"no", "0", "false", "Off"}) EXPECT_FALSE(parse_torch_env(no)) << no;
}

TEST(TorchEnvOption, RejectsOtherValuesWithOneLine) {
  try {
    parse_torch_env("maybe");
    FAIL() << "accepted";
  } catch (const OptionError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("--torch-env='maybe'"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

TEST(ElasticOption, Ranges) {
  EXPECT_EQ(parse_elastic("2:4"), (ElasticRange{2, 4}));
  EXPECT_EQ(parse_elastic("3"), (ElasticRange{3, 3}));
  EXPECT_EQ(parse_elastic("1:1"), (ElasticRange{1, 1}));
  EXPECT_EQ(parse_elastic(nullptr), (ElasticRange{}));
  EXPECT_EQ(parse_elastic(""), (ElasticRange{}));
  EXPECT_EQ(parse_elastic("(null)"), (ElasticRange{}));
}

TEST(ElasticSrunLine, MultiProgIsSeenAmongSrunsOptionsOnly) {
  using elastrun::spank::srun_option_given;
  EXPECT_TRUE(srun_option_given({"srun", "-N2", "--elastic", "--multi-prog", "mp.conf"}, {"mp.conf"}, "--multi-prog"));
  EXPECT_FALSE(srun_option_given({"srun", "-N2", "--elastic", "train", "--multi-prog"}, {"train", "--multi-prog"},
                                 "--multi-prog"))
      << "the program's own argument";
  EXPECT_FALSE(srun_option_given({"srun", "--elastic", "train"}, {"train"}, "--multi-prog"));
}

TEST(ElasticOption, Invalid) {
  for (const char* bad : {"x", "5:", ":5", "0:2", "2:0", "-1:2", "2:4:6", "1.5", " 2:4", "2:4x", "99999999999:1"})
    EXPECT_THROW(parse_elastic(bad), OptionError) << bad;
  try {
    parse_elastic("5:2");
    FAIL() << "accepted";
  } catch (const OptionError& e) {
    EXPECT_NE(std::string(e.what()).find("MIN (5) is greater than MAX (2)"), std::string::npos) << e.what();
  }
}

TEST(ElasticNprocOption, Values) {
  EXPECT_EQ(parse_elastic_nproc("1"), 1);
  EXPECT_EQ(parse_elastic_nproc("8"), 8);
  EXPECT_EQ(parse_elastic_nproc("1024"), 1024);
  for (const char* bad : {"0", "-1", "x", "", "1025", "4 "}) EXPECT_THROW(parse_elastic_nproc(bad), OptionError) << bad;
  EXPECT_THROW(parse_elastic_nproc(nullptr), OptionError);
}

TEST(ElasticAgent, FlagsNameTheStoreAndTheStateDir) {
  AgentPlan plan{.range = {2, 3},
                 .nproc = 4,
                 .store_host = "10.0.0.5",
                 .store_port = 41234,
                 .run_id = "17.0.r0",
                 .log_dir = "/tmp/elastrun-spank.17.0.n1"};
  const std::vector<std::string> expected = {
      "--nnodes=2:3",      "--nproc-per-node=4",    "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.5:41234",
      "--rdzv-id=17.0.r0", "--rdzv-conf=is_host=0", "--rdzv-auth=token",   "--log-dir=/tmp/elastrun-spank.17.0.n1"};
  EXPECT_EQ(agent_flags(plan), expected);
  plan.range = {3, 3};
  plan.nproc = 0;
  auto flags = agent_flags(plan);
  EXPECT_EQ(flags.front(), "--nnodes=3");
  EXPECT_EQ(std::count(flags.begin(), flags.end(), "--nproc-per-node=4"), 0);
  plan.range = {};
  EXPECT_EQ(agent_flags(plan).front(), "--rdzv-backend=c10d");  // the step's node count
  EXPECT_EQ(join_lines({"a", "b", "c"}), "a\nb\nc");
}

TEST(ElasticAgent, Names) {
  EXPECT_EQ(elastic_run_id(17, 2, ""), "17.2.r0");
  EXPECT_EQ(elastic_run_id(17, 2, "3"), "17.2.r3");
  EXPECT_EQ(step_dir_name(17, 0, "n1"), "elastrun-spank.17.0.n1");
  EXPECT_TRUE(is_job_dir_name("elastrun-spank.17.0.n1", 17));
  EXPECT_TRUE(is_job_dir_name("elastrun-spank.17.12.node-a.example", 17));
  for (auto other : {"elastrun-spank.171.0.n1", "elastrun-spank.1.0.n1", "elastrun-spank.17.x.n1",
                     "elastrun-spank.17.0.", "elastrun-spank.17..n1", "elastrun-XXXXXX"})
    EXPECT_FALSE(is_job_dir_name(other, 17)) << other;
  EXPECT_TRUE(safe_token("n1"));
  EXPECT_TRUE(safe_token("node-01.cluster_a"));
  for (auto bad : {"", ".", "..", "a/b", "a b", "n1\n"}) EXPECT_FALSE(safe_token(bad)) << bad;
}

TEST(OptionEnvName, AsSrunReadsIt) {
  // Verified on Slurm 22.05: srun reads SLURM_SPANK__SLURM_SPANK_OPTION_<plugin>_<option>.
  EXPECT_EQ(option_env_name("elastrun", "torch-env"), "SLURM_SPANK__SLURM_SPANK_OPTION_elastrun_torch_env");
  EXPECT_EQ(option_env_name("elastrun", "elastic-nproc"), "SLURM_SPANK__SLURM_SPANK_OPTION_elastrun_elastic_nproc");
}

TEST(SiteArgs, DefaultsAndKeys) {
  auto d = parse_site_args({});
  EXPECT_FALSE(d.torch_env);
  EXPECT_EQ(d.master_addr, MasterAddrMode::Auto);
  EXPECT_EQ(d.run_id, RunIdMode::Step);
  auto s = parse_site_args({"torch_env=yes", "master_addr=nodeaddr", "run_id=job"});
  EXPECT_TRUE(s.torch_env);
  EXPECT_EQ(s.master_addr, MasterAddrMode::NodeAddr);
  EXPECT_EQ(s.run_id, RunIdMode::Job);
  EXPECT_EQ(parse_site_args({"master_addr=HostName"}).master_addr, MasterAddrMode::Hostname);
  EXPECT_FALSE(parse_site_args({"torch_env=yes", "torch_env=no"}).torch_env);  // last wins
  EXPECT_TRUE(d.agent.empty());
  EXPECT_EQ(d.tmpdir, "/tmp");
  auto a = parse_site_args({"agent=/opt/elastrun/bin/elastrun", "tmpdir=/local/scratch"});
  EXPECT_EQ(a.agent, "/opt/elastrun/bin/elastrun");
  EXPECT_EQ(a.tmpdir, "/local/scratch");
  EXPECT_THROW(parse_site_args({"agent=elastrun"}), OptionError);  // not absolute
  EXPECT_THROW(parse_site_args({"tmpdir="}), OptionError);
}

TEST(SiteArgs, UnknownKeyIsNamed) {
  try {
    parse_site_args({"torch_env=yes", "master-addr=auto"});
    FAIL() << "accepted";
  } catch (const OptionError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("unknown site argument 'master-addr'"), std::string::npos) << what;
    EXPECT_NE(what.find("known keys: torch_env, master_addr, run_id"), std::string::npos) << what;
  }
}

TEST(SiteArgs, BadValuesAndShapes) {
  for (auto bad : {"torch_env=maybe", "master_addr=dns", "run_id=task", "torch_env", "=yes", "run_id="})
    EXPECT_THROW(parse_site_args({bad}), OptionError) << bad;
  try {
    parse_site_args({"master_addr=dns"});
  } catch (const OptionError& e) {
    EXPECT_NE(std::string(e.what()).find("master_addr='dns'"), std::string::npos) << e.what();
  }
}
