// Dispatch: the SPANK entry points Slurm calls, the option table, and the exception barrier.
// Each slurm_spank_* function catches everything (no C++ exception crosses into Slurm) and hands
// over to the file of its context: local.cpp (srun), allocator.cpp (sbatch/salloc), remote.cpp
// (slurmstepd), slurmd.cpp (job epilog). Only slurm_spank_* and plugin_* symbols are exported
// (exports.map).
#include <exception>
#include <string>
#include <vector>

#include "common.hpp"

// The target builds with -fvisibility=hidden; these are the only default-visibility symbols
// (exports.map then limits the export list to them).
#define ELASTRUN_SPANK_EXPORT __attribute__((visibility("default")))

extern "C" {
// SPANK_PLUGIN defines these as `const`, which in C++ has internal linkage; declaring them
// extern "C" first gives them external C linkage so Slurm's dlsym finds them.
ELASTRUN_SPANK_EXPORT extern const char plugin_name[];
ELASTRUN_SPANK_EXPORT extern const char plugin_type[];
ELASTRUN_SPANK_EXPORT extern const unsigned int plugin_version;
ELASTRUN_SPANK_EXPORT extern const unsigned int spank_plugin_version;
SPANK_PLUGIN(elastrun, 1)
}

namespace elastrun::spank {

State& state() {
  static State s;
  return s;
}

std::string agent_path(const char* env_value) {
  if (env_value && *env_value) return env_value;
  if (!state().site.agent.empty()) return state().site.agent;
  return ELASTRUN_SPANK_DEFAULT_AGENT;
}

std::string spank_error_text(spank_err_t rc) {
  const char* text = spank_strerror(rc);
  return fmt::format("{} ({})", text ? text : "unknown spank error", static_cast<int>(rc));
}

namespace {

template <typename Fn>
int guarded(const char* where, Fn&& fn) noexcept {
  try {
    return fn();
  } catch (const std::exception& e) {
    try {
      log_error("{}: {}", where, e.what());
    } catch (...) {
    }
  } catch (...) {
    slurm_error("elastrun: %s: unknown exception", where);
  }
  return -1;
}

// ---- option callbacks: run in srun/sbatch/salloc at parse time (remote == 0), and again in
// slurmstepd (remote == 1) for options forwarded with the step. A non-zero return makes
// srun/sbatch/salloc fail before anything is submitted, whether the plugin is required or
// optional; each failure is one line saying what to do.

// sbatch/salloc: --elastic belongs to a step (the store lives in that step's srun).
int refuse_in_allocator(const char* option) {
  if (spank_context() != S_CTX_ALLOCATOR) return 0;
  log_error("{} applies to a job step: use `srun {} ...` inside the job, not sbatch/salloc", option, option);
  return -1;
}

int on_torch_env(int, const char* optarg, int remote) noexcept {
  return guarded("--torch-env", [&] {
    try {
      state().torch_env = parse_torch_env(optarg);
    } catch (const OptionError& e) {
      log_error("{}", e.what());
      return -1;
    }
    state().torch_env_option = true;
    if (remote) log_debug("--torch-env={} (forwarded)", state().torch_env ? "yes" : "no");
    return 0;
  });
}

int on_elastic(int, const char* optarg, int) noexcept {
  return guarded("--elastic", [&] {
    try {
      state().elastic_range = parse_elastic(optarg);
    } catch (const OptionError& e) {
      log_error("{}", e.what());
      return -1;
    }
    if (refuse_in_allocator("--elastic") != 0) return -1;
    state().elastic = true;
    return 0;
  });
}

int on_elastic_nproc(int, const char* optarg, int) noexcept {
  return guarded("--elastic-nproc", [&] {
    try {
      state().elastic_nproc = parse_elastic_nproc(optarg);
    } catch (const OptionError& e) {
      log_error("{}", e.what());
      return -1;
    }
    if (refuse_in_allocator("--elastic-nproc") != 0) return -1;
    state().elastic = true;  // --elastic-nproc=N alone means --elastic --elastic-nproc=N
    return 0;
  });
}

// has_arg 2 = optional argument (--torch-env, --torch-env=no).
spank_option g_options[] = {
    {const_cast<char*>("torch-env"), const_cast<char*>("[yes|no]"),
     const_cast<char*>("[elastrun] give every task the torch.distributed environment (RANK, "
                       "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...); no launcher needed"),
     2, 0, on_torch_env},
    {const_cast<char*>("elastic"), const_cast<char*>("[MIN:MAX]"),
     const_cast<char*>("[elastrun] run the step under the elastrun agent, one per node, with "
                       "MIN..MAX nodes (default: the step's node count); needs "
                       "--ntasks-per-node=1, use --no-kill to survive node failures"),
     2, 0, on_elastic},
    {const_cast<char*>("elastic-nproc"), const_cast<char*>("N"),
     const_cast<char*>("[elastrun] workers per node under --elastic (default 1; implies "
                       "--elastic)"),
     1, 0, on_elastic_nproc},
};

int init(spank_t sp, int argc, char** argv) {
  const spank_context_t ctx = spank_context();
  if (ctx == S_CTX_ERROR) {
    log_error("spank_context() failed; plugin disabled");
    return -1;
  }
  // Site arguments first: with a bad plugstack.conf line no option is registered, so
  // `srun --torch-env` fails as an unknown option instead of running with wrong defaults.
  std::vector<std::string> args(argv, argv + (argc > 0 ? argc : 0));
  try {
    state().site = parse_site_args(args);
  } catch (const OptionError& e) {
    log_error("{}; the plugin is disabled until plugstack.conf is fixed", e.what());
    // slurmd loads the plugin stack at start: failing there (with a `required` line) would keep
    // slurmd from starting on every node for a typo. srun and slurmstepd still refuse the job.
    if (ctx == S_CTX_SLURMD || ctx == S_CTX_JOB_SCRIPT) return 0;
    return -1;
  }
  state().torch_env = state().site.torch_env;
  if (ctx == S_CTX_SLURMD || ctx == S_CTX_JOB_SCRIPT) return 0;  // no options there
  for (auto& option : g_options) {
    spank_err_t rc = spank_option_register(sp, &option);
    if (rc != ESPANK_SUCCESS) {
      log_error("cannot register --{}: {}", option.name, spank_error_text(rc));
      return -1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace elastrun::spank

using namespace elastrun::spank;

extern "C" {

ELASTRUN_SPANK_EXPORT int slurm_spank_init(spank_t sp, int argc, char** argv) {
  return guarded("init", [&] { return init(sp, argc, argv); });
}

ELASTRUN_SPANK_EXPORT int slurm_spank_init_post_opt(spank_t sp, int, char**) {
  return guarded("init_post_opt", [&] {
    switch (spank_context()) {
      case S_CTX_LOCAL: return local::init_post_opt(sp);
      case S_CTX_ALLOCATOR: return allocator::init_post_opt(sp);
      default: return 0;
    }
  });
}

ELASTRUN_SPANK_EXPORT int slurm_spank_local_user_init(spank_t sp, int, char**) {
  return guarded("local_user_init", [&] { return local::user_init(sp); });
}

ELASTRUN_SPANK_EXPORT int slurm_spank_user_init(spank_t sp, int, char**) {
  return guarded("user_init", [&] { return remote::user_init(sp); });
}

ELASTRUN_SPANK_EXPORT int slurm_spank_task_init(spank_t sp, int, char**) {
  return guarded("task_init", [&] { return remote::task_init(sp); });
}

ELASTRUN_SPANK_EXPORT int slurm_spank_exit(spank_t sp, int, char**) {
  return guarded("exit", [&] {
    switch (spank_context()) {
      case S_CTX_LOCAL: return local::exit(sp);
      case S_CTX_REMOTE: return remote::exit(sp);
      default: return 0;
    }
  });
}

ELASTRUN_SPANK_EXPORT int slurm_spank_job_epilog(spank_t sp, int argc, char** argv) {
  return guarded("job_epilog", [&] { return slurmd::job_epilog(sp, argc, argv); });
}

}  // extern "C"
