// elastrun/worker/node.hpp: the client of the node endpoint, the versioned Unix-socket service of
// a node's agent (docs/launcher.md, "The node endpoint"): one request per connection, one JSON
// object per line each way; a reply may carry one file descriptor (SCM_RIGHTS), e.g. a memory
// checkpoint segment. The agent serves with the same line functions. Header only: the standard
// library, POSIX and nlohmann-json.
//
//   auto reply = elastrun::worker::node_request(elastrun::worker::node_address_from_environment(),
//                                               {{"op", elastrun::contract::node_op::kStatus}});
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "elastrun/util/unique_fd.hpp"
#include "elastrun/worker/contract.hpp"

namespace elastrun::worker {

inline constexpr std::size_t kNodeMaxLine = 64 * 1024;  // requests and replies are small

struct NodeReply {
  NodeReply(nlohmann::json b = nlohmann::json::object(), util::UniqueFd f = {})  // NOLINT: from a JSON body
      : body(std::move(b)), fd(std::move(f)) {}
  nlohmann::json body;
  util::UniqueFd fd;  // the descriptor that came with the reply, if any
};

// sockaddr_un for "@name" (Linux abstract namespace: a leading NUL, no terminator counted) or a
// path. Throws std::invalid_argument for an empty or too long address.
inline std::pair<sockaddr_un, socklen_t> node_socket_address(const std::string& address) {
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  const bool abstract = !address.empty() && address.front() == '@';
  const std::string_view name = abstract ? std::string_view(address).substr(1) : std::string_view(address);
  if (name.empty() || name.size() + 1 > sizeof(sa.sun_path))
    throw std::invalid_argument("node endpoint address '" + address + "' is empty or longer than " +
                                std::to_string(sizeof(sa.sun_path) - 1) + " bytes");
  if (abstract) {
    std::memcpy(sa.sun_path + 1, name.data(), name.size());
    return {sa, static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())};
  }
  std::memcpy(sa.sun_path, name.data(), name.size());
  return {sa, static_cast<socklen_t>(sizeof(sa))};
}

// Sends `line` and a newline on `socket`; with `fd` >= 0 the descriptor goes with the first byte.
// False on error (the peer went away).
inline bool send_node_line(int socket, std::string line, int fd = -1) {
  line += '\n';
  std::string_view rest = line;
  bool attach = fd >= 0;
  while (!rest.empty()) {
    iovec io{const_cast<char*>(rest.data()), rest.size()};
    msghdr msg{};
    msg.msg_iov = &io;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    if (attach) {
      msg.msg_control = control;
      msg.msg_controllen = sizeof control;
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    const ssize_t n = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    attach = false;
    rest.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

// Reads one line (returned without its newline) and a descriptor that came with it (into *fd, if
// given; closed otherwise), until `deadline`. False on timeout, error, EOF before any byte, or a
// line longer than kNodeMaxLine.
inline bool receive_node_line(int socket, std::string& line, util::UniqueFd* fd,
                              std::chrono::steady_clock::time_point deadline) {
  char buf[4096];
  while (true) {
    if (const auto nl = line.find('\n'); nl != std::string::npos) {
      line.resize(nl);
      return true;
    }
    if (line.size() > kNodeMaxLine) return false;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{socket, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    iovec io{buf, sizeof buf};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &io;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      int received = -1;
      std::memcpy(&received, CMSG_DATA(c), sizeof(int));
      util::UniqueFd owned(received);
      if (fd != nullptr) *fd = std::move(owned);
    }
    if (n == 0) return !line.empty();  // a last line without its newline
    line.append(buf, static_cast<std::size_t>(n));
  }
}

inline std::string node_json_line(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Sends one request (its "v" filled in) to the endpoint at `address` and returns the reply.
// Throws std::runtime_error naming the address when it cannot connect, times out or gets no JSON.
inline NodeReply node_request(const std::string& address, nlohmann::json request,
                              std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  const auto [sa, length] = node_socket_address(address);
  util::UniqueFd socket(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!socket || ::connect(socket.get(), reinterpret_cast<const sockaddr*>(&sa), length) != 0)
    throw std::runtime_error("no elastrun agent answers at " + address + ": " + std::strerror(errno));
  if (!request.contains("v")) request["v"] = contract::kNodeProtocolVersion;
  if (!send_node_line(socket.get(), node_json_line(request)))
    throw std::runtime_error("sending to " + address + ": " + std::strerror(errno));
  std::string line;
  NodeReply reply;
  if (!receive_node_line(socket.get(), line, &reply.fd, std::chrono::steady_clock::now() + timeout))
    throw std::runtime_error("no reply from " + address + " within " + std::to_string(timeout.count()) + " ms");
  reply.body = nlohmann::json::parse(line, nullptr, false);
  if (!reply.body.is_object()) throw std::runtime_error(address + " replied with something else than JSON");
  return reply;
}

// This worker's agent ($ELASTRUN_NODE_SOCKET), "" when not started by elastrun.
inline std::string node_address_from_environment() {
  const char* address = std::getenv(std::string(contract::env::kNodeSocket).c_str());
  return address != nullptr ? address : "";
}

}  // namespace elastrun::worker
