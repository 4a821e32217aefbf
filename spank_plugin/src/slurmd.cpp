// slurmd context: the job epilog (slurm_spank_job_epilog, run for slurmd on every node of the
// job when it ends, also for steps whose slurmstepd was killed with the node's processes).
// It removes what --elastic left on this node: every per-step state directory of the job under
// the site argument tmpdir (remote.cpp removes its own at step end; this catches the rest).
// The store helper lives in srun (local.cpp), never on a compute node.
#include <dirent.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common.hpp"
#include "elastic.hpp"

namespace elastrun::spank::slurmd {

int job_epilog(spank_t sp, int argc, char** argv) {
  // slurm_spank_init is not called before the job epilog (verified on 22.05: the site
  // arguments were still the defaults), so the plugstack.conf arguments are parsed here.
  try {
    state().site = parse_site_args(std::vector<std::string>(argv, argv + (argc > 0 ? argc : 0)));
  } catch (const OptionError& e) {
    log_error("job epilog: {}; nothing removed", e.what());
    return -1;
  }
  uint32_t job = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  spank_err_t rc = spank_get_item(sp, S_JOB_ID, &job);
  if (rc != ESPANK_SUCCESS) {
    log_error("job epilog: spank_get_item(S_JOB_ID): {}", spank_error_text(rc));
    return -1;
  }
  if ((rc = spank_get_item(sp, S_JOB_UID, &uid)) != ESPANK_SUCCESS ||
      (rc = spank_get_item(sp, S_JOB_GID, &gid)) != ESPANK_SUCCESS) {
    log_error("job epilog: spank_get_item(S_JOB_UID/GID): {}", spank_error_text(rc));
    return -1;
  }
  const std::string& base = state().site.tmpdir;
  std::unique_ptr<DIR, int (*)(DIR*)> dir(::opendir(base.c_str()), ::closedir);
  if (!dir) {
    log_error("job epilog: cannot list {}: {}", base, std::strerror(errno));
    return -1;
  }
  std::vector<std::string> found;
  while (const dirent* e = ::readdir(dir.get()))
    if (is_job_dir_name(e->d_name, job)) found.push_back(base + "/" + e->d_name);
  dir.reset();
  for (const auto& path : found) remove_user_tree(path, uid, gid);
  if (!found.empty()) log_verbose("job {} epilog: removed {} --elastic state dir(s)", job, found.size());
  return 0;
}

}  // namespace elastrun::spank::slurmd
