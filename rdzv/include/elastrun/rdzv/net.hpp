// Sockets with RAII and checked system calls, shared by the store, the agent and the tests.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "elastrun/util/unique_fd.hpp"

namespace elastrun::rdzv {

using UniqueFd = elastrun::util::UniqueFd;  // one owner type for every component

// A listening TCP socket bound to `address`:`port` (0 = any free port); when `port` is taken,
// each of `fallbacks` is tried in order. Throws std::system_error naming the last port tried.
struct Listener {
  UniqueFd fd;
  std::uint16_t port = 0;
};
Listener listen_tcp(const std::string& address, std::uint16_t port, const std::vector<std::uint16_t>& fallbacks = {},
                    int backlog = 4096);

// Connects to host:port (name or address), waiting at most `timeout`. Throws std::system_error
// with the host and port in the message.
UniqueFd connect_tcp(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout);

// A literal loopback name: localhost, ip6-localhost, 127.x.y.z or ::1 (no lookup: a host name
// that resolves to 127.0.1.1, as Debian's does, still names a host other machines reach).
bool is_loopback_host(std::string_view host);

// The first IPv4 address `host` resolves to (dotted quad), std::nullopt if it does not resolve.
std::optional<std::string> ipv4_address(const std::string& host);

void set_nonblocking(int fd);
void set_nodelay(int fd);

}  // namespace elastrun::rdzv
