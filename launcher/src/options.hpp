// The agent's command line: torchrun-compatible flags (both `--nproc-per-node` and
// `--nproc_per_node` spellings), PET_* environment overrides as defaults, and the program to run.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace elastrun::launcher {

using Millis = std::chrono::milliseconds;

// A bad or contradictory command line: what() is one line; the agent exits with code 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Which standard streams go where: bit 1 = stdout, bit 2 = stderr (torchrun's Std values).
struct StreamSpec {
  int all = 0;                  // applies to local ranks not in `per_rank`
  std::map<int, int> per_rank;  // "0:3,1:1"
  int for_rank(int local_rank) const {
    auto it = per_rank.find(local_rank);
    return it == per_rank.end() ? all : it->second;
  }
};

// Why a job stops and may come back through a Slurm requeue; each class has its own budget.
enum class FailureClass { App = 0, Node = 1, TimeLimit = 2, Preempt = 3 };
inline constexpr int kFailureClasses = 4;
std::string_view to_string(FailureClass c);  // "app", "node", "timelimit", "preempt"
std::optional<FailureClass> failure_class_from_string(std::string_view name);

// --rdzv-backend: c10d and static use the embedded store, etcd and etcd-v2 an external etcd v3.
enum class RdzvBackend { C10d, Static, Etcd, EtcdV2 };
std::string_view to_string(RdzvBackend b);  // the flag's spelling
std::optional<RdzvBackend> rdzv_backend_from_string(std::string_view name);
inline bool uses_etcd(RdzvBackend b) { return b == RdzvBackend::Etcd || b == RdzvBackend::EtcdV2; }
inline constexpr std::int64_t kUnlimited = -1;

struct AgentOptions {
  // --nnodes (nullopt: the Slurm step's node count, or 1)
  std::optional<int> min_nodes, max_nodes;
  // --het-nnodes=MIN:MAX,...: node bounds per het component, in component order (empty: none)
  std::vector<std::pair<int, int>> het_nnodes;
  int nproc_per_node = 1;
  RdzvBackend rdzv_backend = RdzvBackend::C10d;
  std::string rdzv_endpoint;
  std::string rdzv_id;
  Millis join_timeout{600'000};
  Millis last_call_timeout{1000};
  Millis heartbeat_timeout{3000};
  Millis partition_timeout{0};  // --partition-timeout; 0: join_timeout
  std::optional<bool> is_host;
  std::vector<std::string> ignored_rdzv_conf;  // torchrun keys accepted without effect
  std::vector<std::string> unknown_rdzv_conf;  // keys neither we nor torchrun know: one warning each
  std::vector<std::string> notes;              // torchrun flags accepted without (full) effect: one line each at start
  bool standalone = false;
  int max_restarts = 0;
  Millis monitor_interval{100};
  Millis stop_grace{5000};
  Millis exit_barrier_timeout{300'000};
  std::string role = "default";
  std::optional<int> node_rank;
  std::string master_addr;
  std::string local_addr;    // --local-addr: how peers reach this node (MASTER_ADDR if group rank 0)
  std::string start_method;  // accepted, no effect: workers are always fork+exec'd processes
  std::optional<int> master_port;
  // torchrun's static form: --master-addr without --rdzv-endpoint. The workers' own c10d store
  // gets the user's port (MASTER_PORT = --master-port, as under torchrun, so that
  // init_method="tcp://ADDR:PORT" works); the agents' rendezvous store listens on the next one.
  bool static_form() const { return !master_addr.empty() && rdzv_endpoint.empty(); }
  int static_master_port() const { return master_port.value_or(29500); }
  int static_store_port() const { return static_master_port() == 65535 ? 65534 : static_master_port() + 1; }
  std::string log_dir;
  // torchrun 2.x (docs/launcher.md has the table)
  std::string log_line_prefix_template;  // console prefix: ${rank} ${local_rank} ${role_name} ${hostname}
  std::vector<std::string> duplicate_stdout_filters, duplicate_stderr_filters;  // tee'd lines -> filtered_*.log
  bool virtual_local_rank = false;  // LOCAL_RANK=0, CUDA_VISIBLE_DEVICES narrowed to the worker's device
  int gpus_per_worker = 0;          // N >= 1: CUDA_VISIBLE_DEVICES narrowed to the worker's N GPUs (0: not narrowed)
  std::string numa_binding;         // node|socket|exclusive|core-complex ("" = none)
  // torch.distributed.launch: also pass the local rank as an argument ("--local-rank" or
  // "--local_rank"; "" = no, as torchrun)
  std::string local_rank_arg;
  Millis hang_timeout{0};  // --hang-timeout: 0 = off
  // --health-check (health_check.hpp): builtin and/or site commands, each with a timeout
  bool health_check_builtin = false;
  std::vector<std::string> health_check_commands;
  Millis health_check_timeout{60'000};
  Millis health_check_interval{0};  // --health-check-interval: again while workers run (0 = off)
  // --straggler-* (straggler_watch.hpp): report (default), exclude or off; threshold, W, K
  std::string straggler_action = "report";
  double straggler_threshold = 1.5;
  int straggler_window = 20;
  int straggler_windows = 3;
  // --memory-checkpoints[=BYTES]: the node's budget for the memory checkpoint tier (none = off)
  std::optional<std::uint64_t> memory_checkpoints;
  // --preload=MODULES: Python workers forked by a per-node preloader that imported them ("" = off)
  std::string preload;
  std::string metrics_dir;   // --metrics-dir / $ELASTRUN_METRICS_DIR: node_exporter textfile (metrics.hpp)
  std::string outcome_file;  // --outcome-file / $ELASTRUN_OUTCOME_FILE: group rank 0 writes how the job ended
  std::string events;        // --events: the event log (default with --log-dir: <log-dir>/events-<node>.jsonl)
  StreamSpec redirects;
  StreamSpec tee;
  std::optional<std::set<int>> local_ranks_filter;  // console output only from these local ranks
  bool module = false;
  bool no_python = false;
  bool run_path = false;
  std::string rdzv_auth = "auto";
  std::string python;  // ELASTRUN_PYTHON, default python3
  // checkpoint-and-stop and requeue (docs/launcher.md, "Signals, checkpoint and requeue")
  std::string checkpoint_dir;          // --checkpoint-dir: ELASTRUN_CHECKPOINT_DIR, requeue ledger
  Millis checkpoint_timeout{300'000};  // --checkpoint-timeout: wait for workers to checkpoint
  bool forward_signals = false;        // --forward-signals: also send SIGUSR1/2, SIGTERM to workers
  bool scale_up_checkpoint = true;     // --scale-up-checkpoint: checkpoint-and-stop before a scale-up
  // --requeue-budget: requeues allowed per FailureClass across the job's life (kUnlimited: no limit)
  std::array<std::int64_t, kFailureClasses> requeue_budget{0, 3, kUnlimited, kUnlimited};
  // the program and its arguments, untouched
  std::string program;
  std::vector<std::string> program_args;
};

enum class ParseOutcome { Run, Exit0 };

// Parses argv (argv[0] is the binary). `pet` (torchrun's PET_<FLAG> variables, lower-case flag
// names) supplies defaults that the command line overrides. Throws UsageError; on --help prints
// the help and returns Exit0.
ParseOutcome parse_agent_options(int argc, char** argv, const std::map<std::string, std::string>& pet,
                                 AgentOptions& out);

// "app:0,node:3,timelimit:inf" -> budgets (classes not named keep `defaults`); throws UsageError.
std::array<std::int64_t, kFailureClasses> parse_requeue_budget(const std::string& text,
                                                               std::array<std::int64_t, kFailureClasses> defaults);

// The CPUs this process may run on (its affinity mask: what Slurm bound the task to), at least 1.
int cpu_count();

// "3", "0:1,1:2" -> StreamSpec; throws UsageError naming `flag`.
StreamSpec parse_stream_spec(const std::string& flag, const std::string& text);

}  // namespace elastrun::launcher
