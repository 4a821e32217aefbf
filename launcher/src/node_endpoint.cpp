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

namespace elastrun::launcher {

namespace {

constexpr std::size_t kMaxLine = 64 * 1024;  // requests are tiny; a peer that sends more is cut off

// sockaddr_un for "@name" (abstract: a leading NUL, no terminator counted) or a path.
std::pair<sockaddr_un, socklen_t> unix_address(const std::string& address) {
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  const bool abstract = address.starts_with('@');
  const std::string_view name = abstract ? std::string_view(address).substr(1) : std::string_view(address);
  if (name.empty() || name.size() + 1 > sizeof(sa.sun_path))
    throw std::invalid_argument(
        fmt::format("node endpoint address '{}' is empty or longer than {} bytes", address, sizeof(sa.sun_path) - 1));
  if (abstract) {
    sa.sun_path[0] = '\0';
    std::memcpy(sa.sun_path + 1, name.data(), name.size());
    return {sa, static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())};
  }
  std::memcpy(sa.sun_path, name.data(), name.size());
  return {sa, static_cast<socklen_t>(sizeof(sa))};
}

// Reads until a newline (excluded), EOF or the deadline; false on timeout, error or overflow.
bool read_line(int fd, std::string& line, std::chrono::steady_clock::time_point deadline) {
  char buf[4096];
  while (true) {
    if (const auto nl = line.find('\n'); nl != std::string::npos) {
      line.resize(nl);
      return true;
    }
    if (line.size() > kMaxLine) return false;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    if (n == 0) return !line.empty();  // a last line without its newline
    line.append(buf, static_cast<std::size_t>(n));
  }
}

bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

std::string dump(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

}  // namespace

std::string default_node_address(int pid, const std::string& node) {
  return fmt::format("@elastrun-node-{}-{}", pid, node);
}

NodeEndpoint::NodeEndpoint(std::string address, Handler handler)
    : address_(std::move(address)), handler_(std::move(handler)) {
  const auto [sa, length] = unix_address(address_);
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
  const auto reply = [&](nlohmann::json j) {
    j["v"] = contract::kNodeProtocolVersion;
    (void)write_all(connection, dump(j) + "\n");
  };
  ucred peer{};
  socklen_t size = sizeof peer;
  if (::getsockopt(connection, SOL_SOCKET, SO_PEERCRED, &peer, &size) != 0 ||
      (peer.uid != ::getuid() && peer.uid != 0)) {
    reply({{"ok", false}, {"error", "refused: the node endpoint answers its own user only"}});
    return;
  }
  std::string line;
  if (!read_line(connection, line, std::chrono::steady_clock::now() + std::chrono::seconds(2))) return;
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
    nlohmann::json answer = handler_(request);
    answer["ok"] = true;
    reply(std::move(answer));
  } catch (const std::exception& e) {
    reply({{"ok", false}, {"error", e.what()}});
  }
}

nlohmann::json query_node(const std::string& address, const nlohmann::json& request,
                          std::chrono::milliseconds timeout) {
  const auto [sa, length] = unix_address(address);
  util::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd || ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&sa), length) != 0)
    throw std::runtime_error(fmt::format("no elastrun agent answers at {}: {}", address, std::strerror(errno)));
  if (!write_all(fd.get(), dump(request) + "\n"))
    throw std::runtime_error(fmt::format("sending to {}: {}", address, std::strerror(errno)));
  std::string line;
  if (!read_line(fd.get(), line, std::chrono::steady_clock::now() + timeout))
    throw std::runtime_error(fmt::format("no reply from {} within {} ms", address, timeout.count()));
  auto reply = nlohmann::json::parse(line, nullptr, false);
  if (!reply.is_object()) throw std::runtime_error(fmt::format("{} replied with something else than JSON", address));
  return reply;
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
    fmt::print("{}\n", dump(reply));
    return reply.value("ok", false) ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "elastrun node-status: {}\n", e.what());
    return 1;
  }
}

}  // namespace elastrun::launcher
