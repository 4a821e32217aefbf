// Pure option logic of the SPANK plugin: parsing and validating the user's options
// (--torch-env, --elastic, --elastic-nproc, their SLURM_SPANK_* environment forms) and the site
// arguments of the plugstack.conf line. No Slurm calls here, so it is unit-tested directly.
// Every error is an OptionError whose what() is one line: what was wrong + what to do.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace elastrun::spank {

class OptionError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// How MASTER_ADDR is derived from the step's first node (site argument master_addr=).
enum class MasterAddrMode {
  Auto,      // the node name if it resolves (getaddrinfo), else slurmctld's NodeAddr
  Hostname,  // always the node name (the site's DNS/hosts resolves node names everywhere)
  NodeAddr,  // always slurmctld's NodeAddr of the node
};
std::string_view to_string(MasterAddrMode mode);

// Format of TORCHELASTIC_RUN_ID (site argument run_id=).
enum class RunIdMode {
  Step,  // <job id>.<step id>.r<restart count>: distinct for concurrent steps (default)
  Job,   // <job id>.r<restart count>: like the agent's default rendezvous id
};
std::string_view to_string(RunIdMode mode);

// Site defaults from `required|optional spank_elastrun.so key=value ...` in plugstack.conf.
struct SiteConfig {
  bool torch_env = false;  // torch_env=yes: every step gets the torch environment by default
  MasterAddrMode master_addr = MasterAddrMode::Auto;
  RunIdMode run_id = RunIdMode::Step;
  std::string agent;            // agent=/path: the elastrun binary for --elastic (empty: built-in default)
  std::string tmpdir = "/tmp";  // tmpdir=/path: where --elastic keeps per-step state directories
};

// Parses the plugstack.conf arguments. Unknown keys, missing '=' and bad values throw
// OptionError naming the key, e.g. "unknown site argument 'torch-env=1' in plugstack.conf; ...".
SiteConfig parse_site_args(const std::vector<std::string>& args);

// --torch-env[=yes|no]: nullptr or "" (the bare flag) means yes.
bool parse_torch_env(const char* optarg);

// --elastic[=MIN:MAX]: "MIN:MAX" or "N" (= N:N); nullptr/"" means "the step's node count".
struct ElasticRange {
  int min = 0;  // 0 with max 0: not given (use the step's node count)
  int max = 0;
  bool operator==(const ElasticRange&) const = default;
};
ElasticRange parse_elastic(const char* optarg);

// --elastic-nproc=N: workers per node, 1..kMaxNproc.
inline constexpr int kMaxNproc = 1024;
int parse_elastic_nproc(const char* optarg);

// Name of the environment variable that sets a SPANK option, as srun/sbatch/salloc 22.05 read it
// (verified on the testbed): SLURM_SPANK__SLURM_SPANK_OPTION_<plugin>_<option with - as _>.
std::string option_env_name(std::string_view plugin, std::string_view option);

}  // namespace elastrun::spank
