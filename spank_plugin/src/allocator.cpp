// sbatch/salloc (allocator context): only slurm_spank_init and init_post_opt run here, and the
// option callbacks (plugin.cpp) have already validated the values: --elastic/--elastic-nproc
// are refused here (they belong to a step: the store lives in that step's srun).
//
// --torch-env needs no work: sbatch and salloc 22.05 themselves export an option given to them
// into the job's environment as SLURM_SPANK__SLURM_SPANK_OPTION_elastrun_torch_env (value
// "(null)" for the bare flag), which is exactly the variable srun reads for this option, so every
// srun of the batch script or salloc shell inherits it (verified on the testbed). The batch step
// itself is never given torch variables (remote.cpp).
#include "common.hpp"

namespace elastrun::spank::allocator {

int init_post_opt(spank_t) {
  const auto& s = state();
  if (s.torch_env_option)
    log_debug("--torch-env={} applies to the job's srun steps ({})", s.torch_env ? "yes" : "no",
              option_env_name(kPluginName, "torch-env"));
  return 0;
}

}  // namespace elastrun::spank::allocator
