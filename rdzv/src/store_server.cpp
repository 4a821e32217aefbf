// The store server: one thread, epoll, all state in memory.
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <atomic>
#include <cerrno>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>
#include <unordered_map>

#include "elastrun/rdzv/net.hpp"
#include "elastrun/rdzv/store.hpp"
#include "protocol.hpp"
#include "elastrun/util/parse.hpp"

namespace elastrun::rdzv {

using namespace protocol;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::uint64_t kListenerId = 0;
constexpr std::uint64_t kWakeId = 1;

// Bytes waiting to be sent. Watch answers share one body between every watcher that asked for
// the same changes (a roster reaches all members at once), so chunks are reference-counted.
struct OutChunk {
  std::shared_ptr<const std::string> bytes;
  std::size_t offset = 0;
};

struct Connection {
  UniqueFd fd;
  std::string peer;
  FrameDecoder decoder;
  std::deque<OutChunk> output;
  std::size_t output_bytes = 0;
  bool authenticated = false;
  bool close_after_flush = false;
  bool want_write = false;
  std::set<std::uint64_t> owned_leases;
};

struct Entry {
  std::string value;
  std::uint64_t revision = 0;
  std::uint64_t lease = 0;
};

struct Lease {
  Millis ttl{};
  Clock::time_point deadline;
  Clock::time_point renewed;  // granted or last kept alive: what a lost member's watchers are told
  std::uint64_t owner = 0;    // connection id
  std::set<std::string> keys;
  std::string holder;                                          // node name, for Slurm confirmation
  std::optional<std::future<std::optional<bool>>> confirming;  // asking whether the node is down
  bool graced = false;                                         // one grace period already given
};

struct Parked {  // a Wait or Watch waiting for a change or its deadline
  std::uint64_t connection = 0;
  Request request;
  Clock::time_point deadline;
};

std::string peer_name(const sockaddr_in& a) {
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &a.sin_addr, buf, sizeof buf);
  return fmt::format("{}:{}", buf, ntohs(a.sin_port));
}

}  // namespace

struct StoreServer::Impl {
  StoreServerOptions options;
  Listener listener;
  UniqueFd epoll_fd;
  UniqueFd wake_fd;
  std::thread thread;
  std::atomic<bool> stopping{false};

  // Everything below is touched only by the server thread, except `stats_copy`.
  std::unordered_map<std::uint64_t, Connection> connections;
  std::uint64_t next_connection_id = 2;
  std::map<std::string, Entry, std::less<>> data;
  std::size_t data_bytes = 0;
  std::unordered_map<std::uint64_t, Lease> leases;
  std::uint64_t next_lease = 1;
  std::uint64_t revision = 0;
  std::deque<WatchEvent> history;
  std::uint64_t compacted_through = 0;  // events up to this revision were dropped
  std::vector<Parked> parked;
  Clock::time_point next_due{};  // no lease or parked request is due before this
  std::uint64_t refused_auth = 0;
  std::deque<std::pair<std::uint64_t, Clock::time_point>> hello_deadlines;  // (connection, deadline)
  std::uint64_t protocol_errors = 0;

  mutable std::mutex stats_mutex;
  Stats stats_copy;

  explicit Impl(StoreServerOptions opts) : options(std::move(opts)) {
    try {
      listener = listen_tcp(options.bind_address, options.port, options.fallback_ports);
    } catch (const std::system_error& e) {
      throw StoreError(e.code().value() == EADDRINUSE ? StoreErrorKind::AddressInUse : StoreErrorKind::BadRequest,
                       fmt::format("store cannot listen: {}", e.what()));
    }
    set_nonblocking(listener.fd.get());
    epoll_fd = UniqueFd(epoll_create1(EPOLL_CLOEXEC));
    wake_fd = UniqueFd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!epoll_fd || !wake_fd) throw StoreError(StoreErrorKind::BadRequest, "store: epoll/eventfd failed");
    add_to_epoll(listener.fd.get(), kListenerId, EPOLLIN);
    add_to_epoll(wake_fd.get(), kWakeId, EPOLLIN);
    thread = std::thread([this] { run(); });
  }

  ~Impl() {
    stopping = true;
    std::uint64_t one = 1;
    if (::write(wake_fd.get(), &one, sizeof one) < 0) { /* the loop also wakes every second */
    }
    if (thread.joinable()) thread.join();
  }

  void add_to_epoll(int fd, std::uint64_t id, std::uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = id;
    if (epoll_ctl(epoll_fd.get(), EPOLL_CTL_ADD, fd, &ev) < 0)
      throw std::system_error(errno, std::generic_category(), "epoll_ctl(ADD)");
  }

  // ---- event loop --------------------------------------------------------------------------

  void run() {
    std::vector<epoll_event> events(256);
    while (!stopping) {
      int n = epoll_wait(epoll_fd.get(), events.data(), static_cast<int>(events.size()), next_timeout_ms());
      if (n < 0 && errno != EINTR) {
        spdlog::error("[store] epoll_wait failed: {}; the store stops", std::strerror(errno));
        break;
      }
      for (int i = 0; i < n; ++i) {
        auto id = events[i].data.u64;
        if (id == kListenerId)
          accept_all();
        else if (id == kWakeId)
          continue;
        else
          handle_connection_event(id, events[i].events);
      }
      expire(Clock::now());
      expire_hellos(Clock::now());
      publish_stats();
    }
    connections.clear();  // closes every socket
  }

  int next_timeout_ms() const {
    auto ms = std::chrono::ceil<Millis>(next_due - Clock::now()).count();
    return static_cast<int>(std::clamp<long long>(ms, 0, 1000));
  }

  void accept_all() {
    while (true) {
      sockaddr_in addr{};
      socklen_t len = sizeof addr;
      int fd = accept4(listener.fd.get(), reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
          spdlog::warn("[store] accept failed: {}", std::strerror(errno));
        return;
      }
      UniqueFd owned(fd);
      if (connections.size() >= options.max_connections) {
        spdlog::warn("[store] refusing {}: {} connections already", peer_name(addr), connections.size());
        continue;
      }
      set_nodelay(fd);
      auto id = next_connection_id++;
      add_to_epoll(fd, id, EPOLLIN | EPOLLRDHUP);
      auto& c = connections[id];
      c.fd = std::move(owned);
      c.peer = peer_name(addr);
      hello_deadlines.emplace_back(id, Clock::now() + options.hello_timeout);
    }
  }

  void handle_connection_event(std::uint64_t id, std::uint32_t events) {
    auto it = connections.find(id);
    if (it == connections.end()) return;
    if (events & EPOLLOUT) flush(id);
    if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) read_from(id);
  }

  void read_from(std::uint64_t id) {
    char buf[64 * 1024];
    while (true) {
      auto it = connections.find(id);
      if (it == connections.end()) return;
      ssize_t n = ::recv(it->second.fd.get(), buf, sizeof buf, 0);
      if (n > 0) {
        it->second.decoder.feed(buf, static_cast<std::size_t>(n));
        if (!process_frames(id)) return;
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n < 0 && errno == EINTR) continue;
      close_connection(id, n == 0 ? "closed by peer" : std::strerror(errno));
      return;
    }
  }

  // Returns false if the connection was closed.
  bool process_frames(std::uint64_t id) {
    while (true) {
      auto it = connections.find(id);
      if (it == connections.end()) return false;
      auto& c = it->second;
      if (c.close_after_flush) return true;  // ignore anything after a refusal
      std::optional<Frame> frame;
      Request request;
      try {
        frame = c.decoder.next();
        if (!frame) return true;
        request = decode_request(*frame);
      } catch (const ProtocolError& e) {
        ++protocol_errors;
        spdlog::warn("[store] protocol error from {}: {}; closing that connection", c.peer, e.what());
        close_connection(id, "protocol error");
        return false;
      }
      handle(id, request);
    }
  }

  static FrameHeader response_header(const Request& req, Status status) {
    return {.op = req.op, .status = status, .flags = 0, .request_id = req.request_id, .body_length = 0};
  }

  void queue(std::uint64_t id, const Request& req, Status status, std::string_view body = {}) {
    send_frame(id, encode_frame(response_header(req, status), body));
  }

  // A response built with BodyWriter::for_frame(): a large body is never copied into a frame.
  void queue_framed(std::uint64_t id, const Request& req, Status status, BodyWriter&& body) {
    send_frame(id, std::move(body).finish_frame(response_header(req, status)));
  }

  void send_frame(std::uint64_t id, std::string frame) {
    send_chunks(id, {std::make_shared<const std::string>(std::move(frame))});
  }

  void send_chunks(std::uint64_t id, std::initializer_list<std::shared_ptr<const std::string>> chunks) {
    auto it = connections.find(id);
    if (it == connections.end()) return;
    auto& c = it->second;
    for (const auto& chunk : chunks) {
      c.output_bytes += chunk->size();
      c.output.push_back({chunk, 0});
    }
    if (c.output_bytes > options.max_pending_output) {
      spdlog::warn("[store] {} does not read its responses ({} bytes pending); closing", c.peer, c.output_bytes);
      close_connection(id, "not reading");
      return;
    }
    flush(id);
  }

  void flush(std::uint64_t id) {
    auto it = connections.find(id);
    if (it == connections.end()) return;
    auto& c = it->second;
    while (!c.output.empty()) {
      std::array<iovec, 16> iov{};
      std::size_t n_iov = 0;
      for (auto chunk = c.output.begin(); chunk != c.output.end() && n_iov < iov.size(); ++chunk, ++n_iov)
        iov[n_iov] = {const_cast<char*>(chunk->bytes->data() + chunk->offset), chunk->bytes->size() - chunk->offset};
      msghdr msg{};
      msg.msg_iov = iov.data();
      msg.msg_iovlen = n_iov;
      ssize_t n = ::sendmsg(c.fd.get(), &msg, MSG_NOSIGNAL);
      if (n > 0) {
        auto sent = static_cast<std::size_t>(n);
        c.output_bytes -= sent;
        while (sent > 0) {
          auto& front = c.output.front();
          const auto left = front.bytes->size() - front.offset;
          if (sent < left) {
            front.offset += sent;
            break;
          }
          sent -= left;
          c.output.pop_front();
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      close_connection(id, std::strerror(errno));
      return;
    }
    bool want = !c.output.empty();
    if (want != c.want_write) {
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLRDHUP | (want ? EPOLLOUT : 0u);
      ev.data.u64 = id;
      epoll_ctl(epoll_fd.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
      c.want_write = want;
    }
    if (c.output.empty() && c.close_after_flush) close_connection(id, "refused");
  }

  void close_connection(std::uint64_t id, std::string_view why) {
    auto it = connections.find(id);
    if (it == connections.end()) return;
    auto owned = std::move(it->second.owned_leases);
    spdlog::debug("[store] {} disconnected: {}", it->second.peer, why);
    epoll_ctl(epoll_fd.get(), EPOLL_CTL_DEL, it->second.fd.get(), nullptr);
    connections.erase(it);
    std::erase_if(parked, [id](const Parked& p) { return p.connection == id; });
    // A lease dies with the connection that holds it: process death is detected at once.
    for (auto lease : owned) revoke(lease, "holder disconnected");
  }

  // ---- requests ----------------------------------------------------------------------------

  void handle(std::uint64_t id, const Request& req) {
    auto& c = connections.at(id);
    if (req.op == Op::Hello) return hello(id, req);
    if (!c.authenticated) {
      ++refused_auth;
      spdlog::warn("[store] refused {}: {} before hello", c.peer, to_string(req.op));
      c.close_after_flush = true;
      return queue(id, req, Status::NotAuthenticated, BodyWriter().str("say hello first").bytes());
    }
    switch (req.op) {
      case Op::Set: return op_set(id, req);
      case Op::Get: return op_get(id, req);
      case Op::Add: return op_add(id, req);
      case Op::CompareAndSet: return op_cas(id, req);
      case Op::Delete: {
        bool existed = erase_key(req.key);
        return queue(id, req, existed ? Status::Ok : Status::NotFound, BodyWriter().u64(revision).bytes());
      }
      case Op::GetPrefix: return op_get_prefix(id, req);
      case Op::Wait: return op_wait(id, req);
      case Op::Watch: return op_watch(id, req);
      case Op::LeaseGrant: {
        auto lease_id = next_lease++;
        auto& lease = leases[lease_id];
        lease.ttl = Millis(req.timeout_ms);
        lease.renewed = Clock::now();
        lease.deadline = lease.renewed + lease.ttl;
        next_due = std::min(next_due, lease.deadline);
        lease.owner = id;
        lease.holder = req.value;
        c.owned_leases.insert(lease_id);
        return queue(id, req, Status::Ok, BodyWriter().u64(lease_id).bytes());
      }
      case Op::LeaseKeepAlive: {
        auto it = leases.find(req.lease);
        if (it == leases.end()) return queue(id, req, Status::NoSuchLease);
        it->second.renewed = Clock::now();
        it->second.deadline = it->second.renewed + it->second.ttl;
        it->second.graced = false;
        return queue(id, req, Status::Ok);
      }
      case Op::LeaseRevoke: revoke(req.lease, "revoked by its holder"); return queue(id, req, Status::Ok);
      case Op::Ping: {
        // the revision, then this host's wall clock (ms since the epoch): a client measures its
        // clock's offset from the store's host with it (the agent's health check)
        const auto wall_ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
                .count();
        return queue(id, req, Status::Ok, BodyWriter().u64(revision).i64(wall_ms).bytes());
      }
      case Op::Hello: break;
    }
  }

  // A refused client learns nothing but the kind of refusal: never this store's run id, auth
  // kind or why its credential failed (that goes to this side's log). "Another run" stays a
  // status of its own: agents probing fallback ports must tell a stale store of another job
  // from a wrong credential, which is final.
  void hello(std::uint64_t id, const Request& req) {
    auto& c = connections.at(id);
    if (c.authenticated) {
      c.close_after_flush = true;
      return queue(id, req, Status::BadRequest, BodyWriter().str("hello twice").bytes());
    }
    if (req.run_id != options.run_id) {
      ++refused_auth;
      spdlog::warn("[store] refused {}: it asked for run '{}', this store serves run '{}'", c.peer,
                   util::printable(req.run_id), options.run_id);
      c.close_after_flush = true;
      return queue(id, req, Status::WrongRun);
    }
    if (auto refusal = check_credential(options.auth, req.auth_kind, req.credential, req.run_id)) {
      ++refused_auth;
      spdlog::warn("[store] refused {}: {}", c.peer, util::printable(*refusal));
      c.close_after_flush = true;
      return queue(id, req, Status::AuthFailed);
    }
    c.authenticated = true;
    queue(id, req, Status::Ok, BodyWriter().u64(revision).bytes());
  }

  // Closes connections that did not authenticate within hello_timeout (in accept order, so
  // the deadlines are sorted).
  void expire_hellos(Clock::time_point now) {
    while (!hello_deadlines.empty() && hello_deadlines.front().second <= now) {
      auto id = hello_deadlines.front().first;
      hello_deadlines.pop_front();
      auto it = connections.find(id);
      if (it == connections.end() || it->second.authenticated) continue;
      ++refused_auth;
      spdlog::warn("[store] closed {}: no valid hello within {} ms", it->second.peer, options.hello_timeout.count());
      close_connection(id, "hello timeout");
    }
  }

  // Fencing: a write under a lease that is gone comes from a member already declared dead.
  bool lease_ok(std::uint64_t id, const Request& req) {
    if (req.lease == 0 || leases.contains(req.lease)) return true;
    queue(id, req, Status::NoSuchLease);
    return false;
  }

  bool room_for(std::uint64_t id, const Request& req, std::size_t new_bytes, std::size_t old_bytes) {
    if (data_bytes - old_bytes + new_bytes <= options.max_store_bytes) return true;
    queue(id, req, Status::StoreFull,
          BodyWriter().str(fmt::format("store holds {} bytes, limit {}", data_bytes, options.max_store_bytes)).bytes());
    return false;
  }

  void put(const std::string& key, std::string value, std::uint64_t lease) {
    auto& e = data[key];
    data_bytes -= e.value.size() + (e.revision ? key.size() : 0);
    if (e.lease && e.lease != lease) {
      if (auto it = leases.find(e.lease); it != leases.end()) it->second.keys.erase(key);
    }
    e.value = std::move(value);
    e.revision = ++revision;
    e.lease = lease;
    data_bytes += e.value.size() + key.size();
    if (lease) leases.at(lease).keys.insert(key);
    record(WatchEvent{WatchEvent::Type::Put, key, e.value, e.revision});
  }

  // `why`: the Delete event's value (empty for a plain delete; see revoke()).
  bool erase_key(const std::string& key, const std::string& why = {}) {
    auto it = data.find(key);
    if (it == data.end()) return false;
    if (it->second.lease) {
      if (auto l = leases.find(it->second.lease); l != leases.end()) l->second.keys.erase(key);
    }
    data_bytes -= it->second.value.size() + key.size();
    data.erase(it);
    record(WatchEvent{WatchEvent::Type::Delete, key, why, ++revision});
    return true;
  }

  void op_set(std::uint64_t id, const Request& req) {
    if (!lease_ok(id, req)) return;
    auto it = data.find(req.key);
    std::size_t old = it == data.end() ? 0 : it->second.value.size() + req.key.size();
    if (!room_for(id, req, req.key.size() + req.value.size(), old)) return;
    put(req.key, req.value, req.lease);
    queue(id, req, Status::Ok, BodyWriter().u64(revision).bytes());
  }

  void op_get(std::uint64_t id, const Request& req) {
    auto it = data.find(req.key);
    if (it == data.end()) return queue(id, req, Status::NotFound);
    queue(id, req, Status::Ok,
          BodyWriter().str(it->second.value).u64(it->second.revision).u64(it->second.lease).bytes());
  }

  void op_add(std::uint64_t id, const Request& req) {
    if (!lease_ok(id, req)) return;
    std::int64_t current = 0;
    auto it = data.find(req.key);
    if (it != data.end()) {
      auto parsed = util::parse_integer<std::int64_t>(it->second.value);
      if (!parsed) return queue(id, req, Status::NotANumber);
      current = *parsed;
    }
    auto next = std::to_string(current + req.delta);
    if (!room_for(id, req, req.key.size() + next.size(),
                  it == data.end() ? 0 : it->second.value.size() + req.key.size()))
      return;
    put(req.key, next, req.lease ? req.lease : (it == data.end() ? 0 : it->second.lease));
    queue(id, req, Status::Ok, BodyWriter().i64(current + req.delta).u64(revision).bytes());
  }

  void op_cas(std::uint64_t id, const Request& req) {
    if (!lease_ok(id, req)) return;
    auto it = data.find(req.key);
    bool exists = it != data.end();
    bool match = req.expect_absent ? !exists : (exists && it->second.value == req.expected);
    if (!match) {
      BodyWriter w;
      w.u8(exists ? 1 : 0).str(exists ? it->second.value : std::string()).u64(revision);
      return queue(id, req, Status::CasFailed, w.bytes());
    }
    if (!room_for(id, req, req.key.size() + req.value.size(), exists ? it->second.value.size() + req.key.size() : 0))
      return;
    put(req.key, req.value, req.lease);
    queue(id, req, Status::Ok, BodyWriter().u8(1).str(req.value).u64(revision).bytes());
  }

  void op_get_prefix(std::uint64_t id, const Request& req) {
    BodyWriter w;
    w.u64(revision);
    std::vector<const std::pair<const std::string, Entry>*> found;
    std::size_t bytes = 0;
    for (auto it = data.lower_bound(req.key); it != data.end() && it->first.starts_with(req.key); ++it) {
      found.push_back(&*it);
      bytes += it->first.size() + it->second.value.size() + 32;
    }
    if (bytes > kMaxResponseBytes - 64) return queue(id, req, Status::TooLarge);
    w.u32(static_cast<std::uint32_t>(found.size()));
    for (const auto* kv : found) w.str(kv->first).str(kv->second.value).u64(kv->second.revision).u64(kv->second.lease);
    queue(id, req, Status::Ok, w.bytes());
  }

  void op_wait(std::uint64_t id, const Request& req) {
    if (all_exist(req.keys)) return queue(id, req, Status::Ok);
    park(id, req);
  }

  bool all_exist(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (!data.contains(k)) return false;
    return true;
  }

  void op_watch(std::uint64_t id, const Request& req) {
    if (req.revision < compacted_through) {
      return queue(id, req, Status::Compacted, BodyWriter().u64(revision).u32(0).bytes());
    }
    if (!answer_watch(id, req)) park(id, req);
  }

  // Sends the events after req.revision under req.key; false if there are none yet.
  // A watch answer's body, keyed by what the watcher asked (prefix, revision): watchers that
  // asked the same get the same bytes.
  using WatchBodies = std::map<std::pair<std::string, std::uint64_t>, std::shared_ptr<const std::string>>;

  bool answer_watch(std::uint64_t id, const Request& req, WatchBodies* shared = nullptr) {
    std::shared_ptr<const std::string> body;
    if (shared)
      if (auto it = shared->find({req.key, req.revision}); it != shared->end()) body = it->second;
    if (!body) {
      std::vector<const WatchEvent*> matching;
      // History is ordered by revision: skip what the watcher has already seen.
      auto first = std::lower_bound(history.begin(), history.end(), req.revision + 1,
                                    [](const WatchEvent& e, std::uint64_t r) { return e.revision < r; });
      std::size_t bytes = 0;
      for (auto it = first; it != history.end(); ++it)
        if (it->key.starts_with(req.key)) {
          matching.push_back(&*it);
          bytes += it->key.size() + it->value.size() + 32;
          if (bytes > kMaxResponseBytes / 2) break;  // the watcher asks again from the last revision
        }
      if (matching.empty()) return false;
      BodyWriter w;
      w.u64(matching.back()->revision).u32(static_cast<std::uint32_t>(matching.size()));
      for (const auto* e : matching)
        w.u8(static_cast<std::uint8_t>(e->type)).str(e->key).str(e->value).u64(e->revision);
      body = std::make_shared<const std::string>(w.take());
      if (shared) shared->emplace(std::make_pair(req.key, req.revision), body);
    }
    auto header = std::make_shared<const std::string>(encode_header(response_header(req, Status::Ok), body->size()));
    send_chunks(id, {std::move(header), std::move(body)});
    return true;
  }

  void record(WatchEvent event) {
    history.push_back(std::move(event));
    if (history.size() > options.watch_history) {
      compacted_through = history.front().revision;
      history.pop_front();
    }
    wake_parked();
  }

  void wake_parked() {
    // Answer parked requests that are now satisfied; answering may close connections, which
    // edits `parked`, so collect first.
    std::vector<Parked> ready;
    std::erase_if(parked, [&](const Parked& p) {
      bool done = false;
      if (p.request.op == Op::Wait)
        done = all_exist(p.request.keys);
      else {
        const auto& last = history.back();
        done = last.revision > p.request.revision && last.key.starts_with(p.request.key);
      }
      if (done) ready.push_back(p);
      return done;
    });
    WatchBodies bodies;
    for (const auto& p : ready) {
      if (p.request.op == Op::Wait)
        queue(p.connection, p.request, Status::Ok);
      else
        answer_watch(p.connection, p.request, &bodies);
    }
  }

  void revoke(std::uint64_t lease_id, std::string_view why) {
    auto it = leases.find(lease_id);
    if (it == leases.end()) return;
    auto keys = std::move(it->second.keys);
    if (auto c = connections.find(it->second.owner); c != connections.end()) c->second.owned_leases.erase(lease_id);
    // Watchers of the deleted keys learn how the lease ended and how long after its last
    // keep-alive (docs/rendezvous.md, "Leases"): a member's loss is reported with both.
    const auto since = std::chrono::duration_cast<Millis>(Clock::now() - it->second.renewed).count();
    const std::string event = nlohmann::json{{"lease_end", why}, {"since_renewal_ms", since}}.dump();
    leases.erase(it);
    spdlog::debug("[store] lease {} ended ({}), deleting {} keys", lease_id, why, keys.size());
    for (const auto& k : keys) erase_key(k, event);
  }

  void park(std::uint64_t id, const Request& req) {
    parked.push_back({id, req, Clock::now() + Millis(req.timeout_ms)});
    next_due = std::min(next_due, parked.back().deadline);
  }

  // Scans leases and parked requests only when the earliest deadline may have passed: with
  // 1024 members a scan per epoll wake-up made the event loop O(N) per request.
  void expire(Clock::time_point now) {
    if (now < next_due) return;
    next_due = now + Millis(1000);
    for (const auto& [id, lease] : leases) {
      if (!lease.confirming)
        next_due = std::min(next_due, lease.deadline);
      else if (lease.confirming->wait_for(Millis(0)) == std::future_status::ready)
        next_due = now;
      else
        next_due = std::min(next_due, now + Millis(20));  // look again for Slurm's answer
    }
    for (const auto& p : parked) next_due = std::min(next_due, p.deadline);
    if (now < next_due) return;  // keep-alives moved every deadline later
    std::vector<std::uint64_t> dead;
    for (auto& [id, lease] : leases) {
      if (lease.confirming) {
        if (lease.confirming->wait_for(Millis(0)) != std::future_status::ready) continue;
        auto down = lease.confirming->get();
        lease.confirming.reset();
        if (down == std::optional<bool>(false) && lease.deadline <= now) {
          spdlog::warn(
              "[store] {} missed its keep-alives but Slurm reports the node up: one more "
              "heartbeat timeout of grace",
              lease.holder);
          lease.graced = true;
          lease.deadline = now + lease.ttl;
          continue;
        }
      } else if (lease.deadline <= now && options.holder_is_down && !lease.holder.empty() && !lease.graced) {
        lease.confirming = std::async(std::launch::async, options.holder_is_down, lease.holder);
        continue;
      }
      if (lease.deadline <= now) dead.push_back(id);
    }
    for (auto id : dead) revoke(id, "missed its keep-alives");
    std::vector<Parked> timed_out;
    std::erase_if(parked, [&](const Parked& p) {
      if (p.deadline > now) return false;
      timed_out.push_back(p);
      return true;
    });
    for (const auto& p : timed_out)
      queue(p.connection, p.request, Status::Timeout,
            p.request.op == Op::Watch ? BodyWriter().u64(revision).u32(0).bytes() : std::string());
    next_due = now;  // deadlines changed above (grace, confirmations): recompute on the next pass
  }

  void publish_stats() {
    std::lock_guard lock(stats_mutex);
    stats_copy = {connections.size(), data.size(), data_bytes, leases.size(), revision, refused_auth, protocol_errors};
  }
};

StoreServer::StoreServer(StoreServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
StoreServer::~StoreServer() = default;
std::uint16_t StoreServer::port() const { return impl_->listener.port; }
StoreServer::Stats StoreServer::stats() const {
  std::lock_guard lock(impl_->stats_mutex);
  return impl_->stats_copy;
}

}  // namespace elastrun::rdzv
