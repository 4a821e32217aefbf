// Shared state and helpers of the SPANK plugin's context files (plugin.cpp dispatches to
// local.cpp = srun, allocator.cpp = sbatch/salloc, remote.cpp = slurmstepd, slurmd.cpp = the
// job epilog run for slurmd).
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
  SiteConfig site;                // plugstack.conf arguments
  bool torch_env = false;         // effective: the site default, then SLURM_SPANK_* / the option
  bool torch_env_option = false;  // --torch-env (or its environment form) was given
  // slurmstepd: the step's master node and its address, resolved once in user_init (tasks are
  // forked from slurmstepd afterwards and inherit this), or why that failed.
  std::string master_node;
  std::string master_addr;
  std::string master_error;
  // --elastic / --elastic-nproc (the latter implies the former)
  bool elastic = false;
  ElasticRange elastic_range;  // {0, 0}: the step's node count
  int elastic_nproc = 0;       // 0: not given
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
int exit(spank_t sp);
}  // namespace local
namespace allocator {
int init_post_opt(spank_t sp);
}  // namespace allocator
namespace remote {
int user_init(spank_t sp);
int task_init(spank_t sp);
int exit(spank_t sp);
}  // namespace remote
namespace slurmd {
int job_epilog(spank_t sp, int argc, char** argv);
}  // namespace slurmd

// The elastrun binary --elastic runs: $ELASTRUN_SPANK_AGENT (`env_value`, from the caller's
// environment), else the site argument agent=, else the configured install path.
std::string agent_path(const char* env_value);

// Removes `path` (a directory tree) with the rights of `uid`/`gid`: directly if this process
// runs as that user, else in a child that drops to it first (never as root: the tree is
// user-writable). Refuses anything that is not a directory owned by `uid` (lstat). Logs failures.
void remove_user_tree(const std::string& path, uid_t uid, gid_t gid);

}  // namespace elastrun::spank
