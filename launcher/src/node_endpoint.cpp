#include "node_endpoint.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "elastrun/worker/contract.hpp"
#include "elastrun/worker/node.hpp"

namespace elastrun::launcher {

using worker::node_json_line;
using worker::node_socket_address;
using worker::receive_node_line;
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

void NodeEndpoint::serve() {
  while (true) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {wake_read_.get(), POLLIN, 0}};
    const int ready = ::poll(fds, 2, -1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0 || (fds[1].revents != 0)) return;  // stopping
    util::UniqueFd connection(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!connection) continue;  // the peer went away first, or EAGAIN
    answer(connection.get());
  }
}

void NodeEndpoint::answer(int connection) {
  const auto reply = [&](nlohmann::json j, int fd = -1) {
    j["v"] = contract::kNodeProtocolVersion;
    (void)send_node_line(connection, node_json_line(j), fd);
  };
  ucred peer{};
  socklen_t size = sizeof peer;
  if (::getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &peer, &size) != 0 ||
      (peer.uid != ::getuid() && peer.uid != 0)) {
    reply({{"ok", false}, {"error", "refused: the node endpoint answers its own user only"}});
    return;
  }
  std::string line;
  util::UniqueFd ignored;  // a request carries no descriptor
  if (!receive_node_line(connection, line, &ignored, std::chrono::steady_clock::now() + std::chrono::seconds(2)))
    return;
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
