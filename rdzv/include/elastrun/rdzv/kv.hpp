// The key-value operations a rendezvous needs, implemented by the embedded store's client and
// by the etcd backend, so the membership protocol runs unchanged on either.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace elastrun::rdzv {

using Millis = std::chrono::milliseconds;

// How long the embedded store's client waits for a reply beyond the request's own wait, unless
// set_reply_timeout() says otherwise.
inline constexpr Millis kStoreReplyTimeout{30000};

struct KeyValue {
  std::string key;
  std::string value;
  std::uint64_t revision = 0;  // revision of the last modification
  std::uint64_t lease = 0;
};

struct WatchEvent {
  enum class Type : std::uint8_t { Put = 0, Delete = 1 };
  Type type = Type::Put;
  std::string key;
  std::string value;
  std::uint64_t revision = 0;
};

class KvBackend {
 public:
  virtual ~KvBackend() = default;
  virtual std::uint64_t set(std::string_view key, std::string_view value, std::uint64_t lease = 0) = 0;
  virtual std::optional<KeyValue> get(std::string_view key) = 0;
  virtual std::int64_t add(std::string_view key, std::int64_t delta, std::uint64_t lease = 0) = 0;
  // Sets `desired` if the key holds `expected` (nullopt: if it does not exist). True if swapped;
  // otherwise `current` (if given) receives what was found.
  virtual bool compare_and_set(std::string_view key, const std::optional<std::string>& expected,
                               std::string_view desired, std::uint64_t lease = 0,
                               std::optional<std::string>* current = nullptr) = 0;
  virtual bool remove(std::string_view key) = 0;
  virtual std::vector<KeyValue> get_prefix(std::string_view prefix, std::uint64_t* revision = nullptr) = 0;
  // Events under `prefix` after `after_revision`; empty on timeout.
  virtual std::vector<WatchEvent> watch(std::string_view prefix, std::uint64_t after_revision, Millis timeout,
                                        std::uint64_t* revision = nullptr) = 0;
  // A lease dies after `ttl` without keep-alive (and, on the embedded store, with the
  // connection that holds it); its keys are deleted and writes under it are refused.
  // `holder` names the node holding the lease (lets the store confirm a silent holder with Slurm).
  virtual std::uint64_t grant_lease(Millis ttl, std::string_view holder = {}) = 0;
  virtual bool keep_alive(std::uint64_t lease) = 0;
  virtual void revoke_lease(std::uint64_t lease) = 0;
  // How long a reply may take beyond the request's own wait before the store counts as lost
  // (ConnectionLost). The embedded store's client: kStoreReplyTimeout unless set; etcd's backend keeps its own.
  virtual void set_reply_timeout(Millis /*timeout*/) {}
  // Called from another thread: a call blocked on this connection fails at once with
  // ConnectionLost, and so does every later one (the embedded store's client shuts its socket
  // down). Used to fence an agent on its own clock when its keep-alives go unanswered.
  virtual void interrupt() {}
  // The store host's wall clock (milliseconds since the epoch) as it answers now; nullopt where
  // the backend cannot tell (etcd). The agent's health check measures its clock offset with it.
  virtual std::optional<std::int64_t> wall_clock_ms() { return std::nullopt; }
};

}  // namespace elastrun::rdzv
