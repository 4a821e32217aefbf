// Partner copies of memory checkpoints between agents (launcher/src/memory_peers.hpp): the fetch
// decision over canned holdings, and real agents' peer services on loopback sockets -- a commit
// copied to the partner, a new node fetching its ranks, a wrong credential refused, a segment
// being sent that retention drops meanwhile.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "memory_peers.hpp"
#include "memory_segments.hpp"

namespace elastrun::launcher {
namespace {

using Held = MemorySegments::Held;
using Origin = MemorySegments::Origin;

std::vector<Held> held(std::uint64_t step, int world, std::vector<int> ranks, Origin origin = Origin::Own,
                       std::uint64_t generation = 1) {
  std::vector<Held> out;
  for (int r : ranks) out.push_back({step, r, world, origin, generation});
  return out;
}

std::vector<Held> operator+(std::vector<Held> a, const std::vector<Held>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(MemoryPeers, ANewNodeFetchesItsRanksFromTheirWritersFirst) {
  // world 6 of three nodes; the third was lost and a spare takes ranks 4,5. n1 holds a replica of
  // the lost node's ranks? No: n1 is the lost node's partner -- it holds 4,5 as replicas
  const std::vector<std::vector<Held>> peers{held(7, 6, {0, 1}) + held(7, 6, {4, 5}, Origin::Replica),
                                             held(7, 6, {2, 3}) + held(7, 6, {0, 1}, Origin::Replica)};
  const auto plan = plan_fetches({}, peers, {4, 5}, 6);
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan->step, 7u);
  EXPECT_EQ(plan->world, 6);
  EXPECT_TRUE(plan->adopt.empty());
  ASSERT_EQ(plan->fetch.size(), 2u);
  EXPECT_EQ(plan->fetch[0].first, 4);
  EXPECT_EQ(plan->fetch[0].second, std::vector<std::size_t>{0});
}

TEST(MemoryPeers, APartnerAdoptsTheLostNodesRanksItHoldsAsReplicas) {
  const auto mine = held(7, 6, {2, 3}) + held(7, 6, {4, 5}, Origin::Replica);
  const auto plan = plan_fetches(mine, {held(7, 6, {0, 1})}, {4, 5}, 6);
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan->adopt, (std::vector<int>{4, 5}));
  EXPECT_TRUE(plan->fetch.empty());
}

TEST(MemoryPeers, TheNewestStepCompleteJobWideIsChosen) {
  // step 8 is missing rank 5 (its node died before the snapshot): step 7 is the newest complete
  const auto mine = held(7, 6, {0, 1}) + held(8, 6, {0, 1});
  const std::vector<std::vector<Held>> peers{held(7, 6, {2, 3}) + held(8, 6, {2, 3}),
                                             held(7, 6, {4, 5}) + held(8, 6, {4})};
  const auto plan = plan_fetches(mine, peers, {0, 1}, 6);
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan->step, 7u);
  EXPECT_TRUE(plan->fetch.empty()) << "this node holds ranks 0 and 1 of step 7";
}

TEST(MemoryPeers, AWorldThatShrankNeedsOnlyTheRanksItRestoresFrom) {
  // n4 (ranks 6, 7) was cut off before its snapshot of step 20: world 6 restores step 20 from ranks
  // 0..5 (replicated state), not step 19 -- and a world of 8 again would need step 19
  const std::vector<std::vector<Held>> peers{held(19, 8, {0, 1, 2, 3, 4, 5, 6, 7}) + held(20, 8, {0, 1, 2, 3, 4, 5})};
  const auto shrunk = plan_fetches({}, peers, {0, 1}, 6);
  ASSERT_TRUE(shrunk);
  EXPECT_EQ(shrunk->step, 20u);
  const auto full = plan_fetches({}, peers, {6, 7}, 8);
  ASSERT_TRUE(full);
  EXPECT_EQ(full->step, 19u);
}

TEST(MemoryPeers, NoCompleteStepOrAnUnknownWorldMeansNothingToFetch) {
  EXPECT_FALSE(plan_fetches({}, {held(3, 4, {0, 1, 2})}, {3}, 4));
  EXPECT_FALSE(plan_fetches({}, {held(3, 0, {0, 1, 2, 3})}, {3}, 4)) << "a writer that did not say its world";
}

TEST(MemoryPeers, OneStepWrittenInTwoRoundsIsTwoHistoriesNeverCombined) {
  // n3 was cut off after writing step 8 in round 2; the others went on in round 3 from step 7 and
  // wrote step 8 again (ranks 0, 1 so far) -- mixing the two step-8s would restore two histories
  const auto mine = held(7, 4, {0, 1}, Origin::Own, 2) + held(8, 4, {0, 1}, Origin::Own, 3);
  const std::vector<std::vector<Held>> peers{held(7, 4, {2, 3}, Origin::Own, 2) + held(8, 4, {2, 3}, Origin::Own, 2)};
  const auto plan = plan_fetches(mine, peers, {0, 1}, 4);
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan->step, 7u);
  EXPECT_EQ(plan->generation, 2u);
  // a node holding a step of another round than the job's drops it and fetches the job's
  const auto stale = plan_fetches(held(7, 4, {2}, Origin::Own, 1), {held(7, 4, {0, 1, 2, 3}, Origin::Own, 2)}, {2}, 4);
  ASSERT_TRUE(stale);
  EXPECT_EQ(stale->generation, 2u);
  EXPECT_EQ(stale->stale, std::vector<int>{2});
  ASSERT_EQ(stale->fetch.size(), 1u);
  EXPECT_EQ(stale->fetch[0].second, std::vector<std::size_t>{0});
}

TEST(MemoryPeers, ARankBeyondTheOldWorldTakesAReplicatedRanksSnapshot) {
  const auto plan = plan_fetches({}, {held(2, 4, {0, 1, 2, 3})}, {5, 6}, 8);
  ASSERT_TRUE(plan);
  ASSERT_EQ(plan->fetch.size(), 2u);
  EXPECT_EQ(plan->fetch[0].first, 1);
  EXPECT_EQ(plan->fetch[1].first, 2);
}

void fill(int fd, std::size_t size, char value) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  for (std::size_t i = 0; i < size; ++i) static_cast<char*>(p)[i] = static_cast<char>(value + i % 7);
  ::munmap(p, size);
}

// Every byte of (step, rank) in `segments` is what fill(…, value) wrote.
bool holds_bytes(MemorySegments& segments, std::uint64_t step, int rank, std::size_t size, char value) {
  auto found = segments.find(rank, step);
  if (!found || found->bytes != size) return false;
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, found->fd.get(), 0);
  if (p == MAP_FAILED) return false;
  bool same = true;
  for (std::size_t i = 0; i < size && same; ++i) same = static_cast<char*>(p)[i] == static_cast<char>(value + i % 7);
  ::munmap(p, size);
  return same;
}

Origin origin_of(MemorySegments& segments, std::uint64_t step, int rank) {
  for (const auto& h : segments.held())
    if (h.step == step && h.rank == rank) return h.origin;
  ADD_FAILURE() << "no segment of step " << step << " rank " << rank;
  return Origin::Own;
}

template <class Predicate>
bool eventually(Predicate&& done) {
  for (int i = 0; i < 500; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

PeerCredentials token(std::string secret) {
  PeerCredentials c;
  c.auth.kind = rdzv::AuthKind::Token;
  c.auth.token = std::move(secret);
  c.run_id = "peers-test";
  return c;
}

TEST(MemoryPeers, ACommitGoesToThePartnerAndANewNodeFetchesItOverRealSockets) {
  constexpr std::size_t kSize = (3 << 20) + 123;  // more than one socket buffer, not page aligned
  MemorySegments a_segments(64 << 20), b_segments(64 << 20), c_segments(64 << 20);
  MemoryPeers a(a_segments, token("secret"), "127.0.0.1");
  MemoryPeers b(b_segments, token("secret"), "127.0.0.1");
  a.new_round({.generation = 1, .peers = {b.address()}, .local_ranks = {0}, .world_size = 2});
  b.new_round({.generation = 1, .peers = {a.address()}, .local_ranks = {1}, .world_size = 2});
  a.wait_for_fetch(std::chrono::seconds(10));
  {
    auto fd = a_segments.allocate(5, 0, kSize);
    fill(fd.get(), kSize, 'p');
  }
  a_segments.commit(5, 0, 4242, 2);
  a.committed(5, 0);
  ASSERT_TRUE(eventually([&] { return b.counts().received == 1; })) << "the partner never got the copy";
  EXPECT_EQ(a.counts().pushed, 1u);
  EXPECT_EQ(origin_of(b_segments, 5, 0), Origin::Replica);
  EXPECT_TRUE(holds_bytes(b_segments, 5, 0, kSize, 'p'));
  EXPECT_EQ(b_segments.find(0, 5)->checksum, 4242u);

  // b's own rank 1, then a third node takes rank 0 (a lost): its fetch finds step 5 complete
  {
    auto fd = b_segments.allocate(5, 1, 4096);
    fill(fd.get(), 4096, 'q');
  }
  b_segments.commit(5, 1, 7, 2);
  MemoryPeers c(c_segments, token("secret"), "127.0.0.1");
  c.new_round({.generation = 2, .peers = {b.address()}, .local_ranks = {0}, .world_size = 2});
  c.wait_for_fetch(std::chrono::seconds(10));
  EXPECT_EQ(c.counts().fetched, 1u);
  EXPECT_EQ(origin_of(c_segments, 5, 0), Origin::Fetched);
  EXPECT_TRUE(holds_bytes(c_segments, 5, 0, kSize, 'p')) << "fetched from b's replica, byte for byte";
  // and b, now holding rank 0 itself in a round of two, adopts its replica instead of fetching
  b.new_round({.generation = 3, .peers = {c.address()}, .local_ranks = {0, 1}, .world_size = 2});
  b.wait_for_fetch(std::chrono::seconds(10));
  EXPECT_EQ(b.counts().adopted, 1u);
  EXPECT_EQ(origin_of(b_segments, 5, 0), Origin::Fetched);
}

TEST(MemoryPeers, AnotherRunsCredentialIsRefusedAndChangesNothing) {
  MemorySegments segments(1 << 20);
  MemoryPeers server(segments, token("secret"), "127.0.0.1");
  try {
    peer_list(server.address(), token("guess"), std::chrono::seconds(5));
    FAIL() << "a wrong token listed the segments";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(server.address()), std::string::npos) << e.what();
  }
  MemorySegments other(1 << 20);
  {
    auto fd = other.allocate(1, 0, 4096);
    fill(fd.get(), 4096, 'x');
  }
  other.commit(1, 0, 1, 1);
  auto pinned = other.pin(1, 0);
  ASSERT_TRUE(pinned);
  EXPECT_THROW(peer_push(server.address(), token("guess"), *pinned, std::chrono::seconds(5)), std::runtime_error);
  EXPECT_TRUE(segments.held().empty()) << "nothing was stored";
  EXPECT_TRUE(peer_push(server.address(), token("secret"), *pinned, std::chrono::seconds(5)));
  EXPECT_FALSE(peer_push(server.address(), token("secret"), *pinned, std::chrono::seconds(5))) << "held already";
}

TEST(MemorySegments, ASegmentBeingSentIsNotReusedUntilItsPinGoes) {
  MemorySegments segments(1 << 20);
  for (std::uint64_t step : {1, 2}) {
    auto fd = segments.allocate(step, 0, 4096);
    fill(fd.get(), 4096, static_cast<char>('a' + step));
    segments.commit(step, 0, step);
  }
  auto pinned = segments.pin(1, 0);
  ASSERT_TRUE(pinned);
  {
    auto fd = segments.allocate(3, 0, 4096);  // a fresh memfd: step 1's is pinned, not a spare yet
    fill(fd.get(), 4096, 'z');
  }
  segments.commit(3, 0, 3);  // retention drops step 1 (being sent)
  char first = 0;
  ASSERT_EQ(::pread(pinned->fd.get(), &first, 1, 0), 1);
  EXPECT_EQ(first, 'b') << "step 1's bytes while it is sent";
  EXPECT_EQ(segments.used(), 3u * 4096) << "counted until unpinned";
  pinned.reset();
  EXPECT_EQ(segments.used(), 2u * 4096);
  EXPECT_EQ(segments.spare(), 4096u) << "then a spare";
}

TEST(MemorySegments, ReplicasYieldToTheNodesOwnSnapshots) {
  MemorySegments segments(4 * 4096);
  for (std::uint64_t step : {1, 2}) {
    auto fd = segments.allocate(step, 0, 4096);
    segments.commit(step, 0, step, 2);
  }
  for (std::uint64_t step : {1, 2}) {
    auto fd = segments.allocate_copy(step, 1, 4096);
    ASSERT_TRUE(fd);
    segments.commit_copy(step, 1, step, 2, 1, Origin::Replica);
  }
  const auto left = [&] {
    std::vector<std::pair<std::uint64_t, int>> out;
    for (const auto& h : segments.held()) out.emplace_back(h.step, h.rank);
    return out;
  };
  {
    auto fd = segments.allocate(3, 0, 4096);  // room: the oldest replica, not own step 1
  }
  EXPECT_EQ(left(), (std::vector<std::pair<std::uint64_t, int>>{{1, 0}, {2, 0}, {2, 1}}));
  EXPECT_THROW(segments.allocate_copy(4, 1, 8192), MemoryBudgetError) << "a copy never drops own snapshots";
  EXPECT_EQ(left(), (std::vector<std::pair<std::uint64_t, int>>{{1, 0}, {2, 0}}));
}

}  // namespace
}  // namespace elastrun::launcher
