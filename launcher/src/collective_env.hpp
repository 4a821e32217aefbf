// What the workers' collective libraries (NCCL, Gloo) get from the agent unless the user set it:
// NCCL's asynchronous error handling, so that a worker blocked on a dead peer fails instead of
// hanging until NCCL's own timeout, and on a node with several network interfaces the one that
// holds this node's rendezvous address, so that NCCL and Gloo do not pick another.
// docs/launcher.md, "Collective libraries".
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace elastrun::launcher {

struct NetworkInterface {
  std::string name;  // "eth0"
  std::string ipv4;  // "10.1.2.3"
  bool loopback = false;
};

// This host's interfaces that are up, one entry per IPv4 address (getifaddrs).
std::vector<NetworkInterface> network_interfaces();

// The IPv4 address `host` (a name or a literal) resolves to first, "" when it does not: the
// address to give choose_socket_interface for a node known by name (srun --torch-env).
std::string first_ipv4_of(const std::string& host);

struct SocketInterfaceChoice {
  std::string ifname;  // NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME; "" : the libraries choose
  std::string note;    // one line for the agent's log ("" : nothing worth saying)
  bool warning = false;
};

// The interface for the workers' sockets: the one holding `address` (this node's rendezvous
// address, an IPv4 address) when more than one non-loopback interface is up. Nothing with one
// such interface (the libraries find it) or a loopback address (one host); a warning when the
// address is on none of them.
SocketInterfaceChoice choose_socket_interface(const std::string& address,
                                              const std::vector<NetworkInterface>& interfaces);

// The variables the workers get ("KEY", "VALUE"), each unless `inherited` ("KEY=VALUE" entries)
// sets it: NCCL_ASYNC_ERROR_HANDLING=1 (torchrun's) and TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (its
// newer name), and with `socket_ifname` NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME.
std::vector<std::pair<std::string, std::string>> collective_defaults(const std::string& socket_ifname,
                                                                     const std::vector<std::string>& inherited);

}  // namespace elastrun::launcher
