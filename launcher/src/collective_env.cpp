#include "collective_env.hpp"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>

#include <algorithm>
#include <memory>
#include <set>

namespace elastrun::launcher {

std::vector<NetworkInterface> network_interfaces() {
  ifaddrs* raw = nullptr;
  if (getifaddrs(&raw) != 0) return {};
  std::unique_ptr<ifaddrs, decltype(&freeifaddrs)> list(raw, &freeifaddrs);
  std::vector<NetworkInterface> found;
  for (const ifaddrs* i = list.get(); i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP)) continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* sin = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
    if (!inet_ntop(AF_INET, &sin->sin_addr, text, sizeof text)) continue;
    found.push_back({i->ifa_name, text, (i->ifa_flags & IFF_LOOPBACK) != 0});
  }
  return found;
}

std::string first_ipv4_of(const std::string& host) {
  in_addr literal{};
  if (inet_pton(AF_INET, host.c_str(), &literal) == 1) return host;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* raw = nullptr;
  if (host.empty() || getaddrinfo(host.c_str(), nullptr, &hints, &raw) != 0 || !raw) return {};
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> found(raw, &freeaddrinfo);
  char text[INET_ADDRSTRLEN] = {};
  return inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(found->ai_addr)->sin_addr, text, sizeof text) ? text
                                                                                                                : "";
}

SocketInterfaceChoice choose_socket_interface(const std::string& address,
                                              const std::vector<NetworkInterface>& interfaces) {
  in_addr parsed{};
  if (address.empty() || inet_pton(AF_INET, address.c_str(), &parsed) != 1) return {};
  if ((ntohl(parsed.s_addr) >> 24) == 127) return {};  // one host: the libraries use loopback
  std::set<std::string> names;
  for (const auto& i : interfaces)
    if (!i.loopback) names.insert(i.name);
  if (names.size() < 2) return {};  // the only one: NCCL and Gloo find it themselves
  const auto holder = std::find_if(interfaces.begin(), interfaces.end(),
                                   [&](const NetworkInterface& i) { return !i.loopback && i.ipv4 == address; });
  if (holder == interfaces.end())
    return {"",
            fmt::format("warning: this node's rendezvous address {} is on none of its interfaces ({}): NCCL and "
                        "Gloo choose one themselves; set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME if they pick "
                        "the wrong one",
                        address, fmt::join(names, ", ")),
            true};
  return {holder->name,
          fmt::format("workers' NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME: {}, the interface of this node's "
                      "rendezvous address {} (up: {}); set them to choose another",
                      holder->name, address, fmt::join(names, ", ")),
          false};
}

std::vector<std::pair<std::string, std::string>> collective_defaults(const std::string& socket_ifname,
                                                                     const std::vector<std::string>& inherited) {
  std::vector<std::pair<std::string, std::string>> wanted{{"NCCL_ASYNC_ERROR_HANDLING", "1"},
                                                          {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"}};
  if (!socket_ifname.empty()) {
    wanted.emplace_back("NCCL_SOCKET_IFNAME", socket_ifname);
    wanted.emplace_back("GLOO_SOCKET_IFNAME", socket_ifname);
  }
  std::erase_if(wanted, [&](const auto& kv) {
    const auto prefix = kv.first + "=";
    return std::any_of(inherited.begin(), inherited.end(), [&](const std::string& e) { return e.starts_with(prefix); });
  });
  return wanted;
}

}  // namespace elastrun::launcher
