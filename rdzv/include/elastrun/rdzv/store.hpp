// The embedded rendezvous store: a small TCP key-value server hosted inside the job, and its
// client. Beyond set/get/add/compare-and-set/delete it has the two things a rendezvous needs:
//  - leases: keys can be attached to a lease that dies when its holder's connection drops
//    (process death, detected at once) or when it misses keep-alives for its time-to-live
//    (a silent node); the lease's keys are then deleted and every write under it is refused;
//  - blocking waits and watches (long-poll on a key prefix from a revision), so agents learn
//    of changes without polling loops.
// The server is one thread with epoll; state lives only in memory, bounded in size.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "elastrun/rdzv/auth.hpp"
#include "elastrun/rdzv/kv.hpp"

namespace elastrun::rdzv {

// Why a store request failed, as callers see it (the wire protocol's statuses stay private to
// rdzv, in src/protocol.hpp).
enum class StoreErrorKind {
  NotFound,
  CasFailed,
  Timeout,
  NoSuchLease,  // expired, revoked, or never granted: the holder was declared dead
  Compacted,    // a watch asked for history the server no longer keeps
  BadRequest,
  AuthFailed,  // refused: wrong or missing credentials (the store says nothing more)
  NotAuthenticated,
  TooLarge,
  StoreFull,
  NotANumber,
  WrongRun,        // refused at hello: the store serves another run (e.g. a stale port of another job)
  AddressInUse,    // a store could not listen: its port (and every fallback) is taken
  ConnectionLost,  // transport: unreachable, or the connection dropped
};
std::string_view to_string(StoreErrorKind kind);

// A store request failed: transport, refusal, or a status the caller did not expect.
class StoreError : public std::runtime_error {
 public:
  StoreError(StoreErrorKind kind, const std::string& what, bool refused = false)
      : std::runtime_error(what), kind_(kind), refused_(refused) {}
  StoreErrorKind kind() const { return kind_; }
  // ConnectionLost because nothing listens there (the connection was refused): the store's
  // process or host is gone, not a link that may come back (a timeout).
  bool refused() const { return refused_; }

 private:
  StoreErrorKind kind_;
  bool refused_ = false;
};

struct StoreServerOptions {
  std::string bind_address = "0.0.0.0";
  std::uint16_t port = 0;                     // 0: any free port
  std::vector<std::uint16_t> fallback_ports;  // tried in order when `port` is taken
  AuthConfig auth;
  std::string run_id;  // clients must name the same run (a stray job's agents are refused)
  // A connection that has not said a valid hello within this long is closed: an idle or
  // unauthenticated peer cannot hold one of the max_connections slots.
  Millis hello_timeout{5000};
  std::size_t max_connections = 8192;
  std::size_t max_store_bytes = 256u << 20;
  std::size_t watch_history = 1u << 16;        // events kept for watchers that fall behind
  std::size_t max_pending_output = 64u << 20;  // per connection; a client that stops reading is cut
  // Optional Slurm confirmation of silent members: when a lease misses its keep-alives, ask
  // whether its holder's node is down (e.g. slurm_node_is_down). `false` (Slurm sees the node
  // up) grants one more time-to-live of grace before the lease dies; `true` or unknown ends it
  // at once. Runs on a separate thread: a slow slurmctld never stalls the store.
  std::function<std::optional<bool>(const std::string& holder)> holder_is_down;
};

class StoreServer {
 public:
  explicit StoreServer(StoreServerOptions options);  // binds and starts serving; throws StoreError
  ~StoreServer();                                    // stops the thread, closes every connection
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  std::uint16_t port() const;

  struct Stats {
    std::size_t connections = 0;
    std::size_t keys = 0;
    std::size_t bytes = 0;
    std::size_t leases = 0;
    std::uint64_t revision = 0;
    std::uint64_t refused_auth = 0;
    std::uint64_t protocol_errors = 0;
  };
  Stats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class StoreClient final : public KvBackend {
 public:
  // Connects and authenticates; throws StoreError (refused, unreachable, wrong run id).
  StoreClient(const std::string& host, std::uint16_t port, const AuthConfig& auth, std::string_view run_id,
              Millis connect_timeout = Millis(5000));
  ~StoreClient() override;
  StoreClient(StoreClient&&) noexcept;
  StoreClient& operator=(StoreClient&&) noexcept;

  std::uint64_t set(std::string_view key, std::string_view value, std::uint64_t lease = 0) override;
  std::optional<KeyValue> get(std::string_view key) override;
  std::int64_t add(std::string_view key, std::int64_t delta, std::uint64_t lease = 0) override;
  // Sets `desired` if the key currently holds `expected` (or, with expected == nullopt, does
  // not exist). Returns true if swapped; `current` receives the value found otherwise.
  bool compare_and_set(std::string_view key, const std::optional<std::string>& expected, std::string_view desired,
                       std::uint64_t lease = 0, std::optional<std::string>* current = nullptr) override;
  bool remove(std::string_view key) override;
  std::vector<KeyValue> get_prefix(std::string_view prefix, std::uint64_t* revision = nullptr) override;
  // True once every key exists; false on timeout.
  bool wait(const std::vector<std::string>& keys, Millis timeout);
  // Events under `prefix` after `after_revision`; empty on timeout. Throws StoreError with
  // Status::Compacted when the server no longer has that history (re-read with get_prefix).
  std::vector<WatchEvent> watch(std::string_view prefix, std::uint64_t after_revision, Millis timeout,
                                std::uint64_t* revision = nullptr) override;
  std::uint64_t grant_lease(
      Millis ttl, std::string_view holder = {}) override;  // dies with this connection or after ttl without keep-alive
  bool keep_alive(std::uint64_t lease) override;           // false: the lease is gone (we were declared dead)
  void revoke_lease(std::uint64_t lease) override;
  std::uint64_t ping();  // the store's revision
  std::optional<std::int64_t> wall_clock_ms() override;
  void set_reply_timeout(Millis timeout) override;
  void interrupt() override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace elastrun::rdzv
