// etcd v3 as the external rendezvous engine (--rdzv-backend=etcd --rdzv-endpoint=host:port),
// spoken through etcd's JSON gateway (/v3/kv, /v3/lease, /v3/watch) with libcurl: no gRPC or
// protobuf stack for five RPCs, and the same plain HTTP that `curl` can replay when debugging.
// Differences from the embedded store (docs/rendezvous.md): a lease dies only by TTL (etcd
// does not tie it to a connection), and TTLs are whole seconds.
#pragma once

#include <memory>
#include <string>

#include "elastrun/rdzv/kv.hpp"

namespace elastrun::rdzv {

class EtcdKv final : public KvBackend {
 public:
  // `endpoint` is host:port of an etcd client URL (http). Throws StoreError if unreachable.
  explicit EtcdKv(const std::string& endpoint, Millis request_timeout = Millis(10000));
  ~EtcdKv() override;
  EtcdKv(const EtcdKv&) = delete;
  EtcdKv& operator=(const EtcdKv&) = delete;

  std::uint64_t set(std::string_view key, std::string_view value, std::uint64_t lease = 0) override;
  std::optional<KeyValue> get(std::string_view key) override;
  std::int64_t add(std::string_view key, std::int64_t delta, std::uint64_t lease = 0) override;
  bool compare_and_set(std::string_view key, const std::optional<std::string>& expected, std::string_view desired,
                       std::uint64_t lease = 0, std::optional<std::string>* current = nullptr) override;
  bool remove(std::string_view key) override;
  std::vector<KeyValue> get_prefix(std::string_view prefix, std::uint64_t* revision = nullptr) override;
  std::vector<WatchEvent> watch(std::string_view prefix, std::uint64_t after_revision, Millis timeout,
                                std::uint64_t* revision = nullptr) override;
  std::uint64_t grant_lease(Millis ttl, std::string_view holder = {}) override;
  bool keep_alive(std::uint64_t lease) override;
  void revoke_lease(std::uint64_t lease) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Base64 (RFC 4648) as etcd's JSON gateway encodes keys and values.
std::string base64_encode(std::string_view bytes);
std::string base64_decode(std::string_view text);  // throws std::invalid_argument

}  // namespace elastrun::rdzv
