// One behavioural suite, two engines: the embedded store and a real etcd (Debian's etcd-server,
// started on loopback by this test and stopped by PID). Key-value semantics the membership
// protocol relies on, then the membership protocol itself.
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <memory>
#include <thread>

#include "elastrun/rdzv/etcd.hpp"
#include "elastrun/rdzv/net.hpp"
#include "elastrun/rdzv/rendezvous.hpp"
#include "elastrun/rdzv/store.hpp"
#include "support/daemon.hpp"

namespace {

using namespace elastrun::rdzv;
using namespace std::chrono_literals;

std::uint16_t free_port() { return listen_tcp("127.0.0.1", 0).port; }

// A private etcd for the whole test program.
class EtcdServer : public testing::Environment {
 public:
  static inline std::string endpoint;

  void SetUp() override {
    const auto client = free_port(), peer = free_port();
    endpoint = "127.0.0.1:" + std::to_string(client);
    const auto peer_url = "http://127.0.0.1:" + std::to_string(peer);
    etcd_.start({"etcd", "--name", "test", "--data-dir", (etcd_.dir() / "data").string(), "--listen-client-urls",
                 "http://" + endpoint, "--advertise-client-urls", "http://" + endpoint, "--listen-peer-urls", peer_url,
                 "--initial-advertise-peer-urls", peer_url, "--initial-cluster", "test=" + peer_url, "--logger", "zap",
                 "--log-outputs", "stderr"},
                [] {
                  try {
                    EtcdKv probe(endpoint, 2s);
                    return true;
                  } catch (const StoreError&) {
                    return false;
                  }
                });
  }

 private:
  elastrun::testing_support::Daemon etcd_{"etcd"};
};

// gtest takes ownership of environments through a raw pointer.
const auto* const kEtcd = testing::AddGlobalTestEnvironment(std::make_unique<EtcdServer>().release());

// Each test gets its own run prefix so tests never see each other's keys on the shared etcd.
class Backend : public testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    run_ = std::string(testing::UnitTest::GetInstance()->current_test_info()->name());
    for (auto& c : run_)
      if (c == '/') c = '_';
    if (GetParam() == "embedded") {
      StoreServerOptions o;
      o.bind_address = "127.0.0.1";
      o.run_id = "suite";
      server_ = std::make_unique<StoreServer>(o);
    }
  }
  std::unique_ptr<KvBackend> client() {
    if (GetParam() == "embedded")
      return std::make_unique<StoreClient>("127.0.0.1", server_->port(), AuthConfig{}, "suite");
    return std::make_unique<EtcdKv>(EtcdServer::endpoint);
  }
  std::string key(std::string_view k) const { return "t/" + run_ + "/" + std::string(k); }
  std::unique_ptr<Rendezvous> member(const std::string& name, int index, int nproc, int min, int max,
                                     Millis last_call = 300ms, Millis join_timeout = 30s) {
    MemberInfo me;
    me.node_name = name;
    me.address = "127.0.0.1";
    me.node_index = index;
    me.nproc = nproc;
    RendezvousConfig cfg;
    cfg.run_id = run_;
    cfg.min_nodes = min;
    cfg.max_nodes = max;
    cfg.join_timeout = join_timeout;
    cfg.last_call_timeout = last_call;
    cfg.heartbeat_timeout = 2s;
    return std::make_unique<Rendezvous>(client(), client(), cfg, me);
  }

  std::unique_ptr<StoreServer> server_;
  std::string run_;
};

INSTANTIATE_TEST_SUITE_P(Engines, Backend, testing::Values("embedded", "etcd"),
                         [](const auto& info) { return info.param; });

TEST_P(Backend, SetGetAddRemove) {
  auto c = client();
  EXPECT_FALSE(c->get(key("a")));
  auto rev = c->set(key("a"), "1");
  auto got = c->get(key("a"));
  ASSERT_TRUE(got);
  EXPECT_EQ(got->value, "1");
  EXPECT_EQ(got->revision, rev);
  EXPECT_EQ(c->add(key("n"), 3), 3);
  EXPECT_EQ(c->add(key("n"), -1), 2);
  EXPECT_TRUE(c->remove(key("a")));
  EXPECT_FALSE(c->remove(key("a")));
}

TEST_P(Backend, CompareAndSetCreatesOnceAndReportsCurrent) {
  auto c = client();
  std::optional<std::string> current;
  EXPECT_TRUE(c->compare_and_set(key("k"), std::nullopt, "v1"));
  EXPECT_FALSE(c->compare_and_set(key("k"), std::nullopt, "v2", 0, &current));
  EXPECT_EQ(current, "v1");
  EXPECT_FALSE(c->compare_and_set(key("k"), std::string("nope"), "v2"));
  EXPECT_TRUE(c->compare_and_set(key("k"), std::string("v1"), "v2"));
  EXPECT_EQ(c->get(key("k"))->value, "v2");
}

TEST_P(Backend, ConcurrentAddsAreAtomic) {
  std::vector<std::future<void>> writers;
  for (int t = 0; t < 4; ++t)
    writers.push_back(std::async(std::launch::async, [&] {
      auto c = client();
      for (int i = 0; i < 25; ++i) c->add(key("counter"), 1);
    }));
  for (auto& w : writers) w.get();
  EXPECT_EQ(client()->add(key("counter"), 0), 100);
}

TEST_P(Backend, PrefixListingIsSortedAndScoped) {
  auto c = client();
  c->set(key("m/b"), "2");
  c->set(key("m/a"), "1");
  c->set(key("mx"), "x");
  std::uint64_t rev = 0;
  auto kvs = c->get_prefix(key("m/"), &rev);
  ASSERT_EQ(kvs.size(), 2u);
  EXPECT_EQ(kvs[0].key, key("m/a"));
  EXPECT_EQ(kvs[1].value, "2");
  EXPECT_GE(rev, kvs[1].revision);
}

TEST_P(Backend, WatchSeesPutsAndDeletesAfterARevisionOrTimesOut) {
  auto c = client();
  std::uint64_t rev = 0;
  c->get_prefix(key("w/"), &rev);
  EXPECT_TRUE(c->watch(key("w/"), rev, 200ms).empty());
  std::thread writer([&] {
    auto w = client();
    std::this_thread::sleep_for(100ms);
    w->set(key("w/x"), "1");
  });
  auto events = c->watch(key("w/"), rev, 20s, &rev);
  writer.join();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].key, key("w/x"));
  EXPECT_EQ(events[0].type, WatchEvent::Type::Put);
  c->remove(key("w/x"));
  auto later = c->watch(key("w/"), rev, 20s);
  ASSERT_EQ(later.size(), 1u);
  EXPECT_EQ(later[0].type, WatchEvent::Type::Delete);
}

TEST_P(Backend, ExpiredLeaseDeletesItsKeysAndFencesItsHolder) {
  auto c = client();
  auto lease = c->grant_lease(1000ms);
  std::uint64_t rev = c->set(key("alive/me"), "x", lease);
  auto events = c->watch(key("alive/"), rev, 30s);  // no keep-alives: the lease expires
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].type, WatchEvent::Type::Delete);
  EXPECT_FALSE(c->keep_alive(lease));
  try {
    c->set(key("alive/me"), "back", lease);
    FAIL() << "a write under a dead lease was accepted";
  } catch (const StoreError& e) {
    EXPECT_EQ(e.kind(), StoreErrorKind::NoSuchLease) << e.what();
  }
}

TEST_P(Backend, KeepAliveHoldsALeaseAndRevokeEndsIt) {
  auto c = client();
  auto lease = c->grant_lease(2000ms);
  c->set(key("held"), "x", lease);
  for (int i = 0; i < 6; ++i) {
    std::this_thread::sleep_for(500ms);
    ASSERT_TRUE(c->keep_alive(lease));
  }
  EXPECT_TRUE(c->get(key("held")));
  c->revoke_lease(lease);
  EXPECT_FALSE(c->get(key("held")));
}

// ---- the membership protocol on either engine -------------------------------------------------

TEST_P(Backend, RoundRanksFollowNodeIndexWithPrefixSum) {
  auto a = member("zeta", 0, 2, 3, 3);
  auto b = member("beta", 1, 1, 3, 3);
  auto d = member("alpha", 2, 3, 3, 3);
  auto fa = std::async(std::launch::async, [&] { return a->next_round(); });
  auto fb = std::async(std::launch::async, [&] { return b->next_round(); });
  auto rd = d->next_round();
  auto ra = fa.get(), rb = fb.get();
  EXPECT_EQ(ra.group_rank, 0);
  EXPECT_EQ(rb.rank_offset, 2);
  EXPECT_EQ(rd.rank_offset, 3);
  EXPECT_EQ(rd.world_size, 6);
  EXPECT_EQ(ra.master_port, rd.master_port);
  EXPECT_EQ(ra.generation, rb.generation);
}

TEST_P(Backend, JoinTimeout) {
  auto a = member("a", 0, 1, 2, 2, 100ms, 1500ms);
  EXPECT_THROW(a->next_round(), RendezvousError);
}

TEST_P(Backend, LateJoinerScalesUp) {
  auto a = member("a", 0, 1, 2, 3);
  auto b = member("b", 1, 1, 2, 3);
  auto fa = std::async(std::launch::async, [&] { return a->next_round(); });
  b->next_round();
  ASSERT_EQ(fa.get().group_world_size, 2);
  auto c = member("c", 2, 1, 2, 3);
  auto fc = std::async(std::launch::async, [&] { return c->next_round(); });
  EXPECT_EQ(a->wait_for_change(30s), Change::MemberWaiting);
  EXPECT_EQ(b->wait_for_change(30s), Change::MemberWaiting);
  auto fa2 = std::async(std::launch::async, [&] { return a->next_round(); });
  auto rb2 = b->next_round();
  EXPECT_EQ(rb2.group_world_size, 3);
  EXPECT_EQ(fa2.get().group_world_size, 3);
  EXPECT_EQ(fc.get().group_rank, 2);
}

TEST_P(Backend, LeavingMemberIsLostAndSurvivorsReform) {
  auto a = member("a", 0, 1, 2, 3);
  auto b = member("b", 1, 1, 2, 3);
  auto c = member("c", 2, 1, 2, 3);
  auto fa = std::async(std::launch::async, [&] { return a->next_round(); });
  auto fb = std::async(std::launch::async, [&] { return b->next_round(); });
  c->next_round();
  fa.get();
  fb.get();
  c.reset();  // leaves: its lease is revoked
  EXPECT_EQ(a->wait_for_change(30s), Change::MemberLost);
  EXPECT_EQ(b->wait_for_change(30s), Change::MemberLost);
  auto fa2 = std::async(std::launch::async, [&] { return a->next_round(); });
  auto rb = b->next_round();
  EXPECT_EQ(rb.group_world_size, 2);
  EXPECT_EQ(fa2.get().members().size(), 2u);
}

TEST_P(Backend, ReformAfterALossFormsWithoutTheLastCall) {
  // a 20 s last call: the survivors must not wait for it, every live agent has joined
  auto a = member("a", 0, 1, 2, 3, 20s);
  auto b = member("b", 1, 1, 2, 3, 20s);
  auto c = member("c", 2, 1, 2, 3, 20s);
  auto fa = std::async(std::launch::async, [&] { return a->next_round(); });
  auto fb = std::async(std::launch::async, [&] { return b->next_round(); });
  c->next_round();  // MAX joined: formed at once
  fa.get();
  fb.get();
  c.reset();
  EXPECT_EQ(a->wait_for_change(30s), Change::MemberLost);
  EXPECT_EQ(b->wait_for_change(30s), Change::MemberLost);
  const auto t0 = std::chrono::steady_clock::now();
  auto fa2 = std::async(std::launch::async, [&] { return a->next_round(); });
  auto rb = b->next_round();
  EXPECT_EQ(fa2.get().group_world_size, 2);
  EXPECT_EQ(rb.group_world_size, 2);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s) << "the re-form waited for the last call";
}

TEST_P(Backend, ConfirmMembersHearsEveryWatchingAgentAndNamesASilentOne) {
  auto a = member("a", 0, 1, 3, 3);
  auto b = member("b", 1, 1, 3, 3);
  auto c = member("c", 2, 1, 3, 3);
  auto fa = std::async(std::launch::async, [&] { return a->next_round(); });
  auto fb = std::async(std::launch::async, [&] { return b->next_round(); });
  c->next_round();
  fa.get();
  fb.get();
  // b watches for changes (as an agent in MONITOR does) and so answers; c is alive (its lease
  // is renewed by its heartbeat thread) but its main loop never looks: unconfirmed
  std::atomic<bool> stop{false};
  auto watcher = std::async(std::launch::async, [&] {
    while (!stop) b->wait_for_change(100ms);
  });
  const auto confirmation = a->confirm_members(1500ms);
  stop = true;
  watcher.get();
  EXPECT_EQ(confirmation.change, Change::None);
  EXPECT_EQ(confirmation.unconfirmed, std::vector<std::string>{"c"});
}

TEST_P(Backend, RestartRequestCloseAndJobWideCounter) {
  auto a = member("a", 0, 1, 2, 2);
  auto b = member("b", 1, 1, 2, 2);
  auto fa = std::async(std::launch::async, [&] { return a->next_round(); });
  b->next_round();
  fa.get();
  b->request_new_round();
  EXPECT_EQ(a->wait_for_change(30s), Change::Reform);
  EXPECT_EQ(a->add_to_counter("restarts", 1), 1);
  EXPECT_EQ(b->add_to_counter("restarts", 0), 1);
  a->close("done");
  auto change = b->wait_for_change(30s);
  if (change == Change::Reform) change = b->wait_for_change(30s);  // b's own request comes first
  EXPECT_EQ(change, Change::Closed);
  EXPECT_THROW(member("late", 5, 1, 1, 3)->next_round(), RendezvousClosed);
}

}  // namespace
