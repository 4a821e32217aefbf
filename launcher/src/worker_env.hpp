// What each worker gets: the environment PyTorch expects (RANK, LOCAL_RANK, WORLD_SIZE,
// MASTER_ADDR/PORT, TORCHELASTIC_*), elastrun's own variables (ELASTRUN_*), and where its
// output goes (console with a "[rank N]" prefix, per-attempt log files, or both).
// docs/launcher.md, "The worker environment".
#pragma once

#include <cstdint>
#include <optional>
#include <filesystem>
#include <string>
#include <vector>

#include "elastrun/rdzv/rendezvous.hpp"
#include "gpu_binding.hpp"
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
  std::filesystem::path attempt_dir;                // <log dir or temp dir>/<run>/attempt_<n>
  std::string program_path;                         // resolved executable
  std::vector<std::string> argv;                    // argv[0] included
  std::string agent_tag;                            // "ELASTRUN_AGENT_TAG=..." of the agent's watchdog ("" = none)
  std::size_t argv_program_end = 1;                 // where --local-rank-arg goes: after `python -u [-m] SCRIPT`
  std::vector<std::vector<int>> numa_nodes;         // --numa-binding: each NUMA node's CPUs (read_numa_nodes)
  std::string timer_file;                           // TORCHELASTIC_TIMER_FILE: the agent's FileTimer FIFO ("" = none)
  std::string node_socket = {};                     // ELASTRUN_NODE_SOCKET: the node endpoint's address ("" = none)
  std::optional<std::uint64_t> memory_budget = {};  // ELASTRUN_MEMORY_CHECKPOINTS (none = the tier is off)
  std::string socket_ifname = {};                   // NCCL/GLOO_SOCKET_IFNAME (choose_socket_interface; "" = none)
  int cpus = 0;                                     // the agent's CPUs (cpu_count), shared by its workers; 0: unknown
  GpuSet gpus = {};                                 // the step's GPUs on this node (detect_gpus; empty: none)
  std::vector<std::vector<int>> gpu_cpus = {};      // --numa-binding: CPUs near each GPU (cpus_near_gpus)
};

// --hang-timeout: the files of local rank `local` in an attempt directory, and the signal on
// which elastrun_control's faulthandler writes the Python stacks.
std::filesystem::path progress_file(const std::filesystem::path& attempt_dir, int local);
std::filesystem::path python_stacks_file(const std::filesystem::path& attempt_dir, int local);
int python_stacks_signal();

// The console prefix of a worker's lines: "[rank N] ", or torchrun's --log-line-prefix-template
// with ${rank}, ${local_rank}, ${role_name} and ${hostname} (the node name) replaced.
std::string console_prefix(const std::string& line_template, int rank, int local_rank, const std::string& role,
                           const std::string& node);
// Linux cpulist text ("0-3,8,10-11\n") -> CPU numbers; empty if malformed.
std::vector<int> parse_cpu_list(std::string_view text);
// --numa-binding: local ranks spread evenly over the NUMA nodes in order (rank r of n -> node
// r * nodes / n), the way accelerators usually hang off them; empty (no binding) with < 2 nodes.
std::vector<int> numa_cpus_for(int local_rank, int nproc, const std::vector<std::vector<int>>& node_cpus);
// The CPUs of each NUMA node under root (/sys/devices/system/node): node0/cpulist, node1/...
std::vector<std::vector<int>> read_numa_nodes(const std::filesystem::path& root = "/sys/devices/system/node");
// --numa-binding on a node with GPUs: for each GPU of `gpus` (by index into gpus.visible), the
// CPUs of the NUMA node it hangs off (read_gpu_numa_nodes), empty where the topology does not say.
// A worker is then bound next to its (first) GPU, not by the even spread of numa_cpus_for.
std::vector<std::vector<int>> cpus_near_gpus(const GpuSet& gpus, const std::vector<GpuNumaNode>& topology,
                                             const std::filesystem::path& numa_root = "/sys/devices/system/node");

// The worker's variables (without the inherited ones); with several local workers
// OMP_NUM_THREADS = the agent's CPUs / workers (at least 1), and the collective libraries'
// defaults (collective_env.hpp), each unless `inherited` sets it.
// OMP_NUM_THREADS for each of `nproc` workers sharing `cpus` CPUs (0: unknown): torchrun's 1
// unless the CPUs are known, then an equal share, at least 1.
// The CPUs the agent's workers share: its affinity mask, or fewer when Slurm allocated fewer
// (SLURM_CPUS_PER_TASK: without a task affinity plugin the mask is the whole node's).
int cpus_for_workers(int affinity_cpus, const std::optional<std::string>& slurm_cpus_per_task);
int omp_threads_per_worker(int cpus, int nproc);

std::vector<std::string> worker_variables(const AttemptContext& attempt, int local_rank, const std::string& error_file,
                                          const std::vector<std::string>& inherited);

// One spec per local worker: creates <attempt_dir>/<local rank>/ (error file, logs) and removes
// a stale error.json there.
std::vector<WorkerSpec> worker_specs(const AttemptContext& attempt, const std::vector<std::string>& inherited);

}  // namespace elastrun::launcher
