#include "memory_peers.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>
#include <stdexcept>
#include <system_error>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "elastrun/rdzv/net.hpp"

namespace elastrun::launcher {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;
using Held = MemorySegments::Held;
using Origin = MemorySegments::Origin;

constexpr int kPeerProtocolVersion = 1;
constexpr std::size_t kMaxLine = 1 << 20;                   // a list of a few thousand segments fits
constexpr std::size_t kMaxOpenConnections = 32;             // more are closed at once: the sender tries again later
constexpr auto kServerPatience = std::chrono::seconds(10);  // a silent peer's connection is dropped

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

void set_timeouts(int fd, Millis timeout) {
  timeval tv{static_cast<time_t>(timeout.count() / 1000), static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  (void)::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  (void)::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

void send_all(int fd, const char* data, std::size_t size) {
  while (size > 0) {
    const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(fmt::format("sending: {}", n < 0 ? std::strerror(errno) : "connection closed"));
    data += n;
    size -= static_cast<std::size_t>(n);
  }
}

void send_line(int fd, const nlohmann::json& j) {
  const auto text = j.dump() + "\n";
  send_all(fd, text.data(), text.size());
}

// One line, read a byte at a time: what follows it (a segment's bytes) stays in the socket.
nlohmann::json receive_line(int fd) {
  std::string line;
  char c = 0;
  while (true) {
    const ssize_t n = ::recv(fd, &c, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(n < 0 ? fmt::format("receiving: {}", std::strerror(errno)) : "connection closed");
    if (c == '\n') break;
    if (line.size() >= kMaxLine) fail("an over-long line");
    line.push_back(c);
  }
  auto j = nlohmann::json::parse(line, nullptr, false);
  if (!j.is_object()) fail("not a JSON object");
  return j;
}

void send_segment(int socket, int fd, std::uint64_t bytes) {
  off_t offset = 0;
  while (static_cast<std::uint64_t>(offset) < bytes) {
    const ssize_t n =
        ::sendfile(socket, fd, &offset, static_cast<std::size_t>(bytes - static_cast<std::uint64_t>(offset)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(fmt::format("sending a segment: {}", n < 0 ? std::strerror(errno) : "it ended early"));
  }
}

// Through a bounce buffer and pwrite, not into a mapping of the segment: a new mapping costs a
// fault per page at its first write (~6 us on this project's VMs: 0.1 s per 64 MiB), the extra
// copy through a cache-sized buffer far less.
void receive_segment(int socket, int fd, std::uint64_t bytes) {
  constexpr std::size_t kChunk = 1 << 20;
  std::vector<char> buffer(static_cast<std::size_t>(std::min<std::uint64_t>(bytes, kChunk)));
  std::uint64_t got = 0;
  while (got < bytes) {
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(bytes - got, buffer.size()));
    const ssize_t n = ::recv(socket, buffer.data(), want, MSG_WAITALL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      fail(fmt::format("receiving a segment ({} of {} bytes): {}", got, bytes,
                       n < 0 ? std::strerror(errno) : "connection closed"));
    std::size_t written = 0;
    while (written < static_cast<std::size_t>(n)) {
      const ssize_t w = ::pwrite(fd, buffer.data() + written, static_cast<std::size_t>(n) - written,
                                 static_cast<off_t>(got + written));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail(fmt::format("writing a segment: {}", w < 0 ? std::strerror(errno) : "no progress"));
      written += static_cast<std::size_t>(w);
    }
    got += static_cast<std::uint64_t>(n);
  }
}

Origin origin_of(std::string_view text) {
  if (text == "replica") return Origin::Replica;
  if (text == "fetched") return Origin::Fetched;
  return Origin::Own;
}

nlohmann::json to_json(const std::vector<Held>& held) {
  auto out = nlohmann::json::array();
  for (const auto& h : held)
    out.push_back({{"step", h.step},
                   {"rank", h.rank},
                   {"world", h.world},
                   {"generation", h.generation},
                   {"origin", MemorySegments::to_string(h.origin)}});
  return out;
}

// host:port -> (host, port); throws on anything else
std::pair<std::string, std::uint16_t> split_address(const std::string& address) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) fail(fmt::format("'{}' is not host:port", address));
  const auto port = std::stoul(address.substr(colon + 1));
  if (port == 0 || port > 65535) fail(fmt::format("'{}' has no valid port", address));
  return {address.substr(0, colon), static_cast<std::uint16_t>(port)};
}

// Connects and sends the request line with the run's credential.
util::UniqueFd open_request(const std::string& address, const PeerCredentials& credentials, nlohmann::json request,
                            Millis timeout) {
  const auto [host, port] = split_address(address);
  auto fd = rdzv::connect_tcp(host, port, std::min(timeout, Millis(2000)));
  set_timeouts(fd.get(), timeout);
  request["v"] = kPeerProtocolVersion;
  request["run"] = credentials.run_id;
  request["auth"] = std::string(rdzv::to_string(credentials.auth.kind));
  request["credential"] = rdzv::make_credential(credentials.auth, credentials.run_id);
  send_line(fd.get(), request);
  return fd;
}

nlohmann::json expect_ok(int fd) {
  auto reply = receive_line(fd);
  if (!reply.value("ok", false)) fail(reply.value("error", std::string("refused without a reason")));
  return reply;
}

template <class Body>
auto with_peer(const std::string& address, std::string_view what, Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("memory peer {}: {}: {}", address, what, e.what()));
  }
}

}  // namespace

std::optional<FetchPlan> plan_fetches(const std::vector<Held>& mine, const std::vector<std::vector<Held>>& peers,
                                      const std::vector<int>& local_ranks, int new_world) {
  // a step's snapshots count together only when one round wrote them (one history)
  struct StepView {
    int world = 0;
    std::set<int> ranks;
  };
  std::map<std::pair<std::uint64_t, std::uint64_t>, StepView> steps;  // (step, generation)
  const auto add = [&](const Held& h) {
    auto& view = steps[{h.step, h.generation}];
    view.world = std::max(view.world, h.world);
    view.ranks.insert(h.rank);
  };
  for (const auto& h : mine) add(h);
  for (const auto& peer : peers)
    for (const auto& h : peer) add(h);
  // newest step first; of one step, the newest round's
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const auto& [key, view] = *it;
    const auto [step, generation] = key;
    if (view.world <= 0) continue;  // written by a worker that did not say its world
    // the ranks the new world restores from: all of the old world's, or its first new_world
    bool usable = true;
    for (int r = 0; r < std::min(view.world, std::max(new_world, 1)) && usable; ++r) usable = view.ranks.contains(r);
    if (!usable) continue;
    FetchPlan plan{.step = step, .generation = generation, .world = view.world, .adopt = {}, .fetch = {}, .stale = {}};
    const auto same = [&](const Held& h, int rank) {
      return h.step == step && h.rank == rank && h.generation == generation;
    };
    std::set<int> targets;
    for (int r : local_ranks) targets.insert(r < view.world ? r : r % view.world);
    for (int target : targets) {
      const auto here = std::find_if(mine.begin(), mine.end(), [&](const Held& h) { return same(h, target); });
      if (here != mine.end()) {
        if (here->origin == Origin::Replica) plan.adopt.push_back(target);
        continue;
      }
      if (std::any_of(mine.begin(), mine.end(), [&](const Held& h) { return h.step == step && h.rank == target; }))
        plan.stale.push_back(target);  // this step of another round: replaced by the fetch
      std::vector<std::size_t> holders, replicas;
      for (std::size_t i = 0; i < peers.size(); ++i)
        for (const auto& h : peers[i])
          if (same(h, target)) (h.origin == Origin::Replica ? replicas : holders).push_back(i);
      holders.insert(holders.end(), replicas.begin(), replicas.end());  // a writer's own copy first
      plan.fetch.emplace_back(target, std::move(holders));
    }
    return plan;
  }
  return std::nullopt;
}

std::vector<Held> peer_list(const std::string& address, const PeerCredentials& credentials, Millis timeout) {
  return with_peer(address, "list", [&] {
    auto fd = open_request(address, credentials, {{"op", "list"}}, timeout);
    const auto reply = expect_ok(fd.get());
    std::vector<Held> out;
    for (const auto& s : reply.at("segments"))
      out.push_back({s.at("step").get<std::uint64_t>(), s.at("rank").get<int>(), s.value("world", 0),
                     origin_of(s.value("origin", std::string("own"))), s.value("generation", std::uint64_t{0})});
    return out;
  });
}

bool peer_push(const std::string& address, const PeerCredentials& credentials, const MemorySegments::Pinned& segment,
               Millis timeout) {
  return with_peer(address, fmt::format("sending step {} rank {}", segment.step, segment.rank), [&] {
    auto fd = open_request(address, credentials,
                           {{"op", "put"},
                            {"step", segment.step},
                            {"rank", segment.rank},
                            {"world", segment.world},
                            {"generation", segment.generation},
                            {"bytes", segment.bytes},
                            {"checksum", segment.checksum}},
                           timeout);
    if (!expect_ok(fd.get()).value("send", false)) return false;
    send_segment(fd.get(), segment.fd.get(), segment.bytes);
    expect_ok(fd.get());
    return true;
  });
}

bool peer_fetch(const std::string& address, const PeerCredentials& credentials, std::uint64_t step, int rank,
                MemorySegments& into, Origin origin, Millis timeout, std::optional<std::uint64_t> generation) {
  return with_peer(address, fmt::format("fetching step {} rank {}", step, rank), [&] {
    auto fd = open_request(address, credentials, {{"op", "get"}, {"step", step}, {"rank", rank}}, timeout);
    const auto reply = expect_ok(fd.get());
    if (generation && reply.value("generation", std::uint64_t{0}) != *generation)
      fail(fmt::format("its copy was written in round {}, not {}", reply.value("generation", std::uint64_t{0}),
                       *generation));
    const auto bytes = reply.at("bytes").get<std::uint64_t>();
    auto segment = into.allocate_copy(step, rank, bytes);
    if (!segment) return false;
    try {
      receive_segment(fd.get(), segment->get(), bytes);
      into.commit_copy(step, rank, reply.at("checksum").get<std::uint64_t>(), reply.value("world", 0),
                       reply.value("generation", std::uint64_t{0}), origin);
    } catch (...) {
      into.discard(step, rank);
      throw;
    }
    return true;
  });
}

// ---- the server ----

MemoryPeers::MemoryPeers(MemorySegments& segments, PeerCredentials credentials, const std::string& bind_address)
    : segments_(segments), credentials_(std::move(credentials)) {
  auto listener = rdzv::listen_tcp(bind_address, 0, {}, 64);
  listener_ = std::move(listener.fd);
  address_ = fmt::format("{}:{}", bind_address, listener.port);
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) throw std::system_error(errno, std::generic_category(), "pipe2");
  wake_read_.reset(pipe_fds[0]);
  wake_write_.reset(pipe_fds[1]);
  if (const char* flip = std::getenv("ELASTRUN_TEST_FLIP_MEMORY_STEP"); flip && *flip) flip_step_ = std::stoull(flip);
  server_ = std::thread([this] { serve(); });
  worker_ = std::thread([this] { work(); });
}

MemoryPeers::~MemoryPeers() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  (void)!::write(wake_write_.get(), "x", 1);
  if (server_.joinable()) server_.join();
  {
    std::lock_guard lock(handlers_mutex_);
    for (auto& h : handlers_) (void)::shutdown(h.socket.get(), SHUT_RDWR);  // ends its transfer now
  }
  for (auto& h : handlers_) h.thread.join();
  if (worker_.joinable()) worker_.join();  // a transfer of its own ends at its socket's timeout
}

void MemoryPeers::serve() {
  while (true) {
    pollfd fds[2] = {{wake_read_.get(), POLLIN, 0}, {listener_.get(), POLLIN, 0}};
    const int ready = ::poll(fds, 2, -1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0 || fds[0].revents != 0) return;
    util::UniqueFd connection(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!connection) continue;
    std::lock_guard lock(handlers_mutex_);
    std::erase_if(handlers_, [](Handler& h) {
      if (!h.done->load()) return false;
      h.thread.join();
      return true;
    });
    if (handlers_.size() >= kMaxOpenConnections) continue;  // closed: the peer tries again later
    auto done = std::make_shared<std::atomic<bool>>(false);
    const int fd = connection.get();
    handlers_.push_back(Handler{std::thread([this, fd, done] {
                                  serve_one(fd);
                                  (void)::shutdown(fd, SHUT_RDWR);  // the peer sees the end now; closed when reaped
                                  done->store(true);
                                }),
                                std::move(connection), done});
  }
}

// `fd` is the handler's (closed when it is reaped)
void MemoryPeers::serve_one(int fd) {
  set_timeouts(fd, std::chrono::duration_cast<Millis>(kServerPatience));
  try {
    const auto request = receive_line(fd);
    if (request.value("v", 0) != kPeerProtocolVersion) {
      send_line(
          fd,
          {{"ok", false},
           {"error", fmt::format("peer protocol v{} (this agent: v{})", request.value("v", 0), kPeerProtocolVersion)}});
      return;
    }
    if (auto refusal =
            rdzv::check_credential(credentials_.auth, request.value("auth", std::string()),
                                   request.value("credential", std::string()), request.value("run", std::string()))) {
      spdlog::warn("memory peer: refused a request: {}", *refusal);
      send_line(fd, {{"ok", false}, {"error", *refusal}});
      return;
    }
    const auto op = request.value("op", std::string());
    if (op == "list") {
      send_line(fd, {{"ok", true}, {"segments", to_json(segments_.held())}});
    } else if (op == "get") {
      auto pinned = segments_.pin(request.at("step").get<std::uint64_t>(), request.at("rank").get<int>());
      if (!pinned) {
        send_line(fd, {{"ok", false}, {"error", "not held here"}});
        return;
      }
      send_line(fd, {{"ok", true},
                     {"bytes", pinned->bytes},
                     {"checksum", pinned->checksum},
                     {"world", pinned->world},
                     {"generation", pinned->generation}});
      send_segment(fd, pinned->fd.get(), pinned->bytes);
    } else if (op == "put") {
      const auto step = request.at("step").get<std::uint64_t>();
      const int rank = request.at("rank").get<int>();
      const auto bytes = request.at("bytes").get<std::uint64_t>();
      std::optional<util::UniqueFd> segment;
      try {
        segment = segments_.allocate_copy(step, rank, bytes);
      } catch (const std::exception& e) {
        send_line(fd, {{"ok", false}, {"error", e.what()}});
        return;
      }
      send_line(fd, {{"ok", true}, {"send", segment.has_value()}});
      if (!segment) return;
      try {
        receive_segment(fd, segment->get(), bytes);
        segments_.commit_copy(step, rank, request.at("checksum").get<std::uint64_t>(), request.value("world", 0),
                              request.value("generation", std::uint64_t{0}), Origin::Replica);
      } catch (...) {
        segments_.discard(step, rank);
        throw;
      }
      {
        std::lock_guard lock(mutex_);
        ++counts_.received;
      }
      send_line(fd, {{"ok", true}});
    } else {
      send_line(fd, {{"ok", false}, {"error", fmt::format("unknown op '{}'", op)}});
    }
  } catch (const std::exception& e) {
    spdlog::debug("memory peer: a request ended: {}", e.what());
  }
}

// ---- the sender and fetcher ----

void MemoryPeers::new_round(Round round) {
  {
    std::lock_guard lock(mutex_);
    partner_ = round.peers.empty() ? std::string() : round.peers.front();
    peers_ = round.peers;
    generation_ = round.generation;
    to_push_.clear();  // a world change abandons the copies in flight
    fetching_ = true;
    round_to_fetch_ = std::move(round);
  }
  changed_.notify_all();
}

void MemoryPeers::committed(std::uint64_t step, int rank) {
  {
    std::lock_guard lock(mutex_);
    if (partner_.empty()) return;
    auto& queued = to_push_[rank];
    queued = std::max(queued, step);
  }
  changed_.notify_all();
}

void MemoryPeers::wait_for_fetch(Millis timeout) {
  std::unique_lock lock(mutex_);
  changed_.wait_for(lock, timeout, [&] { return !fetching_ || stopping_; });
}

void MemoryPeers::refetch(std::uint64_t step, int rank) {
  std::vector<std::string> peers;
  {
    std::lock_guard lock(mutex_);
    peers = peers_;
  }
  std::optional<std::uint64_t> generation;
  for (const auto& h : segments_.held())
    if (h.step == step && h.rank == rank) generation = h.generation;
  if (!generation) fail(fmt::format("this agent holds no snapshot of step {} rank {}", step, rank));
  std::string why = "no other member in this round";
  for (const auto& peer : peers) {
    if (peer.empty()) continue;
    try {
      if (!peer_list_has(peer, step, rank, *generation)) {
        why = fmt::format("memory peer {} holds no copy of it", peer);
        continue;
      }
      segments_.drop(step, rank);
      peer_fetch(peer, credentials_, step, rank, segments_, Origin::Fetched, std::chrono::seconds(30), generation);
      spdlog::warn("memory checkpoints: step {} rank {} held here failed its checksum: fetched again from {}", step,
                   rank, peer);
      std::lock_guard lock(mutex_);
      ++counts_.fetched;
      return;
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  fail(fmt::format("no peer copy of step {} rank {} could be fetched ({})", step, rank, why));
}

bool MemoryPeers::peer_list_has(const std::string& peer, std::uint64_t step, int rank, std::uint64_t generation) {
  const auto held = peer_list(peer, credentials_, Millis(2000));
  return std::any_of(held.begin(), held.end(),
                     [&](const Held& h) { return h.step == step && h.rank == rank && h.generation == generation; });
}

MemoryPeers::Counts MemoryPeers::counts() const {
  std::lock_guard lock(mutex_);
  return counts_;
}

void MemoryPeers::work() {
  std::unique_lock lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return stopping_ || round_to_fetch_ || !to_push_.empty(); });
    if (stopping_) return;
    if (round_to_fetch_) {
      const Round round = std::move(*round_to_fetch_);
      round_to_fetch_.reset();
      lock.unlock();
      try {
        fetch_for(round);
      } catch (const std::exception& e) {
        spdlog::warn("memory checkpoints: fetching this node's snapshots from its peers failed: {}", e.what());
      }
      lock.lock();
      if (!round_to_fetch_) fetching_ = false;  // a newer round fetches again
      changed_.notify_all();
      continue;
    }
    lock.unlock();
    push_pending();
    lock.lock();
  }
}

void MemoryPeers::push_pending() {
  std::string partner;
  std::uint64_t generation = 0;
  std::pair<int, std::uint64_t> next;
  {
    std::lock_guard lock(mutex_);
    if (to_push_.empty()) return;
    next = *to_push_.begin();
    to_push_.erase(to_push_.begin());
    partner = partner_;
    generation = generation_;
  }
  auto pinned = segments_.pin(next.second, next.first);
  if (!pinned || partner.empty()) return;  // dropped meanwhile (a newer one follows)
  std::string error;
  bool sent = false;
  try {
    sent = peer_push(partner, credentials_, *pinned, std::chrono::seconds(10));
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::lock_guard lock(mutex_);
  if (!error.empty()) {
    ++counts_.push_failures;
    if (failing_partner_ != partner || generation != generation_)
      spdlog::warn("memory checkpoints: the partner copy failed (the next step is sent anyway): {}", error);
    failing_partner_ = partner;
  } else {
    if (sent) ++counts_.pushed;
    if (flip_step_ && *flip_step_ == pinned->step) {  // tests only: see flip_step_
      unsigned char byte = 0;
      const auto last = static_cast<off_t>(pinned->bytes > 0 ? pinned->bytes - 1 : 0);
      if (::pread(pinned->fd.get(), &byte, 1, last) == 1) {  // the data's, not a header's
        byte ^= 0xff;
        (void)!::pwrite(pinned->fd.get(), &byte, 1, last);
        spdlog::warn(
            "ELASTRUN_TEST_FLIP_MEMORY_STEP={}: flipped a byte of step {} rank {} here (its partner's "
            "copy is intact)",
            *flip_step_, pinned->step, pinned->rank);
      }
    }
    if (failing_partner_ == partner) {
      spdlog::info("memory checkpoints: partner copies to {} work again", partner);
      failing_partner_.clear();
    }
  }
}

// Every member is asked what it holds (one small request each; at hundreds of nodes this belongs
// in the store), so that every agent takes the same view of the newest complete step and drops what
// is newer: an incomplete step, or another history's (a node that was cut off and came back).
void MemoryPeers::fetch_for(const Round& round) {
  const auto t0 = Clock::now();
  const auto mine = segments_.held();
  std::vector<std::vector<Held>> peers(round.peers.size());
  for (std::size_t i = 0; i < round.peers.size(); ++i) {
    if (round.peers[i].empty()) continue;
    try {
      peers[i] = peer_list(round.peers[i], credentials_, Millis(2000));
    } catch (const std::exception& e) {
      spdlog::debug("memory checkpoints: {}", e.what());
    }
  }
  const auto plan = plan_fetches(mine, peers, round.local_ranks, round.world_size);
  if (!plan) return;
  // newer snapshots are of no use: the job restores from plan->step (or a newer file step), and
  // this node's own newer ones would make its workers vote for a step the others cannot restore
  if (const auto dropped = segments_.forget_after(plan->step))
    spdlog::info("memory checkpoints: dropped {} segment(s) of steps after {}, the newest step complete job-wide",
                 dropped, plan->step);
  for (int rank : plan->stale)
    if (segments_.drop(plan->step, rank))
      spdlog::warn(
          "memory checkpoints: step {} rank {} held here was written in another round than the job's "
          "(another history): dropped, fetched again",
          plan->step, rank);
  if (plan->adopt.empty() && plan->fetch.empty()) return;
  std::vector<std::string> done;
  for (int rank : plan->adopt)
    if (segments_.adopt(plan->step, rank)) {
      done.push_back(fmt::format("rank {} (held here for its partner)", rank));
      std::lock_guard lock(mutex_);
      ++counts_.adopted;
    }
  for (const auto& [rank, holders] : plan->fetch) {
    std::string why = "no live member holds it";
    for (auto i : holders) {
      try {
        peer_fetch(round.peers[i], credentials_, plan->step, rank, segments_, Origin::Fetched,
                   std::chrono::seconds(30));
        done.push_back(fmt::format("rank {} from {}", rank, round.peers[i]));
        std::lock_guard lock(mutex_);
        ++counts_.fetched;
        why.clear();
        break;
      } catch (const std::exception& e) {
        why = e.what();
      }
    }
    if (!why.empty())
      spdlog::warn(
          "memory checkpoints: no copy of step {} rank {} could be fetched ({}): this node's workers may "
          "restore from the file tier",
          plan->step, rank, why);
  }
  if (!done.empty())
    spdlog::info("memory checkpoints: step {} (world {}) for this node's ranks: {} ({} ms)", plan->step, plan->world,
                 fmt::join(done, ", "), std::chrono::duration_cast<Millis>(Clock::now() - t0).count());
}

}  // namespace elastrun::launcher
