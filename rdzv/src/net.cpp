#include "elastrun/rdzv/net.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <system_error>

namespace elastrun::rdzv {
namespace {

[[noreturn]] void throw_errno(int err, const std::string& what) {
  throw std::system_error(err, std::generic_category(), what);
}

struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { freeaddrinfo(a); }
};

}  // namespace

void set_nonblocking(int fd) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) throw_errno(errno, "fcntl(O_NONBLOCK)");
}

void set_nodelay(int fd) {
  int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) < 0) throw_errno(errno, "setsockopt(TCP_NODELAY)");
}

Listener listen_tcp(const std::string& address, std::uint16_t port, const std::vector<std::uint16_t>& fallbacks,
                    int backlog) {
  std::vector<std::uint16_t> candidates{port};
  if (port != 0) candidates.insert(candidates.end(), fallbacks.begin(), fallbacks.end());
  int last_errno = 0;
  for (auto candidate : candidates) {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) throw_errno(errno, "socket()");
    int one = 1;
    if (setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0)
      throw_errno(errno, "setsockopt(SO_REUSEADDR)");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(candidate);
    if (inet_pton(AF_INET, address.c_str(), &addr.sin_addr) != 1)
      throw std::system_error(EINVAL, std::generic_category(),
                              fmt::format("'{}' is not an IPv4 address to listen on", address));
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) < 0) {
      last_errno = errno;
      if (last_errno == EADDRINUSE) continue;
      throw_errno(last_errno, fmt::format("bind({}:{})", address, candidate));
    }
    if (::listen(fd.get(), backlog) < 0) throw_errno(errno, "listen()");
    socklen_t len = sizeof addr;
    if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) < 0) throw_errno(errno, "getsockname()");
    return {std::move(fd), ntohs(addr.sin_port)};
  }
  throw_errno(last_errno,
              fmt::format("bind({}): port {} and its {} fallbacks are all in use", address, port, fallbacks.size()));
}

bool is_loopback_host(std::string_view host) {
  if (host == "localhost" || host == "ip6-localhost" || host == "::1" || host == "[::1]") return true;
  in_addr addr{};
  const std::string text(host);
  return inet_pton(AF_INET, text.c_str(), &addr) == 1 && (ntohl(addr.s_addr) >> 24) == 127;
}

std::optional<std::string> ipv4_address(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* raw = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &raw) != 0 || !raw) return std::nullopt;
  std::unique_ptr<addrinfo, AddrInfoDeleter> list(raw);
  char text[INET_ADDRSTRLEN] = {};
  const auto* sin = reinterpret_cast<const sockaddr_in*>(list->ai_addr);
  if (!inet_ntop(AF_INET, &sin->sin_addr, text, sizeof text)) return std::nullopt;
  return std::string(text);
}

UniqueFd connect_tcp(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* raw = nullptr;
  const auto service = std::to_string(port);
  if (int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &raw); rc != 0)
    throw std::system_error(EHOSTUNREACH, std::generic_category(),
                            fmt::format("cannot resolve '{}': {}", host, gai_strerror(rc)));
  std::unique_ptr<addrinfo, AddrInfoDeleter> list(raw);
  int last_errno = ECONNREFUSED;
  for (auto* ai = list.get(); ai; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (!fd) throw_errno(errno, "socket()");
    if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) < 0) {
      if (errno != EINPROGRESS) {
        last_errno = errno;
        continue;
      }
      pollfd pfd{fd.get(), POLLOUT, 0};
      int n = ::poll(&pfd, 1, static_cast<int>(timeout.count()));
      if (n <= 0) {
        last_errno = n == 0 ? ETIMEDOUT : errno;
        continue;
      }
      int err = 0;
      socklen_t len = sizeof err;
      getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        last_errno = err;
        continue;
      }
    }
    int flags = fcntl(fd.get(), F_GETFL);
    if (flags < 0 || fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) < 0) throw_errno(errno, "fcntl()");
    set_nodelay(fd.get());
    return fd;
  }
  throw_errno(last_errno, fmt::format("connect to {}:{}", host, port));
}

}  // namespace elastrun::rdzv
