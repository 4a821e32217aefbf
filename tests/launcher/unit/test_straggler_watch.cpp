// Straggler detection's pure parts (straggler_watch.hpp): a rank's windows from its progress
// records, and group rank 0's scores over canned windows of four nodes.
#include <gtest/gtest.h>

#include "straggler_watch.hpp"

namespace elastrun::launcher {
namespace {

TEST(StragglerWatch, ARanksWindowIsItsMeanComputePerStepOverAtLeastWSteps) {
  ComputeWindows w(10);
  EXPECT_FALSE(w.observe(3, 30'000)) << "the first reading starts a window";
  EXPECT_FALSE(w.observe(12, 120'000)) << "9 steps: not yet";
  const auto first = w.observe(14, 140'000);  // 11 steps, 110 ms: 10 ms a step
  ASSERT_TRUE(first);
  EXPECT_EQ(first->index, 1);
  EXPECT_DOUBLE_EQ(first->compute_ms, 10.0);
  const auto second = w.observe(24, 340'000);  // 10 steps, 200 ms
  ASSERT_TRUE(second);
  EXPECT_EQ(second->index, 2);
  EXPECT_DOUBLE_EQ(second->compute_ms, 20.0);
  // a restarted worker starts from zero again: a new window, not a negative one
  EXPECT_FALSE(w.observe(5, 50'000));
  EXPECT_FALSE(w.observe(6, -1)) << "no compute record";
}

TEST(StragglerWatch, StoreValuesRoundTrip) {
  const NodeCompute c{"n3", 5, 7, 12.25};
  const auto back = node_compute_from("n3", to_store_value(c));
  ASSERT_TRUE(back);
  EXPECT_EQ(back->rank, 5);
  EXPECT_EQ(back->index, 7);
  EXPECT_DOUBLE_EQ(back->compute_ms, 12.25);
  EXPECT_FALSE(node_compute_from("n3", "garbage"));
}

std::vector<NodeCompute> window(long index, double n3_ms) {
  return {{"n1", 1, index, 10.0}, {"n2", 3, index, 11.0}, {"n3", 5, index, n3_ms}, {"n4", 7, index, 9.5}};
}
const std::vector<std::string> kMembers{"n1", "n2", "n3", "n4"};

TEST(StragglerWatch, ANodeAboveTheThresholdForKWindowsInARowIsNamedOnceAndNoOtherIs) {
  StragglerScore s({1.5, 20, 3});
  EXPECT_TRUE(s.score(window(1, 25.0), kMembers).empty());
  EXPECT_NEAR(s.ratios().at("n3"), 25.0 / 10.5, 1e-9);  // the median of 9.5, 10, 11, 25
  EXPECT_TRUE(s.score(window(2, 25.0), kMembers).empty());
  const auto named = s.score(window(3, 25.0), kMembers);
  ASSERT_EQ(named.size(), 1u);
  EXPECT_EQ(named[0].node, "n3");
  EXPECT_EQ(named[0].rank, 5);
  EXPECT_EQ(named[0].windows, 3);
  EXPECT_NEAR(named[0].ratio, 25.0 / 10.5, 1e-9);
  EXPECT_TRUE(s.score(window(4, 25.0), kMembers).empty()) << "named once";
  EXPECT_EQ(s.scored_windows(), 4);
}

TEST(StragglerWatch, AWindowBackInLineStartsTheCountAgain) {
  StragglerScore s({1.5, 20, 3});
  s.score(window(1, 25.0), kMembers);
  s.score(window(2, 25.0), kMembers);
  s.score(window(3, 10.0), kMembers);  // a hiccup, not a straggler
  EXPECT_TRUE(s.score(window(4, 25.0), kMembers).empty());
  EXPECT_TRUE(s.score(window(5, 25.0), kMembers).empty());
  EXPECT_EQ(s.score(window(6, 25.0), kMembers).size(), 1u);
}

TEST(StragglerWatch, AWindowIsScoredOnlyWhenEveryMemberHasANewerOne) {
  StragglerScore s({1.5, 20, 1});
  auto partial = window(1, 25.0);
  partial.pop_back();  // n4 has not published yet
  EXPECT_TRUE(s.score(partial, kMembers).empty());
  EXPECT_EQ(s.scored_windows(), 0);
  auto behind = window(1, 25.0);
  EXPECT_EQ(s.score(behind, kMembers).size(), 1u);
  EXPECT_TRUE(s.score(behind, kMembers).empty()) << "the same window again is not a new one";
  EXPECT_EQ(s.scored_windows(), 1);
  auto mixed = window(3, 25.0);
  mixed[0].index = 2;  // n1 a window behind the others: still newer than the last scored
  s.score(mixed, kMembers);
  EXPECT_EQ(s.scored_windows(), 2);
}

TEST(StragglerWatch, EvenlySlowNodesNameNoOne) {
  StragglerScore s({1.5, 20, 1});
  for (long i = 1; i < 10; ++i)
    EXPECT_TRUE(s.score({{"n1", 0, i, 10.0}, {"n2", 1, i, 12.0}, {"n3", 2, i, 14.0}}, {"n1", "n2", "n3"}).empty());
}

}  // namespace
}  // namespace elastrun::launcher
