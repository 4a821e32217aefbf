// Running Slurm's client commands (sbatch, scontrol) and capturing what they print: the job CLI
// submits through sbatch itself, so that #SBATCH lines, --export and site defaults behave exactly
// as for a user's own sbatch.
#pragma once

#include <string>
#include <vector>

namespace elastrun::jobs {

struct CommandResult {
  int exit_code = -1;  // 127: could not be started (`out`/`err` say why)
  std::string out, err;
};

// Runs argv[0] (searched on PATH) with the caller's environment, stdin from /dev/null, and waits.
CommandResult run_command(const std::vector<std::string>& argv);

// The first non-empty line of `text`, trimmed ("" if none).
std::string first_line(const std::string& text);

}  // namespace elastrun::jobs
