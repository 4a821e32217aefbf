#include <gtest/gtest.h>

#include <chrono>

#include "elastrun/rdzv/env.hpp"
#include "elastrun/rdzv/hostlist.hpp"

using elastrun::rdzv::compress_hostlist;
using elastrun::rdzv::detect_environment;
using elastrun::rdzv::EnvError;
using elastrun::rdzv::expand_hostlist;
using elastrun::rdzv::hostlist_size;
using elastrun::rdzv::kMaxHostlistNodes;
using Hosts = std::vector<std::string>;

struct HostlistCase {
  const char* expression;
  Hosts expected;
};

class HostlistExpand : public testing::TestWithParam<HostlistCase> {};

TEST_P(HostlistExpand, ExpandsLikeSlurm) {
  auto hosts = expand_hostlist(GetParam().expression);
  ASSERT_TRUE(hosts.has_value()) << GetParam().expression;
  EXPECT_EQ(*hosts, GetParam().expected);
}

INSTANTIATE_TEST_SUITE_P(Table, HostlistExpand,
                         testing::Values(HostlistCase{"n1", {"n1"}}, HostlistCase{"n[1-4]", {"n1", "n2", "n3", "n4"}},
                                         HostlistCase{"gpu[01-03]", {"gpu01", "gpu02", "gpu03"}},
                                         HostlistCase{"gpu[08-11]", {"gpu08", "gpu09", "gpu10", "gpu11"}},
                                         HostlistCase{"node[001-002,010]", {"node001", "node002", "node010"}},
                                         HostlistCase{"a[1-2]b[3-4]", {"a1b3", "a1b4", "a2b3", "a2b4"}},
                                         HostlistCase{"n[1-2],login1,gpu[7-8]", {"n1", "n2", "login1", "gpu7", "gpu8"}},
                                         HostlistCase{"c1-ib,c2-ib", {"c1-ib", "c2-ib"}},
                                         HostlistCase{"rack1-n[3-4]", {"rack1-n3", "rack1-n4"}}));

TEST(Hostlist, RejectsMalformedExpressions) {
  for (const char* bad : {"", "   ", "n[1-", "n[4-1]", "n[a-b]", "n]1[", "n[[1]", "n[1-2]]", "n[]", "n[1,,2]", "n[-2]"})
    EXPECT_FALSE(expand_hostlist(bad).has_value()) << "'" << bad << "' was accepted";
}

TEST(Hostlist, SizeIsCountedWithoutExpanding) {
  EXPECT_EQ(hostlist_size("n[1-4],gpu[01-02]"), 6u);
  EXPECT_EQ(hostlist_size("a,b,c[1,3-4]"), 5u);
  EXPECT_EQ(hostlist_size("rack[1-2]n[1-3]"), 6u);
  EXPECT_FALSE(hostlist_size("n[4-1]"));
  // 10^8 names: counted in no time, and neither the expander nor the environment expands them
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_GT(*hostlist_size("a[1-1000]b[1-1000]c[1-100]"), kMaxHostlistNodes);
  EXPECT_FALSE(expand_hostlist("a[1-1000]b[1-1000]c[1-100]"));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  try {
    detect_environment({{"SLURM_JOB_ID", "1"},
                        {"SLURM_STEP_ID", "0"},
                        {"SLURM_PROCID", "0"},
                        {"SLURM_NTASKS", "1"},
                        {"SLURM_STEP_NUM_TASKS", "1"},
                        {"SLURM_STEP_NODELIST", "a[1-1000]b[1-1000]c[1-100]"},
                        {"SLURM_JOB_NODELIST", "a[1-1000]b[1-1000]c[1-100]"}},
                       expand_hostlist);
    ADD_FAILURE() << "a node list of 10^8 names was accepted";
  } catch (const EnvError& e) {
    EXPECT_NE(std::string(e.what()).find("names more than 100000 nodes"), std::string::npos) << e.what();
  }
}

TEST(Hostlist, CompressIsInverseOfExpand) {
  EXPECT_EQ(compress_hostlist({"n1", "n2", "n3", "n4"}), "n[1-4]");
  EXPECT_EQ(compress_hostlist({"gpu01", "gpu02", "gpu09"}), "gpu[01-02,09]");
  auto hosts = expand_hostlist("x[1-3],y7");
  ASSERT_TRUE(hosts);
  EXPECT_EQ(expand_hostlist(compress_hostlist(*hosts)), hosts);
}
