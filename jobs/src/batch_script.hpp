// The batch script `elastrun run` submits: a readable sbatch script in our job scripts'
// conventions (sbatch/*.sbatch: one agent per node under `elastrun job-step srun`), kept in the
// job directory as job.sbatch so that `sbatch job.sbatch` runs the same job again. Pure text.
#pragma once

#include <string>
#include <vector>

#include "run_spec.hpp"

namespace elastrun::jobs {

// Where the script runs and what it runs with: facts of the submitting side.
struct ScriptContext {
  std::string elastrun;            // the absolute path of the elastrun binary that submits
  std::string submit_dir;          // the working directory (the job's --chdir)
  std::string job_dir;             // the job directory, %j for the job id
  std::string generated_at;        // "2026-12-06 23:50 UTC", for the header
  std::string python = "python3";  // for utils.python -c ($ELASTRUN_PYTHON when set)
};

std::string batch_script(const RunSpec& spec, const ScriptContext& ctx);

// The words for a `#` comment line: quoted, newlines shown as \n (a newline would end the comment
// and make the rest a command, before the #SBATCH lines).
std::string comment_text(const std::vector<std::string>& words);

// A word quoted for bash where it needs it ('...' with ' as '\''); plain words stay as they are.
std::string shell_quote(const std::string& word);

// The agent's command line for the spec (what follows `"$ELASTRUN"` in the script), one flag per
// item; the program and its arguments last.
// Without --nnodes (the script computes it from the allocation; -s local runs --standalone).
std::vector<std::string> agent_words(const RunSpec& spec, const std::string& python);

}  // namespace elastrun::jobs
