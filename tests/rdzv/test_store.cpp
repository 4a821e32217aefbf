// The embedded store over real loopback sockets: operations, blocking waits, watches, leases
// (death by disconnect and by silence), fencing, authentication and hostile input.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <random>
#include <thread>

#include "elastrun/rdzv/net.hpp"
#include "elastrun/rdzv/store.hpp"
#include "protocol.hpp"  // rdzv/src: the decoder tests need the private wire protocol

namespace {

using namespace elastrun::rdzv;
using namespace std::chrono_literals;
using protocol::Status;  // wire statuses, for the decoder tests

constexpr const char* kRun = "test-run";

StoreServerOptions local_options() {
  StoreServerOptions o;
  o.bind_address = "127.0.0.1";
  o.run_id = kRun;
  return o;
}

StoreClient connect(const StoreServer& server, const AuthConfig& auth = {}, const char* run = kRun) {
  return StoreClient("127.0.0.1", server.port(), auth, run);
}

// Polls `condition` for up to `limit` (generous: machines here are small and noisy).
template <typename F>
bool eventually(F condition, std::chrono::milliseconds limit = 10s) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return condition();
}

TEST(Store, SetGetAddCompareAndSetDelete) {
  StoreServer server(local_options());
  auto c = connect(server);
  EXPECT_FALSE(c.get("a").has_value());
  auto r1 = c.set("a", "1");
  auto got = c.get("a");
  ASSERT_TRUE(got);
  EXPECT_EQ(got->value, "1");
  EXPECT_EQ(got->revision, r1);
  EXPECT_EQ(c.add("counter", 5), 5);
  EXPECT_EQ(c.add("counter", -2), 3);
  EXPECT_EQ(c.add("a", 1), 2) << "a decimal value set by set() is a counter too";
}

TEST(Store, AddOnANonNumberIsRefused) {
  StoreServer server(local_options());
  auto c = connect(server);
  c.set("word", "hello");
  try {
    c.add("word", 1);
    FAIL() << "add on a non-number succeeded";
  } catch (const StoreError& e) {
    EXPECT_EQ(e.kind(), StoreErrorKind::NotANumber);
  }
  EXPECT_EQ(c.get("word")->value, "hello");
}

TEST(Store, CompareAndSet) {
  StoreServer server(local_options());
  auto c = connect(server);
  std::optional<std::string> current;
  EXPECT_TRUE(c.compare_and_set("k", std::nullopt, "v1"));
  EXPECT_FALSE(c.compare_and_set("k", std::nullopt, "v2", 0, &current));
  EXPECT_EQ(current, "v1");
  EXPECT_FALSE(c.compare_and_set("k", std::string("wrong"), "v2", 0, &current));
  EXPECT_EQ(c.get("k")->value, "v1");
  EXPECT_TRUE(c.compare_and_set("k", std::string("v1"), "v2"));
  EXPECT_EQ(c.get("k")->value, "v2");
  EXPECT_TRUE(c.remove("k"));
  EXPECT_FALSE(c.remove("k"));
  EXPECT_FALSE(c.get("k"));
}

TEST(Store, PrefixListingIsOrderedAndScoped) {
  StoreServer server(local_options());
  auto c = connect(server);
  c.set("m/2", "b");
  c.set("m/1", "a");
  c.set("other", "x");
  std::uint64_t rev = 0;
  auto kvs = c.get_prefix("m/", &rev);
  ASSERT_EQ(kvs.size(), 2u);
  EXPECT_EQ(kvs[0].key, "m/1");
  EXPECT_EQ(kvs[1].value, "b");
  EXPECT_EQ(rev, c.ping());
}

TEST(Store, WaitBlocksUntilKeysExistOrTimesOut) {
  StoreServer server(local_options());
  auto waiter = connect(server);
  EXPECT_FALSE(waiter.wait({"never"}, 50ms));
  std::thread writer([&] {
    auto w = connect(server);
    std::this_thread::sleep_for(50ms);
    w.set("x", "1");
    w.set("y", "2");
  });
  EXPECT_TRUE(waiter.wait({"x", "y"}, 20s));
  writer.join();
}

TEST(Store, WatchReportsChangesAfterARevision) {
  StoreServer server(local_options());
  auto c = connect(server);
  auto base = c.set("r/a", "1");
  c.set("elsewhere", "z");
  c.set("r/b", "2");
  auto events = c.watch("r/", base, 1s);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].key, "r/b");
  EXPECT_EQ(events[0].type, WatchEvent::Type::Put);

  std::uint64_t rev = 0;
  EXPECT_TRUE(c.watch("r/", events[0].revision, 50ms, &rev).empty()) << "nothing new: timeout";

  std::thread deleter([&] {
    auto d = connect(server);
    std::this_thread::sleep_for(50ms);
    d.remove("r/a");
  });
  auto later = c.watch("r/", events[0].revision, 20s);
  deleter.join();
  ASSERT_EQ(later.size(), 1u);
  EXPECT_EQ(later[0].type, WatchEvent::Type::Delete);
  EXPECT_EQ(later[0].key, "r/a");
}

TEST(Store, WatchBeyondKeptHistoryIsCompacted) {
  auto options = local_options();
  options.watch_history = 4;
  StoreServer server(options);
  auto c = connect(server);
  for (int i = 0; i < 10; ++i) c.set("k", std::to_string(i));
  try {
    c.watch("k", 1, 1s);
    FAIL() << "old history was served";
  } catch (const StoreError& e) {
    EXPECT_EQ(e.kind(), StoreErrorKind::Compacted);
  }
  EXPECT_EQ(c.watch("k", 8, 1s).size(), 2u);
}

TEST(Store, LeaseKeysVanishWhenTheHolderDisconnects) {
  StoreServer server(local_options());
  auto observer = connect(server);
  std::uint64_t rev = 0;
  {
    auto member = connect(server);
    auto lease = member.grant_lease(60s);
    rev = member.set("members/n1", "alive", lease);
    EXPECT_TRUE(observer.get("members/n1"));
  }  // the member's process "dies": its connection closes
  auto events = observer.watch("members/", rev, 20s);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].type, WatchEvent::Type::Delete);
  EXPECT_FALSE(observer.get("members/n1"));
}

TEST(Store, SilentLeaseExpiresAndItsHolderIsFenced) {
  StoreServer server(local_options());
  auto member = connect(server);
  auto observer = connect(server);
  auto lease = member.grant_lease(200ms);
  auto rev = member.set("members/n2", "alive", lease);
  EXPECT_TRUE(member.keep_alive(lease));
  // No more keep-alives: the member is silent (hung, stopped, partitioned).
  auto events = observer.watch("members/", rev, 20s);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].type, WatchEvent::Type::Delete);
  // It comes back: its lease is gone and every write under it is refused.
  EXPECT_FALSE(member.keep_alive(lease));
  try {
    member.set("members/n2", "back", lease);
    FAIL() << "a fenced member wrote";
  } catch (const StoreError& e) {
    EXPECT_EQ(e.kind(), StoreErrorKind::NoSuchLease);
  }
  EXPECT_FALSE(observer.get("members/n2"));
}

TEST(Store, KeepAliveHoldsALease) {
  StoreServer server(local_options());
  auto member = connect(server);
  auto lease = member.grant_lease(300ms);
  member.set("alive", "yes", lease);
  for (int i = 0; i < 10; ++i) {
    std::this_thread::sleep_for(60ms);
    ASSERT_TRUE(member.keep_alive(lease));
  }
  EXPECT_TRUE(member.get("alive"));
  member.revoke_lease(lease);
  EXPECT_FALSE(member.get("alive"));
}

// Optional Slurm confirmation: a silent holder whose node Slurm reports up gets one grace period;
// one reported down (or unknown) loses its lease at the first missed deadline.
struct Confirmation {
  std::atomic<int> calls{0};
  std::optional<bool> answer;
  std::string last_holder;
  std::mutex m;
};

StoreServerOptions confirming_options(std::shared_ptr<Confirmation> c) {
  auto o = local_options();
  o.holder_is_down = [c](const std::string& holder) {
    {
      std::lock_guard lock(c->m);
      c->last_holder = holder;
    }
    ++c->calls;
    return c->answer;
  };
  return o;
}

TEST(Store, SlurmConfirmedUpNodeGetsOneGracePeriod) {
  auto c = std::make_shared<Confirmation>();
  c->answer = false;  // Slurm: node is up
  StoreServer server(confirming_options(c));
  auto member = connect(server);
  auto lease = member.grant_lease(1000ms, "n7");
  member.set("alive/n7", "x", lease);
  ASSERT_TRUE(eventually([&] { return c->calls.load() == 1; }, 20s)) << "Slurm was never asked";
  EXPECT_TRUE(member.get("alive/n7")) << "deleted although Slurm reports the node up";
  {
    std::lock_guard lock(c->m);
    EXPECT_EQ(c->last_holder, "n7");
  }
  // Still silent after the grace period: the lease ends without asking again.
  EXPECT_TRUE(eventually([&] { return !member.get("alive/n7"); }, 20s));
  EXPECT_EQ(c->calls.load(), 1);
  EXPECT_FALSE(member.keep_alive(lease));
}

TEST(Store, SlurmConfirmedDownOrUnknownEndsTheLeaseAtOnce) {
  for (std::optional<bool> answer : {std::optional<bool>(true), std::optional<bool>()}) {
    auto c = std::make_shared<Confirmation>();
    c->answer = answer;
    StoreServer server(confirming_options(c));
    auto member = connect(server);
    auto lease = member.grant_lease(300ms, "n8");
    auto rev = member.set("alive/n8", "x", lease);
    auto events = member.watch("alive/", rev, 20s);
    ASSERT_EQ(events.size(), 1u);
    EXPECT_EQ(events[0].type, WatchEvent::Type::Delete);
    EXPECT_EQ(c->calls.load(), 1);
  }
}

TEST(Store, WrongTokenIsRefusedAndChangesNothing) {
  auto options = local_options();
  options.auth = {AuthKind::Token, "s3cret", "", ""};
  StoreServer server(options);
  AuthConfig wrong{AuthKind::Token, "guess", "", ""};
  try {
    connect(server, wrong);
    FAIL() << "wrong token accepted";
  } catch (const StoreError& e) {
    EXPECT_EQ(e.kind(), StoreErrorKind::AuthFailed);
    EXPECT_NE(std::string(e.what()).find("refused our 'token' credential"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("s3cret"), std::string::npos) << e.what();
  }
  try {
    connect(server, AuthConfig{});  // no credential at all
    FAIL() << "missing credential accepted";
  } catch (const StoreError& e) {
    EXPECT_EQ(e.kind(), StoreErrorKind::AuthFailed);
  }
  auto good = connect(server, options.auth);
  EXPECT_EQ(good.get_prefix("").size(), 0u);
  EXPECT_TRUE(eventually([&] { return server.stats().refused_auth == 2; }));
}

TEST(Store, ClientOfAnotherRunIsRefusedWithoutLearningTheRun) {
  StoreServer server(local_options());
  try {
    connect(server, {}, "some-other-job");
    FAIL() << "client of another run accepted";
  } catch (const StoreError& e) {
    EXPECT_EQ(e.kind(), StoreErrorKind::WrongRun) << "a status of its own: port fallbacks rely on it";
    EXPECT_NE(std::string(e.what()).find("another run than 'some-other-job'"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find(local_options().run_id), std::string::npos)
        << "the store's run id leaked: " << e.what();
  }
}

TEST(Store, SilentConnectionIsClosedAfterTheHelloTimeout) {
  auto options = local_options();
  options.hello_timeout = 300ms;
  StoreServer server(options);
  auto fd = connect_tcp("127.0.0.1", server.port(), 2s);
  pollfd p{fd.get(), POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 10'000), 1) << "the store kept a connection that never said hello";
  char byte;
  EXPECT_EQ(::recv(fd.get(), &byte, 1, 0), 0) << "expected the store to close the connection";
  EXPECT_TRUE(eventually([&] { return server.stats().refused_auth == 1; }));
  // An authenticated client is not affected by the timeout.
  auto c = connect(server);
  std::this_thread::sleep_for(600ms);
  c.set("k", "v");
  EXPECT_EQ(c.get("k")->value, "v");
}

TEST(Store, FullStoreRefusesWrites) {
  auto options = local_options();
  options.max_store_bytes = 1000;
  StoreServer server(options);
  auto c = connect(server);
  c.set("small", std::string(100, 'x'));
  try {
    c.set("big", std::string(2000, 'x'));
    FAIL() << "store grew beyond its limit";
  } catch (const StoreError& e) {
    EXPECT_EQ(e.kind(), StoreErrorKind::StoreFull);
  }
  EXPECT_LE(server.stats().bytes, 1000u);
}

// Writes raw bytes on a fresh connection and reports whether the server closed it.
bool server_closes_after(const StoreServer& server, const std::string& bytes) {
  auto fd = connect_tcp("127.0.0.1", server.port(), 5s);
  if (::send(fd.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL) < 0) return true;
  timeval tv{10, 0};
  setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char buf[4096];
  while (true) {
    auto n = ::recv(fd.get(), buf, sizeof buf, 0);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET;
  }
}

TEST(Store, MalformedFramesCloseOnlyThatConnection) {
  StoreServer server(local_options());
  auto healthy = connect(server);
  healthy.set("before", "1");

  using namespace protocol;
  std::string bad_magic(16, '\0');
  std::string huge = encode_frame({Op::Set, Status::Ok, 0, 1, 0}, "");
  huge[12] = huge[13] = huge[14] = static_cast<char>(0xff);  // body length ~4 GiB
  Request set_req;
  set_req.op = Op::Set;
  set_req.key = "k";
  set_req.value = "v";
  auto set_frame = encode_request(set_req);
  std::string truncated_body = set_frame.substr(0, 16) + set_frame.substr(16, 3);
  truncated_body[12] = 3;  // header says 3 bytes: the key length field itself is cut
  truncated_body[13] = truncated_body[14] = truncated_body[15] = 0;
  std::string bad_version = set_frame;
  bad_version[4] = 99;
  std::string bad_op = set_frame;
  bad_op[5] = 77;
  std::string before_hello = set_frame;

  for (const auto& bytes : {bad_magic, huge, truncated_body, bad_version, bad_op, before_hello})
    EXPECT_TRUE(server_closes_after(server, bytes));

  // Still serving, nothing written by the hostile connections, and no growth.
  EXPECT_EQ(healthy.get("before")->value, "1");
  EXPECT_FALSE(healthy.get("k"));
  EXPECT_TRUE(eventually([&] { return server.stats().connections == 1; }));
  EXPECT_GE(server.stats().protocol_errors, 4u);
}

TEST(Protocol, RandomBytesNeverCrashTheDecoder) {
  std::mt19937_64 rng(12345);
  std::size_t frames = 0;
  for (int round = 0; round < 20000; ++round) {
    protocol::FrameDecoder decoder;
    std::string bytes;
    // Half the inputs start with a valid header so the body parsers are exercised too.
    if (round % 2 == 0) {
      protocol::Request r;
      r.op = static_cast<protocol::Op>(1 + rng() % 13);
      r.key = "k";
      bytes = protocol::encode_request(r).substr(0, 16);
      bytes[12] = static_cast<char>(rng() % 64);
      bytes[13] = bytes[14] = bytes[15] = 0;
    }
    auto extra = rng() % 80;
    for (std::size_t i = 0; i < extra; ++i) bytes.push_back(static_cast<char>(rng()));
    decoder.feed(bytes.data(), bytes.size());
    try {
      while (auto f = decoder.next()) {
        ++frames;
        try {
          protocol::decode_request(*f);
        } catch (const protocol::ProtocolError&) {
        }
      }
    } catch (const protocol::ProtocolError&) {
    }
  }
  EXPECT_GT(frames, 0u) << "the generator never produced a whole frame";
}

TEST(Protocol, RequestsRoundTrip) {
  protocol::Request r;
  r.op = protocol::Op::CompareAndSet;
  r.request_id = 42;
  r.key = "key";
  r.expected = "old";
  r.value = std::string(1000, 'v');
  r.lease = 7;
  protocol::FrameDecoder d;
  auto bytes = protocol::encode_request(r);
  // Delivered one byte at a time, as a slow network might.
  std::optional<protocol::Frame> frame;
  for (char ch : bytes) {
    d.feed(&ch, 1);
    if (auto f = d.next()) frame = std::move(f);
  }
  ASSERT_TRUE(frame);
  auto back = protocol::decode_request(*frame);
  EXPECT_EQ(back.request_id, 42u);
  EXPECT_EQ(back.key, "key");
  EXPECT_EQ(back.expected, "old");
  EXPECT_EQ(back.value, r.value);
  EXPECT_EQ(back.lease, 7u);
  EXPECT_FALSE(back.expect_absent);
}

}  // namespace
