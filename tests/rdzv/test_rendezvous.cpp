// Membership rounds on the real store: threads for pure protocol paths, and real processes
// (rdzv_member) for death by SIGKILL, silence by SIGSTOP and fencing.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <future>
#include <thread>

#include "elastrun/rdzv/rendezvous.hpp"
#include "elastrun/rdzv/store.hpp"

extern char** environ;

namespace {

using namespace elastrun::rdzv;
using namespace std::chrono_literals;
using json = nlohmann::json;

// Waits (up to 20 s) until `count` members have joined round `gen` of run `run_id`: tests that
// need an order of joins wait for it instead of sleeping (a loaded machine stretches any sleep).
bool wait_joined(KvBackend& kv, const std::string& run_id, int gen, std::size_t count) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  const auto prefix = "elastrun/" + run_id + "/r/" + std::to_string(gen) + "/join/";
  while (kv.get_prefix(prefix).size() < count) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

struct Cluster {
  StoreServer server{[] {
    StoreServerOptions o;
    o.bind_address = "127.0.0.1";
    o.run_id = "rt";
    return o;
  }()};
  std::unique_ptr<KvBackend> client() {
    return std::make_unique<StoreClient>("127.0.0.1", server.port(), AuthConfig{}, "rt");
  }
  std::unique_ptr<Rendezvous> member(const std::string& name, int index, int nproc, int min, int max,
                                     Millis last_call = 300ms, Millis join_timeout = 20s) {
    MemberInfo me;
    me.node_name = name;
    me.address = "127.0.0.1";
    me.node_index = index;
    me.nproc = nproc;
    RendezvousConfig cfg;
    cfg.run_id = "rt";
    cfg.min_nodes = min;
    cfg.max_nodes = max;
    cfg.join_timeout = join_timeout;
    cfg.last_call_timeout = last_call;
    cfg.heartbeat_timeout = 2s;
    return std::make_unique<Rendezvous>(client(), client(), cfg, me);
  }
  // A member of het component `component` of a job with per-component bounds (--het-nnodes).
  std::unique_ptr<Rendezvous> het_member(const std::string& name, int component, int index,
                                         std::vector<NodeBounds> bounds, Millis join_timeout = 20s) {
    MemberInfo me;
    me.node_name = name;
    me.address = "127.0.0.1";
    me.het_component = component;
    me.node_index = index;
    int min = 0, max = 0;
    for (auto b : bounds) min += b.min, max += b.max;
    RendezvousConfig cfg;
    cfg.run_id = "rt";
    cfg.min_nodes = min;
    cfg.max_nodes = max;
    cfg.join_timeout = join_timeout;
    cfg.last_call_timeout = 300ms;
    cfg.heartbeat_timeout = 2s;
    cfg.component_bounds = std::move(bounds);
    return std::make_unique<Rendezvous>(client(), client(), cfg, me);
  }
};

TEST(Rendezvous, RanksFollowNodeIndexNotHostNameAndUseAPrefixSum) {
  Cluster c;
  // Names sort the other way round from node indexes; nproc differs per node.
  auto a = c.member("zeta", 0, 2, 3, 3);
  auto b = c.member("beta", 1, 1, 3, 3);
  auto d = c.member("alpha", 2, 3, 3, 3);
  auto fa = std::async(std::launch::async, [&] { return a->next_round(); });
  auto fb = std::async(std::launch::async, [&] { return b->next_round(); });
  auto rd = d->next_round();
  auto ra = fa.get();
  auto rb = fb.get();
  EXPECT_EQ(ra.group_rank, 0);
  EXPECT_EQ(rb.group_rank, 1);
  EXPECT_EQ(rd.group_rank, 2);
  EXPECT_EQ(ra.rank_offset, 0);
  EXPECT_EQ(rb.rank_offset, 2);
  EXPECT_EQ(rd.rank_offset, 3);
  for (const auto* r : {&ra, &rb, &rd}) {
    EXPECT_EQ(r->world_size, 6);
    EXPECT_EQ(r->group_world_size, 3);
    EXPECT_EQ(r->generation, ra.generation);
    EXPECT_EQ(r->master_addr, "127.0.0.1");
    EXPECT_EQ(r->master_port, ra.master_port);
    EXPECT_NE(r->master_port, 0);
    EXPECT_EQ(r->role_world_size, 6);
  }
}

TEST(Rendezvous, JoinTimeoutWhenTooFewNodes) {
  Cluster c;
  auto a = c.member("a", 0, 1, 2, 2, 100ms, 500ms);
  try {
    a->next_round();
    FAIL() << "a round of 1 formed with min 2";
  } catch (const RendezvousError& e) {
    EXPECT_NE(std::string(e.what()).find("join_timeout"), std::string::npos) << e.what();
  }
}

TEST(Rendezvous, MinReachedClosesAfterLastCallAndMaxClosesAtOnce) {
  Cluster c;
  auto a = c.member("a", 0, 1, 1, 4, 200ms);
  auto r = a->next_round();  // min 1 reached: closes after the last call
  EXPECT_EQ(r.group_world_size, 1);
}

TEST(Rendezvous, LateJoinerTriggersScaleUp) {
  Cluster c;
  auto a = c.member("a", 0, 1, 2, 3);
  auto b = c.member("b", 1, 1, 2, 3);
  auto fa = std::async(std::launch::async, [&] { return a->next_round(); });
  auto rb = b->next_round();
  auto ra = fa.get();
  ASSERT_EQ(ra.group_world_size, 2);
  // A third node arrives while the round runs: it waits, the members see it and re-form.
  auto late = c.member("c", 2, 1, 2, 3);
  auto fc = std::async(std::launch::async, [&] { return late->next_round(); });
  EXPECT_EQ(a->wait_for_change(20s), Change::MemberWaiting);
  EXPECT_EQ(b->wait_for_change(20s), Change::MemberWaiting);
  auto fa2 = std::async(std::launch::async, [&] { return a->next_round(); });
  auto rb2 = b->next_round();
  auto ra2 = fa2.get();
  auto rc = fc.get();
  EXPECT_EQ(ra2.group_world_size, 3);
  EXPECT_EQ(rc.group_world_size, 3);
  EXPECT_EQ(rc.group_rank, 2);
  EXPECT_GT(ra2.generation, ra.generation);
  EXPECT_EQ(rb2.generation, ra2.generation);
}

TEST(Rendezvous, RequestNewRoundReachesEveryone) {
  Cluster c;
  auto a = c.member("a", 0, 1, 2, 2);
  auto b = c.member("b", 1, 1, 2, 2);
  auto fa = std::async(std::launch::async, [&] { return a->next_round(); });
  b->next_round();
  fa.get();
  b->request_new_round();  // e.g. b's worker failed
  EXPECT_EQ(a->wait_for_change(20s), Change::Reform);
  EXPECT_EQ(a->add_to_counter("restarts", 1), 1);
  EXPECT_EQ(b->add_to_counter("restarts", 0), 1) << "the restart budget is job-wide";
}

TEST(Rendezvous, CloseEndsItForEveryoneIncludingLateComers) {
  Cluster c;
  auto a = c.member("a", 0, 1, 1, 1, 50ms);
  a->next_round();
  a->close("job finished");
  EXPECT_EQ(a->wait_for_change(5s), Change::Closed);
  auto late = c.member("b", 1, 1, 1, 2, 50ms);
  EXPECT_THROW(late->next_round(), RendezvousClosed);
}

TEST(Rendezvous, BarrierWaitsForAllMembers) {
  Cluster c;
  auto a = c.member("a", 0, 1, 2, 2);
  auto b = c.member("b", 1, 1, 2, 2);
  auto fa = std::async(std::launch::async, [&] { return a->next_round(); });
  b->next_round();
  fa.get();
  EXPECT_FALSE(a->barrier("exit", 200ms)) << "b has not arrived";
  auto fb = std::async(std::launch::async, [&] { return b->barrier("exit", 20s); });
  EXPECT_TRUE(fb.get());
}

TEST(Rendezvous, HetRoundWaitsForEveryComponentsMinimum) {
  Cluster c;
  // Bounds 1:1 and 1:2 make the job-wide minimum 2: two nodes of component 1 reach it, but
  // component 0 has none, so no round may form.
  auto b = c.het_member("b", 1, 0, {{1, 1}, {1, 2}}, 1500ms);
  auto d = c.het_member("d", 1, 1, {{1, 1}, {1, 2}}, 1500ms);
  auto fb = std::async(std::launch::async, [&] { return b->next_round(); });
  EXPECT_THROW(d->next_round(), RendezvousError);
  EXPECT_THROW(fb.get(), RendezvousError);
}

TEST(Rendezvous, HetRoundTakesAtMostEachComponentsMaximumAndTheRestWaitAsItsSpares) {
  Cluster c;
  const std::vector<NodeBounds> bounds{{1, 1}, {1, 2}};
  auto a = c.het_member("a", 0, 0, bounds);
  auto b = c.het_member("b", 1, 0, bounds);
  auto d = c.het_member("d", 1, 1, bounds);
  auto e = c.het_member("e", 1, 2, bounds);  // one more than component 1's maximum
  // Component 1 joins first: its three nodes reach the job-wide maximum of 3, yet the round
  // must not close without component 0, and then must take only two of them.
  auto fb = std::async(std::launch::async, [&] { return b->next_round(); });
  auto fd = std::async(std::launch::async, [&] { return d->next_round(); });
  auto fe = std::async(std::launch::async, [&] { return e->next_round(); });
  ASSERT_TRUE(wait_joined(*c.client(), "rt", 1, 3)) << "b, d and e did not join";
  auto ra = a->next_round();
  auto rb = fb.get();
  auto rd = fd.get();
  EXPECT_EQ(ra.group_world_size, 3);
  EXPECT_EQ(ra.group_rank, 0) << "component 0 comes first";
  EXPECT_EQ(rb.group_rank, 1);
  EXPECT_EQ(rd.group_rank, 2);
  EXPECT_EQ(fe.wait_for(300ms), std::future_status::timeout) << "e waits as component 1's spare";
  // A full component's spare is no reason to re-form.
  EXPECT_EQ(a->wait_for_change(1s), Change::None);
  a->close("done");
  EXPECT_THROW(fe.get(), RendezvousClosed);
}

TEST(Rendezvous, HetBoundsAreValidated) {
  Cluster c;
  EXPECT_THROW(c.het_member("a", 0, 0, {{2, 1}}), RendezvousError);
  EXPECT_THROW(c.het_member("a", 2, 0, {{1, 1}, {1, 1}}), RendezvousError) << "component out of range";
}

TEST(Rendezvous, InvalidMinMaxIsRefused) {
  Cluster c;
  EXPECT_THROW(c.member("a", 0, 1, 3, 2), RendezvousError);
}

// ---- the quorum rule (a pure function) -----------------------------------------------------------

std::vector<MemberInfo> nodes(std::initializer_list<const char*> names) {
  std::vector<MemberInfo> out;
  for (const char* n : names) {
    MemberInfo m;
    m.node_name = n;
    out.push_back(m);
  }
  return out;
}

auto named(std::initializer_list<const char*> names) {
  std::vector<std::string> set(names.begin(), names.end());
  return [set](const MemberInfo& m) { return std::find(set.begin(), set.end(), m.node_name) != set.end(); };
}

TEST(Quorum, AFirstRoundNeedsNone) {
  auto v = decide_quorum({}, named({}), named({}));
  EXPECT_TRUE(v.ok);
}

TEST(Quorum, AStrictMajorityOfTheLastRoundFormsWithoutAskingWhoIsGone) {
  int asked = 0;
  auto gone = [&](const MemberInfo&) { return ++asked, false; };
  auto v = decide_quorum(nodes({"n1", "n2", "n3", "n4"}), named({"n1", "n2", "n3", "n9"}), gone);
  EXPECT_TRUE(v.ok);
  EXPECT_EQ(v.present, 3);
  EXPECT_EQ(asked, 0) << "Slurm is asked only without a majority";
}

TEST(Quorum, HalfIsNotAMajority) {
  auto v = decide_quorum(nodes({"n1", "n2", "n3", "n4"}), named({"n1", "n2"}), named({}));
  EXPECT_FALSE(v.ok);
  EXPECT_EQ(v.present, 2);
  EXPECT_EQ(v.members, 4);
  EXPECT_EQ(v.unreachable, (std::vector<std::string>{"n3", "n4"}));
}

TEST(Quorum, AMinorityGoesOnOnlyWhenEveryAbsentMemberIsConfirmedGone) {
  auto base = nodes({"n1", "n2", "n3", "n4"});
  EXPECT_TRUE(decide_quorum(base, named({"n1", "n2"}), named({"n3", "n4"})).ok) << "Slurm: n3, n4 down";
  auto v = decide_quorum(base, named({"n1"}), named({"n3", "n4"}));
  EXPECT_FALSE(v.ok) << "n2 is neither here nor confirmed gone";
  EXPECT_EQ(v.unreachable, (std::vector<std::string>{"n2"}));
  EXPECT_TRUE(decide_quorum(base, named({}), named({"n1", "n2", "n3", "n4"})).ok) << "spares after every member died";
}

TEST(Quorum, SparesDoNotCount) {
  auto v = decide_quorum(nodes({"n1", "n2", "n3"}), named({"n1", "s1", "s2", "s3"}), named({}));
  EXPECT_FALSE(v.ok) << "only members of the last round make a quorum";
}

// ---- fenced commits ----------------------------------------------------------------------------

TEST(FencedCommit, TheRoundWithAQuorumOnItsStoreCommitsAndRecordsIt) {
  Cluster c;
  auto a = c.member("a", 0, 1, 2, 2);
  auto b = c.member("b", 1, 1, 2, 2);
  auto fa = std::async(std::launch::async, [&] { return a->next_round(); });
  b->next_round();
  fa.get();
  const auto fence = a->commit_fence(3);
  EXPECT_EQ(fence.token.substr(0, 7), "000003.") << "requeues first: a requeued job's rounds come later";
  auto kv = c.client();
  EXPECT_EQ(fence_commit(*kv, fence, "/ckpt/step-10"), "");
  EXPECT_EQ(fence_commit(*kv, fence, "/ckpt/step-10"), "") << "a retry of the same commit";
  auto record = kv->get("elastrun/rt.commits/step//ckpt/step-10");
  ASSERT_TRUE(record);
  EXPECT_EQ(record->value, fence.token);
  // a newer round's record of a step wins over an older round's commit of it
  auto newer = fence;
  newer.token = "000004.000000000001";
  EXPECT_EQ(fence_commit(*kv, newer, "/ckpt/step-11"), "");
  EXPECT_NE(fence_commit(*kv, fence, "/ckpt/step-11").find("a newer round"), std::string::npos);
  // once another agent starts a new round, this round commits nothing more
  b->request_new_round();
  EXPECT_NE(fence_commit(*kv, fence, "/ckpt/step-12").find("is over"), std::string::npos);
}

TEST(FencedCommit, AMinorityOnTheStoreCommitsNothing) {
  Cluster c;
  auto a = c.member("a", 0, 1, 3, 3);
  auto b = c.member("b", 1, 1, 3, 3);
  auto d = c.member("d", 2, 1, 3, 3);
  auto fa = std::async(std::launch::async, [&] { return a->next_round(); });
  auto fb = std::async(std::launch::async, [&] { return b->next_round(); });
  d->next_round();
  fa.get();
  fb.get();
  const auto fence = a->commit_fence(0);
  b.reset();  // their leases end: a is alone in its round on this store
  d.reset();
  auto kv = c.client();
  EXPECT_NE(fence_commit(*kv, fence, "/ckpt/step-1").find("no quorum"), std::string::npos);
  EXPECT_FALSE(kv->get("elastrun/rt.commits/step//ckpt/step-1")) << "a refused commit is not recorded";
}

TEST(FencedCommit, AMemberDeclaredDeadCommitsNothing) {
  Cluster c;
  auto a = c.member("a", 0, 1, 1, 1);
  a->next_round();
  auto fence = a->commit_fence(0);
  auto kv = c.client();
  kv->revoke_lease(fence.lease);  // as the store does when its keep-alives stop
  const auto why = fence_commit(*kv, fence, "/ckpt/step-1");
  EXPECT_FALSE(why.empty());
}

// ---- reconnecting after a cut link ----------------------------------------------------------

// A member of Cluster `c` whose store connections are opened by `connector` after a loss (the
// agent's is bootstrap.cpp's store_connector); *protocol is its protocol connection.
std::unique_ptr<Rendezvous> reconnecting_member(Cluster& c, StoreConnector connector, KvBackend** protocol) {
  MemberInfo me;
  me.node_name = "n0";
  me.address = "127.0.0.1";
  RendezvousConfig cfg;
  cfg.run_id = "rt";
  cfg.last_call_timeout = 300ms;
  cfg.heartbeat_timeout = 2s;
  cfg.primary_address = "127.0.0.1";
  cfg.primary_port = c.server.port();
  auto kv = c.client();
  *protocol = kv.get();
  return std::make_unique<Rendezvous>(std::move(kv), c.client(), cfg, me, std::move(connector));
}

std::unique_ptr<KvBackend> connect_test_store(const std::string& address, std::uint16_t port) {
  return std::make_unique<StoreClient>(address, port, AuthConfig{}, "rt");
}

TEST(RendezvousReconnect, TriesAgainWhileTheLinkIsCutAndTakesANewLeaseOnTheSameStore) {
  Cluster c;
  int attempts = 0;
  KvBackend* protocol = nullptr;
  auto r = reconnecting_member(
      c,
      [&](const std::string& address, std::uint16_t port) {
        // a cut link: connecting times out (SYNs dropped) twice, then the link is back
        if (++attempts <= 2) throw StoreError(StoreErrorKind::ConnectionLost, "cannot reach the store: timed out");
        return connect_test_store(address, port);
      },
      &protocol);
  const auto first = r->next_round();
  protocol->interrupt();  // the protocol connection drops, as when the link is cut
  ASSERT_EQ(r->wait_for_change(5s), Change::StoreLost);
  EXPECT_TRUE(r->reconnect_to_the_same_store());
  EXPECT_EQ(attempts, 4) << "two cut attempts, then the protocol and heartbeat connections";
  auto watcher = c.client();
  EXPECT_EQ(watcher->get_prefix("elastrun/rt/alive/").size(), 1U) << "no live lease on the same store";
  const auto next = r->next_round();
  EXPECT_EQ(next.generation, first.generation + 1) << "re-formed on the same store, not failed over";
}

TEST(RendezvousReconnect, ARefusedConnectionFailsOverAtOnceAndACutThatLastsEndsAfterTheHeartbeatTimeout) {
  for (const bool refused : {true, false}) {
    Cluster c;
    int attempts = 0;
    KvBackend* protocol = nullptr;
    auto r = reconnecting_member(
        c,
        [&](const std::string&, std::uint16_t) -> std::unique_ptr<KvBackend> {
          ++attempts;
          throw StoreError(StoreErrorKind::ConnectionLost, "cannot reach the store", refused);
        },
        &protocol);
    r->next_round();
    protocol->interrupt();
    ASSERT_EQ(r->wait_for_change(5s), Change::StoreLost);
    const auto start = std::chrono::steady_clock::now();
    EXPECT_FALSE(r->reconnect_to_the_same_store());
    if (refused) {
      EXPECT_EQ(attempts, 1) << "nothing listens there: no reason to wait";
    } else {
      EXPECT_GT(attempts, 1) << "a timeout may be a short cut: try again";
      EXPECT_GE(std::chrono::steady_clock::now() - start, 1s) << "gave up before the heartbeat timeout (2 s)";
      EXPECT_LT(std::chrono::steady_clock::now() - start, 15s);
    }
  }
}

// ---- real processes --------------------------------------------------------------------------

class Member {
 public:
  Member(const std::vector<std::string>& args) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    std::vector<std::string> argv_s{RDZV_MEMBER_PATH};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& s : argv_s) argv.push_back(s.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ) != 0) throw std::runtime_error("spawn");
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    out_ = fds[0];
  }
  ~Member() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      kill(pid_, SIGCONT);
      waitpid(pid_, nullptr, 0);
    }
    close(out_);
  }
  pid_t pid() const { return pid_; }
  int wait_exit() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }
  void kill9() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  // Next JSON event with event == `event` within `timeout`.
  std::optional<json> next(const std::string& event, Millis timeout = 30s) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      auto nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        auto line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        auto j = json::parse(line, nullptr, false);
        if (!j.is_discarded() && j.value("event", "") == event) return j;
        continue;
      }
      auto left = std::chrono::ceil<Millis>(deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) return std::nullopt;
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      char buf[4096];
      auto n = read(out_, buf, sizeof buf);
      if (n <= 0) return std::nullopt;
      buffer_.append(buf, static_cast<std::size_t>(n));
    }
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  std::string buffer_;
};

std::vector<std::string> member_args(const std::string& endpoint, const std::string& node, int index, int min, int max,
                                     bool serve = false) {
  std::vector<std::string> a{"--endpoint",     endpoint,
                             "--node",         node,
                             "--index",        std::to_string(index),
                             "--min",          std::to_string(min),
                             "--max",          std::to_string(max),
                             "--hb-ms",        "600",
                             "--last-call-ms", "300",
                             "--run-id",       "proc"};
  if (serve) a.push_back("--serve");
  return a;
}

// A free port for a test store (the member hosting it binds it).
std::string free_endpoint() {
  auto l = StoreServer([] {
    StoreServerOptions o;
    o.bind_address = "127.0.0.1";
    return o;
  }());
  return "127.0.0.1:" + std::to_string(l.port());
}

TEST(RendezvousProcess, KillNineMidRunGivesSurvivorsASmallerRound) {
  auto ep = free_endpoint();
  Member host(member_args(ep, "n0", 0, 2, 3, true));
  ASSERT_TRUE(host.next("store"));
  Member b(member_args(ep, "n1", 1, 2, 3));
  Member victim(member_args(ep, "n2", 2, 2, 3));
  for (auto* m : {&host, &b, &victim}) {
    auto r = m->next("round");
    ASSERT_TRUE(r);
    EXPECT_EQ((*r)["group_world_size"], 3);
  }
  victim.kill9();
  for (auto* m : {&host, &b}) {
    auto change = m->next("change");
    ASSERT_TRUE(change);
    EXPECT_EQ((*change)["what"], "member lost");
    auto r = m->next("round");
    ASSERT_TRUE(r);
    EXPECT_EQ((*r)["group_world_size"], 2);
    EXPECT_EQ((*r)["members"], json::array({"n0", "n1"}));
  }
}

TEST(RendezvousProcess, KillNineMidRoundDoesNotBlockTheRound) {
  auto ep = free_endpoint();
  Member host(member_args(ep, "n0", 0, 3, 3, true));
  ASSERT_TRUE(host.next("store"));
  {
    Member doomed(member_args(ep, "n1", 1, 3, 3));
    StoreClient kv("127.0.0.1", static_cast<std::uint16_t>(std::stoi(ep.substr(ep.rfind(':') + 1))), AuthConfig{},
                   "proc");
    ASSERT_TRUE(wait_joined(kv, "proc", 1, 2)) << "n1 did not join the forming round";
    doomed.kill9();
  }
  Member c(member_args(ep, "n2", 2, 3, 3));
  Member d(member_args(ep, "n3", 3, 3, 3));
  for (auto* m : {&host, &c, &d}) {
    auto r = m->next("round");
    ASSERT_TRUE(r);
    EXPECT_EQ((*r)["members"], json::array({"n0", "n2", "n3"}));
  }
}

TEST(RendezvousProcess, SilentMemberIsDetectedByHeartbeatAndFencedWhenItReturns) {
  auto ep = free_endpoint();
  Member host(member_args(ep, "n0", 0, 2, 3, true));
  ASSERT_TRUE(host.next("store"));
  Member b(member_args(ep, "n1", 1, 2, 3));
  Member silent(member_args(ep, "n2", 2, 2, 3));
  for (auto* m : {&host, &b, &silent}) ASSERT_TRUE(m->next("round"));
  kill(silent.pid(), SIGSTOP);  // a hung node: its connections stay open, its heartbeats stop
  auto t0 = std::chrono::steady_clock::now();
  for (auto* m : {&host, &b}) {
    auto change = m->next("change");
    ASSERT_TRUE(change);
    EXPECT_EQ((*change)["what"], "member lost");
    auto r = m->next("round");
    ASSERT_TRUE(r);
    EXPECT_EQ((*r)["group_world_size"], 2);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s) << "liveness bound (heartbeat 0.6 s)";
  kill(silent.pid(), SIGCONT);
  // It comes back: its lease is gone, so it learns it was declared dead and rejoins as new.
  auto change = silent.next("change");
  ASSERT_TRUE(change);
  EXPECT_EQ((*change)["what"], "fenced (declared dead)");
  auto r = silent.next("round");
  ASSERT_TRUE(r);
  EXPECT_EQ((*r)["group_world_size"], 3) << "re-admitted through the wait list";
}

TEST(RendezvousProcess, KillNineOfTheStoreHostIsSurvived) {
  auto ep = free_endpoint();
  Member host(member_args(ep, "n0", 0, 2, 3, true));
  ASSERT_TRUE(host.next("store"));
  Member b(member_args(ep, "n1", 1, 2, 3));
  Member c(member_args(ep, "n2", 2, 2, 3));
  for (auto* m : {&host, &b, &c}) ASSERT_TRUE(m->next("round"));
  host.kill9();  // the node hosting the store dies, with its member
  for (auto* m : {&b, &c}) {
    auto change = m->next("change");
    ASSERT_TRUE(change);
    EXPECT_EQ((*change)["what"], "store lost");
    auto r = m->next("round");
    ASSERT_TRUE(r) << "survivors did not re-form on a standby store";
    EXPECT_EQ((*r)["members"], json::array({"n1", "n2"}));
    EXPECT_GE((*r)["gen"].get<int>(), 2) << "generations continue after a failover";
  }
}

TEST(RendezvousProcess, HalfOfTheMembersSilentIsNoQuorumUntilTheyReturn) {
  // Two of four stop answering (SIGSTOP: alive, Slurm would call their nodes up): the other two
  // are not a majority, so they form no round of their own; they say so, and once the silent
  // ones return (fenced, rejoining) the four form a round again.
  auto ep = free_endpoint();
  Member host(member_args(ep, "n0", 0, 1, 4, true));
  ASSERT_TRUE(host.next("store"));
  Member b(member_args(ep, "n1", 1, 1, 4));
  Member c(member_args(ep, "n2", 2, 1, 4));
  Member d(member_args(ep, "n3", 3, 1, 4));
  for (auto* m : {&host, &b, &c, &d}) {
    auto r = m->next("round");
    ASSERT_TRUE(r);
    ASSERT_EQ((*r)["group_world_size"], 4);
  }
  kill(c.pid(), SIGSTOP);
  kill(d.pid(), SIGSTOP);
  for (auto* m : {&host, &b}) {
    auto wait = m->next("no_quorum");
    ASSERT_TRUE(wait) << "no 'no quorum' report";
    EXPECT_EQ((*wait)["members"], 4);
    EXPECT_EQ((*wait)["present"], 2);
    EXPECT_EQ((*wait)["unreachable"], json::array({"n2", "n3"}));
  }
  EXPECT_FALSE(host.next("round", 3s)) << "a half formed a round of its own";
  kill(c.pid(), SIGCONT);
  kill(d.pid(), SIGCONT);
  // the first to return makes three of four (a quorum): a round of 3 may come first, then 4
  for (auto* m : {&host, &b, &c, &d}) {
    std::optional<json> r;
    while ((r = m->next("round")) && (*r)["group_world_size"] != 4) EXPECT_EQ((*r)["group_world_size"], 3) << *r;
    ASSERT_TRUE(r) << "no round of 4 after the silent members returned";
  }
}

TEST(RendezvousProcess, HalfOfTheMembersKilledIsConfirmedGoneOnTheSameHost) {
  // SIGKILL is not a partition: the kernel of this host says the processes are gone, so the
  // two survivors go on without a majority (on a cluster, Slurm's word does this).
  auto ep = free_endpoint();
  Member host(member_args(ep, "n0", 0, 1, 4, true));
  ASSERT_TRUE(host.next("store"));
  Member b(member_args(ep, "n1", 1, 1, 4));
  Member c(member_args(ep, "n2", 2, 1, 4));
  Member d(member_args(ep, "n3", 3, 1, 4));
  for (auto* m : {&host, &b, &c, &d}) ASSERT_TRUE(m->next("round"));
  // both frozen first: else d may join a round of three between the two kills
  kill(c.pid(), SIGSTOP);
  kill(d.pid(), SIGSTOP);
  c.kill9();
  d.kill9();
  for (auto* m : {&host, &b}) {
    auto r = m->next("round");
    ASSERT_TRUE(r);
    EXPECT_EQ((*r)["members"], json::array({"n0", "n1"}));
  }
}

TEST(RendezvousProcess, WithoutQuorumForThePartitionTimeoutAMemberGivesUp) {
  auto ep = free_endpoint();
  Member host(member_args(ep, "n0", 0, 1, 2, true));
  ASSERT_TRUE(host.next("store"));
  auto args = member_args(ep, "n1", 1, 1, 2);
  args.insert(args.end(), {"--partition-timeout-ms", "1500"});
  Member b(args);
  for (auto* m : {&host, &b}) ASSERT_TRUE(m->next("round"));
  kill(host.pid(), SIGSTOP);  // the store's host hangs: b is cut off from it and from a majority
  auto gave_up = b.next("gave_up");
  ASSERT_TRUE(gave_up) << "no give-up after --partition-timeout";
  EXPECT_NE((*gave_up)["what"].get<std::string>().find("no quorum"), std::string::npos) << *gave_up;
  EXPECT_EQ(WEXITSTATUS(b.wait_exit()), 4);
  kill(host.pid(), SIGCONT);
}

TEST(RendezvousProcess, ASurvivorBelowMinWhoseOtherIsConfirmedGoneLaterFailsOnTheJoinTimeout) {
  // The other member hangs first (not gone: no quorum), then is killed (gone for certain): the
  // quorum wait ends, and the lone survivor below --nnodes MIN fails on its join timeout as before
  // quorums existed (the agent then requeues the job, class node), not after --partition-timeout.
  auto ep = free_endpoint();
  auto host_args = member_args(ep, "n0", 0, 2, 2, true);
  host_args.insert(host_args.end(), {"--join-timeout-ms", "2000", "--partition-timeout-ms", "120000"});
  Member host(host_args);
  ASSERT_TRUE(host.next("store"));
  Member b(member_args(ep, "n1", 1, 2, 2));
  for (auto* m : {&host, &b}) ASSERT_TRUE(m->next("round"));
  kill(b.pid(), SIGSTOP);
  ASSERT_TRUE(host.next("no_quorum")) << "a hung member is not gone: no quorum";
  b.kill9();
  auto quorum = host.next("quorum");
  ASSERT_TRUE(quorum) << "the wait did not end once the other member was gone";
  EXPECT_EQ((*quorum)["present"], 1) << *quorum;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(WEXITSTATUS(host.wait_exit()), 3) << "expected the join timeout's error";
  EXPECT_LT(std::chrono::steady_clock::now() - start, 60s) << "waited for --partition-timeout instead";
}

TEST(RendezvousProcess, ASpareThatWaitedLongerThanTheJoinTimeoutStillJoinsWhenANodeIsLost) {
  // A spare waits in the wait list as long as the job runs at full size; a loss then calls it in.
  // Its join timeout counts from there, not from when it started waiting.
  auto ep = free_endpoint();
  Member host(member_args(ep, "n0", 0, 2, 2, true));
  ASSERT_TRUE(host.next("store"));
  Member b(member_args(ep, "n1", 1, 2, 2));
  for (auto* m : {&host, &b}) ASSERT_TRUE(m->next("round"));
  auto spare_args = member_args(ep, "n2", 2, 2, 2);
  spare_args.insert(spare_args.end(), {"--join-timeout-ms", "1500"});
  Member spare(spare_args);
  std::this_thread::sleep_for(3s);  // twice its join timeout in the wait list
  b.kill9();
  auto r = spare.next("round", 20s);
  ASSERT_TRUE(r) << "the spare did not join the round after the loss";
  EXPECT_EQ((*r)["members"], json::array({"n0", "n2"})) << *r;
}

TEST(RendezvousProcess, WrongTokenIsRefused) {
  auto ep = free_endpoint();
  setenv("ELASTRUN_RDZV_TOKEN", "right", 1);
  auto host_args = member_args(ep, "n0", 0, 1, 2, true);
  host_args.insert(host_args.end(), {"--auth", "token"});
  Member host(host_args);
  ASSERT_TRUE(host.next("store"));
  ASSERT_TRUE(host.next("round"));
  setenv("ELASTRUN_RDZV_TOKEN", "wrong", 1);
  auto bad_args = member_args(ep, "n1", 1, 1, 2);
  bad_args.insert(bad_args.end(), {"--auth", "token", "--join-timeout-ms", "2000"});
  Member intruder(bad_args);
  unsetenv("ELASTRUN_RDZV_TOKEN");
  EXPECT_FALSE(intruder.next("round", 5s)) << "an intruder joined";
  int status = intruder.wait_exit();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3);
}

}  // namespace
