// What each worker gets: the environment PyTorch expects (RANK, LOCAL_RANK, WORLD_SIZE,
// MASTER_ADDR/PORT, TORCHELASTIC_*), elastrun's own variables (ELASTRUN_*), and where its
// output goes (console with a "[rank N]" prefix, per-attempt log files, or both).
// docs/launcher.md, "The worker environment".
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "elastrun/rdzv/rendezvous.hpp"
#include "options.hpp"
#include "workers.hpp"

namespace elastrun::launcher {

// Every variable elastrun sets for a worker: never inherited from the agent's environment.
const std::vector<std::string>& worker_variable_names();

// The agent's environment ("KEY=VALUE" entries) minus worker_variable_names().
std::vector<std::string> inherited_environment(char** environ_entries);

// What a round and the agent contribute to every worker of one attempt.
struct AttemptContext {
  const AgentOptions& options;
  const rdzv::RoundResult& round;
  std::string run_id;
  std::string node_name;
  std::string control_file;  // ELASTRUN_CONTROL_FILE
  std::string events_file;   // ELASTRUN_EVENTS_FILE ("" = none)
  std::int64_t restart_count = 0;
  std::filesystem::path attempt_dir;  // <log dir or temp dir>/<run>/attempt_<n>
  std::string program_path;           // resolved executable
  std::vector<std::string> argv;      // argv[0] included
  std::string agent_tag;              // "ELASTRUN_AGENT_TAG=..." of the agent's watchdog ("" = none)
};

// The worker's variables (without the inherited ones); OMP_NUM_THREADS=1 with several local
// workers unless `inherited` sets it.
std::vector<std::string> worker_variables(const AttemptContext& attempt, int local_rank, const std::string& error_file,
                                          const std::vector<std::string>& inherited);

// One spec per local worker: creates <attempt_dir>/<local rank>/ (error file, logs) and removes
// a stale error.json there.
std::vector<WorkerSpec> worker_specs(const AttemptContext& attempt, const std::vector<std::string>& inherited);

}  // namespace elastrun::launcher
