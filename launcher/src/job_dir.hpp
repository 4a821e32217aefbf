// The job directory: where every agent of a Slurm job writes its events, per-rank logs and the
// outcome file without any flag, so that any later tool finds a job from its id alone (also after
// it left squeue, with accounting off). One documented default, overridable:
//   ELASTRUN_JOB_DIR unset   <SLURM_SUBMIT_DIR>/elastrun-<job id>
//   ELASTRUN_JOB_DIR=PATH    PATH, with %j replaced by the job id (e.g. /scratch/me/jobs/%j)
//   ELASTRUN_JOB_DIR=none    no job directory (only --log-dir/--events, as before)
// plus a per-user index entry, a symlink <index>/<ClusterName>/<job id> -> the job directory,
// <index> = $ELASTRUN_INDEX_DIR or ~/.elastrun/jobs (test clusters restart job ids at 1: the
// cluster name keeps them apart). A directory that cannot be created or written falls back to a
// node-local $TMPDIR/elastrun-<uid>/jobs/<ClusterName>/<job id> with one warning line; it never
// fails the job. Layout: docs/launcher.md, "The job directory".
#pragma once

#include <optional>
#include <string>

#include "elastrun/rdzv/env.hpp"

namespace elastrun::launcher {

struct JobDirPlan {
  std::string path;        // the job directory
  std::string index_link;  // the index entry to create ("" when there is no home or index)
  std::string job_id, cluster;
};

inline constexpr const char* kJobDirEnv = "ELASTRUN_JOB_DIR";
inline constexpr const char* kIndexDirEnv = "ELASTRUN_INDEX_DIR";
inline constexpr const char* kOutcomeFileName = "outcome.json";

// `text` with every %j replaced by `job_id` (sbatch's pattern for the job id).
std::string replace_job_id(std::string text, const std::string& job_id);

// The plan for this environment; nullopt outside a Slurm job (unless ELASTRUN_JOB_DIR names a
// directory) or with ELASTRUN_JOB_DIR=none. Pure: no file is touched.
std::optional<JobDirPlan> plan_job_dir(const rdzv::EnvMap& env);

// Creates the plan's directory (0700, parents as needed) and checks it can be written; on
// failure falls back to the node-local directory, with one warning naming both. Then creates the
// index entry (a failure there is a warning only). Returns the directory in use, "" if none
// could be made at all (warned).
std::string make_job_dir(const JobDirPlan& plan, const rdzv::EnvMap& env);

// The index entry `link` -> `target` (atomic: every agent of a job may add it at once); nothing
// when `link` already is that directory or that link; a failure is one warning line.
void add_index_entry(const std::string& link, const std::string& target);

// `elastrun job-dir`: prints the job directory of this environment (nothing, exit 1, outside a job).
int run_job_dir_command(int argc, char** argv);

// `elastrun job-step COMMAND [ARGS...]`: the job scripts' glue around their srun — runs COMMAND,
// forwards TERM, USR1, USR2, INT and HUP to it, and exits with its exit code, except that a
// non-zero code is overruled to 0 when the agents' outcome file (the job directory's
// outcome.json, or $ELASTRUN_OUTCOME_FILE) says the training succeeded: srun exits non-zero when
// Slurm ended the tasks of nodes that left the job (a shrink, a node loss). A stale outcome file
// (a requeued job reuses its job id) is removed first.
int run_job_step_command(int argc, char** argv);

}  // namespace elastrun::launcher
