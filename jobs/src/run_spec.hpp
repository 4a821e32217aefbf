// `elastrun run`'s command line as data: which scheduler, which component with which arguments,
// which Slurm options. TorchX's shape (`torchx run -s slurm dist.ddp -j 2x8 --script main.py --
// --lr 0.1`), our components and flags; docs/jobs.md. Parsing is pure (no file, no process), so
// every accepted and refused line is a unit test (tests/jobs/).
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace elastrun::jobs {

// A command line that cannot be run: one line naming what was wrong (exit code 2).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline constexpr const char* kComponents = "dist.ddp, utils.python, utils.sh";

// -j [MIN:]MAXxNPROC: nodes MIN to MAX, NPROC workers each.
struct JobShape {
  int min_nodes = 1, max_nodes = 1, nproc_per_node = 1;
};

struct RunSpec {
  std::string scheduler = "slurm";  // "slurm" or "local" (alias local_cwd)
  // -cfg KEY=VALUE,...: TorchX's Slurm keys and any sbatch long option, in the order given
  std::vector<std::pair<std::string, std::string>> cfg;
  bool dryrun = false;
  bool wait = false;

  std::string component;  // dist.ddp, utils.python, utils.sh
  std::string name;       // --name, else from the script or module
  // what runs: a script (.py runs under Python), a module (-m), Python code (-c, utils.python)
  // or a command (utils.sh)
  std::string script, module, code;
  std::vector<std::string> command;                      // utils.sh
  std::vector<std::string> script_args;                  // after `--`
  std::vector<std::pair<std::string, std::string>> env;  // --env K=V,...

  // dist.ddp: -j [MIN:]MAXxNPROC
  int min_nodes = 1, max_nodes = 1, nproc_per_node = 1;
  // dist.ddp --het: a heterogeneous job, one component per -j (in order; min/max/nproc above are
  // component 0's). Empty: a plain job.
  std::vector<JobShape> het;
  bool het_requested = false;       // --het seen
  int max_retries = 0;              // requeues of the job for failures (TorchX's meaning)
  std::optional<int> max_restarts;  // the agent's in-job restarts (--max-restarts)
  std::string checkpoint_dir;
  int spares = 0;
  std::string preload;
  std::optional<std::string> memory_checkpoints;  // "" = the agent's default budget
  std::string signal = "USR1@120";                // checkpoint before the time limit; "none" turns it off
  int cpus_per_node = 0, gpus_per_node = 0, mem_mb = 0;

  // the original words after `run`, for describe and the script's header
  std::vector<std::string> words;
};

// Parses the words after `run`. Throws UsageError.
RunSpec parse_run(const std::vector<std::string>& words);

// "2:4x8" -> (2, 4, 8); "2x8" -> (2, 2, 8); "4" -> (4, 4, 1). Throws UsageError.
JobShape parse_job_shape(const std::string& text);

// "KEY=VALUE,KEY=VALUE" (a value may hold '=' but not ','); `what` names the flag in errors.
std::vector<std::pair<std::string, std::string>> parse_pairs(const std::string& text, const std::string& what);

// The job's name: --name, else the script's stem, the module's last part, or the command's name.
std::string job_name(const RunSpec& spec);

}  // namespace elastrun::jobs
