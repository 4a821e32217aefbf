// The job CLI: `elastrun run|status|log|cancel|list|describe` (TorchX's verbs, Slurm-native and
// elastic; docs/jobs.md). A verb is the first word of the elastrun command line; `elastrun --
// run ...` runs a program called `run` under the agent instead.
#pragma once

#include <string_view>

namespace elastrun::jobs {

// Exit codes of every verb (docs/jobs.md).
inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;      // Slurm unreachable, unknown handle, sbatch's refusal...
inline constexpr int kExitUsage = 2;      // a bad command line
inline constexpr int kExitJobFailed = 3;  // run --wait / status --watch: the job ended FAILED or CANCELLED

bool is_job_verb(std::string_view word);

// argv[0] is the verb.
int run_job_verb(int argc, char** argv);

}  // namespace elastrun::jobs
