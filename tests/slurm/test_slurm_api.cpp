// The libslurm adapter (elastrun::slurm) and the rendezvous' use of it, against the shared testbed
// (SLURM_CONF from ctest).
#include <gtest/gtest.h>

#include "elastrun/rdzv/slurm_api.hpp"
#include "elastrun/slurm/api.hpp"

using namespace elastrun::rdzv;

TEST(SlurmApi, NodeNamesThatDoNotResolveUseSlurmsNodeAddr) {
  // Testbed nodes are named n1..n4 (not in DNS) with NodeAddr=127.0.0.1.
  EXPECT_EQ(resolve_node_address("n1"), "127.0.0.1");
  EXPECT_EQ(resolve_node_address("localhost"), "localhost") << "a resolvable name is kept";
  EXPECT_FALSE(resolve_node_address("no-such-node-anywhere"));
}

TEST(SlurmApi, NodeStateConfirmation) {
  EXPECT_EQ(elastrun::slurm::node_is_down("n2"), std::optional<bool>(false)) << "n2 is up on the shared testbed";
  EXPECT_FALSE(elastrun::slurm::node_is_down("no-such-node-anywhere").has_value());
  EXPECT_TRUE(elastrun::slurm::slurmd_timeout().has_value());
  EXPECT_FALSE(elastrun::slurm::numeric_job_id("12_3").has_value());
  EXPECT_EQ(elastrun::slurm::numeric_job_id("42"), 42u);
}
