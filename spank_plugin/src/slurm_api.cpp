#include "slurm_api.hpp"

extern "C" {
#include <slurm/slurm.h>
}

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#include <memory>
#include <stdexcept>

namespace elastrun::spank::slurm_api {
namespace {

template <typename Fn>
Fn lookup(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
}

// Slurm-internal (src/common/read_config.h), exported by libslurmfull; returns an xmalloc'd copy.
using conf_get_nodeaddr_fn = char* (*)(const char*);

}  // namespace

std::optional<std::vector<std::string>> expand_hostlist(std::string_view expression) {
  static const auto create = lookup<decltype(&slurm_hostlist_create)>("slurm_hostlist_create");
  static const auto shift = lookup<decltype(&slurm_hostlist_shift)>("slurm_hostlist_shift");
  static const auto destroy = lookup<decltype(&slurm_hostlist_destroy)>("slurm_hostlist_destroy");
  if (!create || !shift || !destroy)
    throw std::runtime_error(
        "this Slurm process does not export slurm_hostlist_create/shift/destroy (libslurmfull); "
        "the plugin needs Slurm 22.05 or later");
  const std::string text(expression);
  if (text.find_first_not_of(" \t,") == std::string::npos) return std::nullopt;
  std::unique_ptr<hostlist, decltype(destroy)> list(create(text.c_str()), destroy);
  if (!list) return std::nullopt;
  std::vector<std::string> hosts;
  while (char* host = shift(list.get())) {
    hosts.emplace_back(host);
    std::free(host);  // hostlist_shift returns malloc()ed memory
  }
  return hosts;
}

rdzv::HostlistExpander hostlist_expander() {
  return [](std::string_view expression) { return expand_hostlist(expression); };
}

std::optional<std::string> conf_node_addr(const std::string& node) {
  static const auto get = lookup<conf_get_nodeaddr_fn>("slurm_conf_get_nodeaddr");
  if (!get) return std::nullopt;
  char* addr = get(node.c_str());
  if (!addr) return std::nullopt;
  // Deliberately not freed: it is xmalloc()ed (slurm_xfree's signature is not public API) and
  // this runs once per step in slurmstepd.
  return std::string(addr);
}

std::string ctld_node_addr(const std::string& node) {
  static const auto load = lookup<decltype(&slurm_load_node_single)>("slurm_load_node_single");
  static const auto release = lookup<decltype(&slurm_free_node_info_msg)>("slurm_free_node_info_msg");
  static const auto errnum = lookup<decltype(&slurm_get_errno)>("slurm_get_errno");
  static const auto strerr = lookup<decltype(&slurm_strerror)>("slurm_strerror");
  if (!load || !release) throw std::runtime_error("this Slurm process does not export slurm_load_node_single");
  node_info_msg_t* info = nullptr;
  std::string name = node;
  if (load(&info, name.data(), SHOW_ALL) != SLURM_SUCCESS || !info) {
    const int e = errnum ? errnum() : 0;
    throw std::runtime_error(
        fmt::format("slurm_load_node_single({}) failed: {}", node, strerr ? strerr(e) : std::to_string(e)));
  }
  std::unique_ptr<node_info_msg_t, decltype(release)> guard(info, release);
  if (info->record_count < 1 || !info->node_array[0].node_addr || !*info->node_array[0].node_addr)
    throw std::runtime_error(fmt::format("slurmctld reports no NodeAddr for node {}", node));
  return info->node_array[0].node_addr;
}

}  // namespace elastrun::spank::slurm_api
