#include "node_endpoint.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "elastrun/worker/contract.hpp"
#include "elastrun/worker/node.hpp"

namespace elastrun::launcher {

using worker::node_json_line;
using worker::node_socket_address;
using worker::send_node_line;

std::string default_node_address(int pid, const std::string& node) {
  return fmt::format("@elastrun-node-{}-{}", pid, node);
}

NodeEndpoint::NodeEndpoint(std::string address, Handler handler)
    : address_(std::move(address)), handler_(std::move(handler)) {
  const auto [sa, length] = node_socket_address(address_);
  listener_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!listener_) throw std::system_error(errno, std::generic_category(), "node endpoint socket");
  if (!address_.starts_with('@')) ::unlink(address_.c_str());  // a socket file left by a killed agent
  if (::bind(listener_.get(), reinterpret_cast<const sockaddr*>(&sa), length) != 0 ||
      ::listen(listener_.get(), 16) != 0)
    throw std::system_error(errno, std::generic_category(), "node endpoint " + address_);
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0)
    throw std::system_error(errno, std::generic_category(), "node endpoint pipe");
  wake_read_.reset(pipe_fds[0]);
  wake_write_.reset(pipe_fds[1]);
  thread_ = std::jthread([this] { serve(); });
}

NodeEndpoint::~NodeEndpoint() {
  if (wake_write_) (void)!::write(wake_write_.get(), "x", 1);
  if (thread_.joinable()) thread_.join();
  if (!address_.starts_with('@')) ::unlink(address_.c_str());
}

namespace {

using Clock = std::chrono::steady_clock;

// Every open connection is read as its bytes come (one poll over the listener and all of them),
// so a client that connects and says nothing delays no other: it is dropped after
// kRequestPatience. Requests are still answered one at a time, on this thread, in arrival order.
constexpr auto kRequestPatience = std::chrono::seconds(2);
constexpr std::size_t kMaxOpenConnections = 64;  // more wait in the listen backlog
// A reply is small, but a client that never reads must not block the endpoint.
constexpr timeval kReplyPatience{2, 0};

struct OpenConnection {
  util::UniqueFd socket;
  std::string received;
  Clock::time_point deadline;
};

void reply_on(int connection, nlohmann::json j, int fd = -1) {
  j["v"] = contract::kNodeProtocolVersion;
  // blocking, with a send timeout: the reply (and its descriptor) goes out whole or not at all
  const int flags = ::fcntl(connection, F_GETFL);
  if (flags >= 0) (void)::fcntl(connection, F_SETFL, flags & ~O_NONBLOCK);
  (void)::setsockopt(connection, SOL_SOCKET, SO_SNDTIMEO, &kReplyPatience, sizeof kReplyPatience);
  (void)send_node_line(connection, node_json_line(j), fd);
}

bool peer_is_our_user(int connection) {
  ucred peer{};
  socklen_t size = sizeof peer;
  return ::getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &peer, &size) == 0 &&
         (peer.uid == ::getuid() || peer.uid == 0);
}

// Reads what `c` has; true when it is done with (answered, closed, or over-long).
template <class Answer>
bool read_request(OpenConnection& c, Answer&& answer) {
  char buf[4096];
  while (true) {
    // a descriptor sent with a request is dropped by the kernel (no control buffer): requests carry none
    const ssize_t n = ::recv(c.socket.get(), buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK;
    if (n == 0) return true;  // closed before a whole line
    c.received.append(buf, static_cast<std::size_t>(n));
    if (const auto nl = c.received.find('\n'); nl != std::string::npos) {
      c.received.resize(nl);
      answer(c.socket.get(), c.received);
      return true;
    }
    if (c.received.size() > worker::kNodeMaxLine) return true;
  }
}

}  // namespace

void NodeEndpoint::serve() {
  std::vector<OpenConnection> open;
  std::vector<pollfd> fds;
  while (true) {
    fds.clear();
    fds.push_back({wake_read_.get(), POLLIN, 0});
    fds.push_back({listener_.get(), static_cast<short>(open.size() < kMaxOpenConnections ? POLLIN : 0), 0});
    auto earliest = Clock::time_point::max();
    for (const auto& c : open) {
      fds.push_back({c.socket.get(), POLLIN, 0});
      earliest = std::min(earliest, c.deadline);
    }
    const int timeout_ms = open.empty()
                               ? -1
                               : static_cast<int>(std::max<std::int64_t>(
                                     0, std::chrono::ceil<std::chrono::milliseconds>(earliest - Clock::now()).count()));
    const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0 || fds[0].revents != 0) return;  // stopping
    const auto after = Clock::now();
    std::vector<OpenConnection> still_open;
    for (std::size_t i = 0; i < open.size(); ++i) {
      const bool done = fds[i + 2].revents != 0
                            ? read_request(open[i], [this](int fd, const std::string& line) { answer(fd, line); })
                            : after >= open[i].deadline;  // said nothing in time: dropped
      if (!done) still_open.push_back(std::move(open[i]));
    }
    open = std::move(still_open);
    while (fds[1].revents != 0 && open.size() < kMaxOpenConnections) {
      util::UniqueFd connection(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!connection) break;  // EAGAIN: no more waiting, or the peer went away first
      if (!peer_is_our_user(connection.get())) {
        reply_on(connection.get(), {{"ok", false}, {"error", "refused: the node endpoint answers its own user only"}});
        continue;
      }
      open.push_back({std::move(connection), {}, after + kRequestPatience});
    }
  }
}

void NodeEndpoint::answer(int connection, const std::string& line) {
  const auto reply = [&](nlohmann::json j, int fd = -1) { reply_on(connection, std::move(j), fd); };
  const auto request = nlohmann::json::parse(line, nullptr, false);
  if (!request.is_object() || !request.contains("op")) {
    reply({{"ok", false}, {"error", R"(not a request: send one JSON object per line, e.g. {"v":1,"op":"status"})"}});
    return;
  }
  if (request.value("v", 0) > contract::kNodeProtocolVersion) {
    reply({{"ok", false},
           {"error", fmt::format("protocol v{} is newer than this agent's v{}", request.value("v", 0),
                                 contract::kNodeProtocolVersion)}});
    return;
  }
  try {
    worker::NodeReply answer = handler_(request);
    answer.body["ok"] = true;
    reply(std::move(answer.body), answer.fd.get());  // the descriptor is ours until sent, then closed
  } catch (const std::exception& e) {
    reply({{"ok", false}, {"error", e.what()}});
  }
}

nlohmann::json query_node(const std::string& address, const nlohmann::json& request,
                          std::chrono::milliseconds timeout) {
  return worker::node_request(address, request, timeout).body;
}

int run_node_status_command(int argc, char** argv) {
  std::string address;
  if (argc > 2) {
    fmt::print(stderr, "elastrun node-status: usage: elastrun node-status [ADDRESS]\n");
    return 2;
  }
  if (argc == 2) {
    address = argv[1];
  } else if (const char* env = std::getenv(std::string(contract::env::kNodeSocket).c_str()); env && *env) {
    address = env;
  } else {
    fmt::print(stderr, "elastrun node-status: give the agent's ADDRESS (its log says it; its workers have {})\n",
               contract::env::kNodeSocket);
    return 2;
  }
  try {
    const auto reply = query_node(address, {{"v", contract::kNodeProtocolVersion}, {"op", "status"}});
    fmt::print("{}\n", node_json_line(reply));
    return reply.value("ok", false) ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "elastrun node-status: {}\n", e.what());
    return 1;
  }
}

}  // namespace elastrun::launcher
