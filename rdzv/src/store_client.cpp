// The store client: one blocking connection, one request at a time.
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <system_error>

#include "elastrun/rdzv/net.hpp"
#include "elastrun/rdzv/store.hpp"
#include "protocol.hpp"

namespace elastrun::rdzv {

using namespace protocol;

struct StoreClient::Impl {
  UniqueFd fd;
  std::string endpoint;
  FrameDecoder decoder{kMaxResponseBytes};
  std::uint32_t next_id = 1;
  Millis io_timeout = kStoreReplyTimeout;  // a request's reply, beyond its own wait
  // interrupt() shuts the socket down from another thread; closing it takes this mutex too, so
  // a descriptor number is never shut down after it was closed (and maybe reused).
  std::mutex fd_mutex;

  [[noreturn]] void lost(const std::string& why) {
    {
      std::lock_guard lock(fd_mutex);
      fd.reset();
    }
    throw StoreError(StoreErrorKind::ConnectionLost, fmt::format("store {}: {}", endpoint, why));
  }

  void send_all(const std::string& bytes) {
    if (!fd) lost("not connected");
    std::size_t off = 0;
    while (off < bytes.size()) {
      ssize_t n = ::send(fd.get(), bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) lost(fmt::format("send failed: {}", std::strerror(errno)));
      off += static_cast<std::size_t>(n);
    }
  }

  Frame receive(std::uint32_t request_id, Millis timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      std::optional<Frame> frame;
      try {
        frame = decoder.next();
      } catch (const ProtocolError& e) {
        lost(fmt::format("bad response: {}", e.what()));
      }
      if (frame) {
        if (frame->header.request_id != request_id)
          lost(fmt::format("response to request {} while waiting for {}", frame->header.request_id, request_id));
        return std::move(*frame);
      }
      auto left = std::chrono::ceil<Millis>(deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) lost(fmt::format("no response within {} ms", timeout.count()));
      pollfd pfd{fd.get(), POLLIN, 0};
      int ready = ::poll(&pfd, 1, static_cast<int>(std::min<long long>(left, 1 << 30)));
      if (ready < 0 && errno == EINTR) continue;
      if (ready < 0) lost(fmt::format("poll failed: {}", std::strerror(errno)));
      if (ready == 0) continue;
      auto area = decoder.write_area();
      ssize_t n = ::recv(fd.get(), area.data(), area.size(), 0);
      decoder.commit(n > 0 ? static_cast<std::size_t>(n) : 0);
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) lost("connection closed by the store");
      if (n < 0) lost(fmt::format("recv failed: {}", std::strerror(errno)));
    }
  }

  // Sends a request, returns the response; throws for statuses not in `accepted`.
  Frame call(Request req, std::initializer_list<Status> accepted = {Status::Ok}) {
    req.request_id = next_id++;
    send_all(encode_request(req));
    auto frame = receive(req.request_id, io_timeout + Millis(req.timeout_ms));
    for (auto s : accepted)
      if (frame.header.status == s) return frame;
    std::string detail;
    if (frame.header.status == Status::AuthFailed || frame.header.status == Status::NotAuthenticated ||
        frame.header.status == Status::StoreFull) {
      try {
        detail = ": " + BodyReader(frame.body).str(kMaxValueBytes);
      } catch (const ProtocolError&) {
      }
    }
    throw StoreError(error_kind(frame.header.status),
                     fmt::format("store {}: {} '{}' failed: {}{}", endpoint, to_string(req.op), req.key,
                                 to_string(frame.header.status), detail));
  }
};

StoreClient::StoreClient(const std::string& host, std::uint16_t port, const AuthConfig& auth, std::string_view run_id,
                         Millis connect_timeout)
    : impl_(std::make_unique<Impl>()) {
  impl_->endpoint = fmt::format("{}:{}", host, port);
  try {
    impl_->fd = connect_tcp(host, port, connect_timeout);
  } catch (const std::system_error& e) {
    throw StoreError(StoreErrorKind::ConnectionLost, fmt::format("cannot reach the store: {}", e.what()),
                     e.code() == std::errc::connection_refused);
  }
  Request hello;
  hello.op = Op::Hello;
  hello.auth_kind = std::string(to_string(auth.kind));
  try {
    hello.credential = make_credential(auth, run_id);
  } catch (const AuthError& e) {
    throw StoreError(StoreErrorKind::AuthFailed, e.what());
  }
  hello.run_id = std::string(run_id);
  // A hung store (a stopped process still accepts connections into its backlog) must not hold
  // a failover for the whole reply timeout: the hello gets about the connect timeout.
  const auto reply_timeout = impl_->io_timeout;
  impl_->io_timeout = std::max(connect_timeout * 2, Millis(2000));
  try {
    impl_->call(hello);
    impl_->io_timeout = reply_timeout;
  } catch (const StoreError& e) {
    // The store says no more than the kind of refusal; its own log has the reason.
    if (e.kind() == StoreErrorKind::WrongRun)
      throw StoreError(e.kind(), fmt::format("the store at {} serves another run than '{}'", impl_->endpoint, run_id));
    if (e.kind() == StoreErrorKind::AuthFailed)
      throw StoreError(e.kind(), fmt::format("the store at {} refused our '{}' credential for run '{}' (its log says "
                                             "why): use the same --rdzv-auth and token on every agent",
                                             impl_->endpoint, to_string(auth.kind), run_id));
    throw;
  }
}

StoreClient::~StoreClient() = default;

void StoreClient::set_reply_timeout(Millis timeout) { impl_->io_timeout = timeout; }

void StoreClient::interrupt() {
  std::lock_guard lock(impl_->fd_mutex);
  if (impl_->fd) ::shutdown(impl_->fd.get(), SHUT_RDWR);  // a blocked poll/recv returns at once
}
StoreClient::StoreClient(StoreClient&&) noexcept = default;
StoreClient& StoreClient::operator=(StoreClient&&) noexcept = default;

std::uint64_t StoreClient::set(std::string_view key, std::string_view value, std::uint64_t lease) {
  Request r;
  r.op = Op::Set;
  r.key = std::string(key);
  r.value = std::string(value);
  r.lease = lease;
  auto f = impl_->call(r);
  return BodyReader(f.body).u64();
}

std::optional<KeyValue> StoreClient::get(std::string_view key) {
  Request r;
  r.op = Op::Get;
  r.key = std::string(key);
  auto f = impl_->call(r, {Status::Ok, Status::NotFound});
  if (f.header.status == Status::NotFound) return std::nullopt;
  BodyReader in(f.body);
  KeyValue kv;
  kv.key = std::string(key);
  kv.value = in.str(kMaxValueBytes);
  kv.revision = in.u64();
  kv.lease = in.u64();
  return kv;
}

std::int64_t StoreClient::add(std::string_view key, std::int64_t delta, std::uint64_t lease) {
  Request r;
  r.op = Op::Add;
  r.key = std::string(key);
  r.delta = delta;
  r.lease = lease;
  auto f = impl_->call(r);
  return BodyReader(f.body).i64();
}

bool StoreClient::compare_and_set(std::string_view key, const std::optional<std::string>& expected,
                                  std::string_view desired, std::uint64_t lease, std::optional<std::string>* current) {
  Request r;
  r.op = Op::CompareAndSet;
  r.key = std::string(key);
  r.value = std::string(desired);
  r.expected = expected.value_or("");
  r.expect_absent = !expected.has_value();
  r.lease = lease;
  auto f = impl_->call(r, {Status::Ok, Status::CasFailed});
  BodyReader in(f.body);
  bool exists = in.u8() != 0;
  auto value = in.str(kMaxValueBytes);
  if (current) *current = exists ? std::optional<std::string>(value) : std::nullopt;
  return f.header.status == Status::Ok;
}

bool StoreClient::remove(std::string_view key) {
  Request r;
  r.op = Op::Delete;
  r.key = std::string(key);
  return impl_->call(r, {Status::Ok, Status::NotFound}).header.status == Status::Ok;
}

std::vector<KeyValue> StoreClient::get_prefix(std::string_view prefix, std::uint64_t* revision) {
  Request r;
  r.op = Op::GetPrefix;
  r.key = std::string(prefix);
  auto f = impl_->call(r);
  BodyReader in(f.body);
  auto rev = in.u64();
  if (revision) *revision = rev;
  auto n = in.u32();
  std::vector<KeyValue> out;
  out.reserve(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    KeyValue kv;
    kv.key = in.str(kMaxKeyBytes);
    kv.value = in.str(kMaxValueBytes);
    kv.revision = in.u64();
    kv.lease = in.u64();
    out.push_back(std::move(kv));
  }
  return out;
}

bool StoreClient::wait(const std::vector<std::string>& keys, Millis timeout) {
  Request r;
  r.op = Op::Wait;
  r.keys = keys;
  r.timeout_ms = static_cast<std::uint32_t>(std::min<long long>(timeout.count(), kMaxTimeoutMs));
  return impl_->call(r, {Status::Ok, Status::Timeout}).header.status == Status::Ok;
}

std::vector<WatchEvent> StoreClient::watch(std::string_view prefix, std::uint64_t after_revision, Millis timeout,
                                           std::uint64_t* revision) {
  Request r;
  r.op = Op::Watch;
  r.key = std::string(prefix);
  r.revision = after_revision;
  r.timeout_ms = static_cast<std::uint32_t>(std::min<long long>(timeout.count(), kMaxTimeoutMs));
  auto f = impl_->call(r, {Status::Ok, Status::Timeout});
  BodyReader in(f.body);
  auto rev = in.u64();
  if (revision) *revision = rev;
  auto n = in.u32();
  std::vector<WatchEvent> events;
  events.reserve(n);
  std::string_view last_value;
  for (std::uint32_t i = 0; i < n; ++i) {
    WatchEvent e;
    e.type = in.u8() == 0 ? WatchEvent::Type::Put : WatchEvent::Type::Delete;
    e.key = in.str(kMaxKeyBytes);
    last_value = in.str_view(kMaxValueBytes);
    if (i + 1 < n) e.value = std::string(last_value);
    e.revision = in.u64();
    events.push_back(std::move(e));
  }
  if (n > 0) {
    if (last_value.size() < 4096) {
      events.back().value = std::string(last_value);
    } else {
      // A large value (a roster) becomes the response's own buffer, trimmed in place: no
      // second copy of it in freshly touched memory.
      const auto offset = static_cast<std::size_t>(last_value.data() - f.body.data());
      const auto length = last_value.size();
      std::string owned = std::move(f.body);
      owned.erase(0, offset);
      owned.resize(length);
      events.back().value = std::move(owned);
    }
  }
  return events;
}

std::uint64_t StoreClient::grant_lease(Millis ttl, std::string_view holder) {
  Request r;
  r.op = Op::LeaseGrant;
  r.value = std::string(holder.substr(0, 256));
  r.timeout_ms = static_cast<std::uint32_t>(std::max<long long>(1, ttl.count()));
  return BodyReader(impl_->call(r).body).u64();
}

bool StoreClient::keep_alive(std::uint64_t lease) {
  Request r;
  r.op = Op::LeaseKeepAlive;
  r.lease = lease;
  return impl_->call(r, {Status::Ok, Status::NoSuchLease}).header.status == Status::Ok;
}

void StoreClient::revoke_lease(std::uint64_t lease) {
  Request r;
  r.op = Op::LeaseRevoke;
  r.lease = lease;
  impl_->call(r);
}

std::uint64_t StoreClient::ping() {
  Request r;
  r.op = Op::Ping;
  return BodyReader(impl_->call(r).body).u64();
}

std::optional<std::int64_t> StoreClient::wall_clock_ms() {
  Request r;
  r.op = Op::Ping;
  const auto reply = impl_->call(r);
  BodyReader body(reply.body);
  body.u64();  // the revision
  try {
    return body.i64();
  } catch (const ProtocolError&) {
    return std::nullopt;  // a store that does not say its time
  }
}

}  // namespace elastrun::rdzv
