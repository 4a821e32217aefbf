// Pure logic of `srun --elastic`: the agent's command line, the names of the per-step state
// directory and the rendezvous id. No Slurm calls here, so it is unit-tested directly.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "options.hpp"

namespace elastrun::spank {

// Environment variables the plugin uses (docs/spank.md). srun -> tasks go through srun's
// environment under SLURM_* names: srun passes SLURM_* on even with --export=NONE (verified).
inline constexpr const char* kAgentEnv = "ELASTRUN_SPANK_AGENT";           // agent path override
inline constexpr const char* kStorePortEnv = "SLURM_ELASTRUN_STORE_PORT";  // srun -> tasks
inline constexpr const char* kStoreHostEnv = "SLURM_ELASTRUN_STORE_HOST";  // optional override
inline constexpr const char* kRunIdEnv = "SLURM_ELASTRUN_RUN_ID";          // srun -> tasks
inline constexpr const char* kStepTokenEnv = "SLURM_ELASTRUN_TOKEN";       // srun -> tasks
inline constexpr const char* kTokenEnv = "ELASTRUN_RDZV_TOKEN";            // -> store, agents
inline constexpr const char* kProgramEnv = "ELASTRUN_SPANK_PROGRAM";       // task -> agent
inline constexpr const char* kAgentArgsEnv = "ELASTRUN_SPANK_AGENT_ARGS";  // task -> agent

// What one node's agent is told (everything else it detects from the Slurm step).
struct AgentPlan {
  ElasticRange range;      // {0, 0}: the step's node count
  int nproc = 0;           // 0: the agent's default (1)
  std::string store_host;  // where srun's store helper listens
  std::uint16_t store_port = 0;
  std::string run_id;
  std::string log_dir;  // the per-step, per-node state directory
};

// The agent's flags, one per element, each a single `--flag=value` token.
std::vector<std::string> agent_flags(const AgentPlan& plan);

// Flags as the task passes them to the agent (ELASTRUN_SPANK_AGENT_ARGS): one per line.
std::string join_lines(const std::vector<std::string>& items);

// Rendezvous id of an --elastic step: "<job>.<step>.r<restart count>".
std::string elastic_run_id(std::uint32_t job, std::uint32_t step, std::string_view restart_count);

// Per-step, per-node state directory name (under the site argument tmpdir):
// "elastrun-spank.<job>.<step>.<node index in the step>". The agent's error files live there;
// removed at step end (slurmstepd) and by the job epilog (slurmd).
std::string step_dir_name(std::uint32_t job, std::uint32_t step, std::string_view node);

// True if `name` is a step_dir_name() of job `job` (any step, any node).
bool is_job_dir_name(std::string_view name, std::uint32_t job);

// A node name or value safe to put into a file name / a single flag token.
bool safe_token(std::string_view text);

// Whether srun's own command line `srun_argv` (its /proc/self/cmdline) gives `option` (e.g.
// "--multi-prog") among srun's options, i.e. before the step's program `program_argv` (S_JOB_ARGV),
// which ends the command line; the program's own arguments are never looked at.
bool srun_option_given(const std::vector<std::string>& srun_argv, const std::vector<std::string>& program_argv,
                       std::string_view option);

}  // namespace elastrun::spank
