// The collective votes of saves and restores (ckpt/src/vote.hpp): one codec for a rank's vote and
// rank 0's decision, round trips, damaged messages, the per-rank failure summary, and the
// collectives they travel over.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "elastrun/ckpt/checkpoint.hpp"
#include "test_support.hpp"
#include "vote.hpp"

namespace elastrun::ckpt::detail {
namespace {

TEST(Votes, RankVoteRoundTripsWithItsReport) {
  const RankVote ok = RankVote::ok({{"bytes", 42}, {"tensors", {"a", "b"}}});
  const RankVote back = RankVote::decode(ok.encode());
  EXPECT_TRUE(back.is_ok());
  EXPECT_EQ(back.report["bytes"], 42);
  const RankVote no = RankVote::decode(RankVote::error("disk full").encode());
  EXPECT_FALSE(no.is_ok());
  EXPECT_EQ(no.why, "disk full");
  EXPECT_TRUE(no.report.is_null());
  const RankVote corrupt = RankVote::decode(RankVote{RankVote::Outcome::Corrupt, "bad hash", nullptr}.encode());
  EXPECT_EQ(corrupt.outcome, RankVote::Outcome::Corrupt);
}

TEST(Votes, DamagedBytesInAReasonAreReplacedNotThrown) {
  const RankVote v = RankVote::error(std::string("name \xff\xfe in a damaged file"));
  const RankVote back = RankVote::decode(v.encode());
  EXPECT_NE(back.why.find("in a damaged file"), std::string::npos);
}

TEST(Votes, DecisionRoundTrips) {
  Decision d = Decision::go("gen-1");
  d.warnings = {"slow fsync"};
  const Decision back = Decision::decode(d.encode());
  EXPECT_EQ(back.action, Decision::Action::Go);
  EXPECT_EQ(back.value, "gen-1");
  EXPECT_EQ(back.warnings, std::vector<std::string>{"slow fsync"});
  Decision skip;
  skip.action = Decision::Action::Skip;
  skip.skipped = {"rank 1: bad", "rank 2: worse"};
  skip.mismatch = "rank 2: worse";
  const Decision s = Decision::decode(skip.encode());
  EXPECT_EQ(s.action, Decision::Action::Skip);
  EXPECT_EQ(s.skipped.size(), 2u);
  EXPECT_EQ(s.mismatch, "rank 2: worse");
  EXPECT_EQ(Decision::decode(Decision::fail("no").encode()).error, "no");
}

TEST(Votes, MalformedMessagesAreCheckpointErrors) {
  for (const std::string text : {"", "!old style error", "[]", R"({"outcome":9,"why":""})", R"({"why":"x"})"})
    EXPECT_THROW(RankVote::decode(text), CheckpointError) << text;
  for (const std::string text : {"", "{}", R"({"action":7,"error":"","value":"","skipped":[],"mismatch":"",
                                              "warnings":[]})"})
    EXPECT_THROW(Decision::decode(text), CheckpointError) << text;
}

TEST(Votes, FailedRanksNameEachRankThatVotedNo) {
  const auto votes = decode_votes({RankVote::ok().encode(), RankVote::error("disk full").encode(),
                                   RankVote::ok().encode(), RankVote::error("ENOSPC").encode()});
  EXPECT_EQ(failed_ranks(votes), "rank 1: disk full; rank 3: ENOSPC");
  EXPECT_EQ(failed_ranks(decode_votes({RankVote::ok().encode()})), "");
}

// The O(world) collectives the votes travel over: gather to rank 0, broadcast from it.
TEST(CkptCollectives, GatherAndBroadcastDefaults) {
  testing::run_ranks(4, [&](int rank, Communicator& comm) {
    const auto gathered = comm.gather(std::to_string(rank * 10));
    if (rank == 0) {
      EXPECT_EQ(gathered, (std::vector<std::string>{"0", "10", "20", "30"}));
    } else {
      EXPECT_TRUE(gathered.empty());
    }
    EXPECT_EQ(comm.broadcast(rank == 0 ? "from zero" : "ignored"), "from zero");
  });
}

}  // namespace
}  // namespace elastrun::ckpt::detail
