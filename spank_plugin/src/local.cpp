// srun (local context): options are validated by their callbacks (plugin.cpp) before anything is
// submitted; here only the effective choice is reported. MASTER_ADDR is resolved on the compute
// side (remote.cpp) because srun cannot hand it to every task: in a heterogeneous step
// slurm_spank_local_user_init runs once, for the last component only, and with --export=NONE
// nothing srun adds to its environment reaches the tasks (both verified on Slurm 22.05).
#include "common.hpp"

namespace elastrun::spank::local {

int init_post_opt(spank_t) {
  const auto& s = state();
  log_debug("site: torch_env={} master_addr={} run_id={}", s.site.torch_env ? "yes" : "no",
            to_string(s.site.master_addr), to_string(s.site.run_id));
  return 0;
}

int user_init(spank_t sp) {
  if (!state().torch_env) return 0;
  uint32_t job = 0, step = 0;
  spank_err_t rc = spank_get_item(sp, S_JOB_ID, &job);
  if (rc != ESPANK_SUCCESS) {
    log_error("spank_get_item(S_JOB_ID): {}", spank_error_text(rc));
    return -1;
  }
  rc = spank_get_item(sp, S_JOB_STEPID, &step);
  if (rc != ESPANK_SUCCESS) {
    log_error("spank_get_item(S_JOB_STEPID): {}", spank_error_text(rc));
    return -1;
  }
  log_verbose("step {}.{}: tasks get the torch.distributed environment (--torch-env)", job, step);
  return 0;
}

}  // namespace elastrun::spank::local
