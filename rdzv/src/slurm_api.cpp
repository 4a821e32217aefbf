#include "elastrun/rdzv/slurm_api.hpp"

#include <netdb.h>
#include <slurm/slurm.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

namespace elastrun::rdzv {
namespace {

void init_once() {
  static std::once_flag once;
  std::call_once(once, [] { slurm_init(nullptr); });  // reads $SLURM_CONF or the default
}

struct NodeInfoDeleter {
  void operator()(node_info_msg_t* m) const { slurm_free_node_info_msg(m); }
};

// libslurm with no configuration to read (no $SLURM_CONF, no slurm.conf, no configless cache)
// tries DNS SRV records and then calls fatal(), which exits the process with three log lines:
// outside a Slurm cluster there is simply nobody to ask.
bool slurm_config_available() {
  static const bool available = [] {
    const char* conf = std::getenv("SLURM_CONF");
    if (conf && *conf) return ::access(conf, R_OK) == 0;
    for (const char* path : {"/etc/slurm/slurm.conf", "/run/slurm/conf/slurm.conf", "/var/run/slurm/conf/slurm.conf"})
      if (::access(path, R_OK) == 0) return true;
    return false;
  }();
  return available;
}

std::unique_ptr<node_info_msg_t, NodeInfoDeleter> load_node(const std::string& name) {
  if (!slurm_config_available()) return nullptr;
  init_once();
  node_info_msg_t* raw = nullptr;
  std::vector<char> writable(name.begin(), name.end());
  writable.push_back('\0');
  if (slurm_load_node_single(&raw, writable.data(), SHOW_ALL) != SLURM_SUCCESS) return nullptr;
  return std::unique_ptr<node_info_msg_t, NodeInfoDeleter>(raw);
}

}  // namespace

std::optional<std::string> resolve_node_address(const std::string& node_name) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  if (getaddrinfo(node_name.c_str(), nullptr, &hints, &res) == 0) {
    freeaddrinfo(res);
    return node_name;
  }
  return slurm_node_addr(node_name);
}

std::optional<std::string> slurm_node_addr(const std::string& node_name) {
  auto info = load_node(node_name);
  if (!info || info->record_count < 1 || !info->node_array[0].node_addr) return std::nullopt;
  return std::string(info->node_array[0].node_addr);
}

std::optional<bool> slurm_node_is_down(const std::string& node_name) {
  auto info = load_node(node_name);
  if (!info || info->record_count < 1) return std::nullopt;
  auto state = info->node_array[0].node_state;
  bool down =
      (state & NODE_STATE_BASE) == NODE_STATE_DOWN || (state & NODE_STATE_NO_RESPOND) || (state & NODE_STATE_FAIL);
  return down;
}

}  // namespace elastrun::rdzv
