// Shared state and helpers of the SPANK plugin's context files (plugin.cpp dispatches to
// local.cpp = srun, allocator.cpp = sbatch/salloc, remote.cpp = slurmstepd). The plugin has no
// slurmd callbacks, so Slurm does not load it into slurmd at all.
#pragma once

extern "C" {
#include <slurm/spank.h>
}

#include <fmt/format.h>

#include <optional>
#include <string>

#include "options.hpp"

namespace elastrun::spank {

inline constexpr const char* kPluginName = "elastrun";  // SPANK_PLUGIN(elastrun, ...)

// One process loads one plugin instance; Slurm calls it from one thread.
struct State {
  SiteConfig site;             // plugstack.conf arguments
  bool torch_env = false;      // effective: the site default, then SLURM_SPANK_* / the option
  bool torch_env_option = false;  // --torch-env (or its environment form) was given
  // slurmstepd: the step's master node and its address, resolved once in user_init (tasks are
  // forked from slurmstepd afterwards and inherit this), or why that failed.
  std::string master_node;
  std::string master_addr;
  std::string master_error;
};
State& state();

// Slurm's logging, one line, prefixed "elastrun: ".
template <typename... Args>
void log_error(fmt::format_string<Args...> format, Args&&... args) {
  slurm_error("elastrun: %s", fmt::format(format, std::forward<Args>(args)...).c_str());
}
template <typename... Args>
void log_info(fmt::format_string<Args...> format, Args&&... args) {
  slurm_info("elastrun: %s", fmt::format(format, std::forward<Args>(args)...).c_str());
}
template <typename... Args>
void log_verbose(fmt::format_string<Args...> format, Args&&... args) {
  slurm_verbose("elastrun: %s", fmt::format(format, std::forward<Args>(args)...).c_str());
}
template <typename... Args>
void log_debug(fmt::format_string<Args...> format, Args&&... args) {
  slurm_debug("elastrun: %s", fmt::format(format, std::forward<Args>(args)...).c_str());
}

// Text of a spank_err_t ("ESPANK_NOT_REMOTE (3006)").
std::string spank_error_text(spank_err_t rc);

// Per-context entry points (each returns a SPANK return code; exceptions are caught by the
// dispatcher in plugin.cpp).
namespace local {
int init_post_opt(spank_t sp);
int user_init(spank_t sp);
}  // namespace local
namespace allocator {
int init_post_opt(spank_t sp);
}  // namespace allocator
namespace remote {
int user_init(spank_t sp);
int task_init(spank_t sp);
}  // namespace remote

}  // namespace elastrun::spank
