#include "elastrun/rdzv/slurm_api.hpp"

#include <netdb.h>
#include <sys/socket.h>

#include "elastrun/slurm/api.hpp"

namespace elastrun::rdzv {

std::optional<std::string> resolve_node_address(const std::string& node_name) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  if (getaddrinfo(node_name.c_str(), nullptr, &hints, &res) == 0) {
    freeaddrinfo(res);
    return node_name;
  }
  return slurm::node_addr(node_name);
}

}  // namespace elastrun::rdzv
