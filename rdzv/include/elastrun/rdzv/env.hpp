// Zero-flag bootstrap: turns a process environment into "where am I and who are my peers".
//
// The parser is pure: it reads an EnvMap and expands node lists through an injected
// HostlistExpander, so the agent (libslurm's hostlist), the SPANK plugin (the hostlist of the
// Slurm process that loaded it) and unit tests (a fake) share one implementation.
// Every contradiction is an EnvError whose one-line message names the variable and the fix;
// nothing silently falls back to localhost.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace elastrun::rdzv {

using EnvMap = std::map<std::string, std::string, std::less<>>;

// A snapshot of this process's environment (::environ).
EnvMap current_environment();

// The run id, one format for the agent, srun --torch-env and srun --elastic (TORCHELASTIC_RUN_ID,
// the rendezvous' namespace): "<job>.r<restarts>" job-wide (the agent under Slurm), or
// "<job>.<step>.r<restarts>" for one step. `restarts` is SLURM_RESTART_COUNT ("" reads as 0), so a
// requeued job starts a new run.
std::string format_run_id(std::string_view job_id, std::optional<std::string_view> step_id, std::string_view restarts);

// Thrown for a contradictory, partial or unparsable environment. what() is one line.
class EnvError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Expands a hostlist expression ("n[1-4],gpu[01-02]") into host names, in order.
// Returns std::nullopt when the expression cannot be parsed.
using HostlistExpander = std::function<std::optional<std::vector<std::string>>(std::string_view expression)>;

// How many names a hostlist expression stands for, counted from its brackets without expanding
// them ("a[1-1000]b[1-1000]" is 10^6; the count saturates just above kMaxHostlistNodes), or
// std::nullopt if the brackets are malformed. Expansion is refused above the limit: a node list
// that large is a mistake (or an attack), and expanding it would take minutes and gigabytes.
inline constexpr std::uint64_t kMaxHostlistNodes = 100'000;
std::optional<std::uint64_t> hostlist_size(std::string_view expression);

// Parses Slurm's compressed task counts: "2(x3),1" -> {2,2,2,1}.
// Throws std::invalid_argument with a description of the offending element.
std::vector<int> parse_tasks_per_node(std::string_view spec);

// Where the rank/world description came from, in order of precedence.
enum class RankSource {
  Torchrun,    // RANK/WORLD_SIZE already set (we are a torch worker)
  OpenMPI,     // OMPI_COMM_WORLD_* (mpirun), which overrides the enclosing Slurm step
  Slurm,       // an srun step (SLURM_STEP_ID, SLURM_PROCID, ...) or a batch script
  PMI2,        // PMI_RANK/PMI_SIZE without Slurm
  Standalone,  // nothing detected: a single process
};
std::string_view to_string(RankSource source);

// One component of a heterogeneous step, with its offsets in the global rank/node numbering.
struct HetComponent {
  int index = 0;
  std::string job_id;
  std::vector<std::string> nodes;
  std::vector<int> tasks_per_node;
  int ntasks = 0;
  int task_offset = 0;  // global rank of this component's first task
  int node_offset = 0;  // global node index of this component's first node
};

struct SlurmEnv {
  std::string job_id;                  // SLURM_JOB_ID
  std::optional<std::string> step_id;  // SLURM_STEP_ID; absent in a batch script / salloc shell
  std::optional<int> proc_id;          // SLURM_PROCID
  std::optional<int> local_id;         // SLURM_LOCALID
  std::optional<int> node_id;          // SLURM_NODEID (index into `nodes`)
  int ntasks = 0;                      // tasks of the step (or job outside a step)
  std::vector<std::string> nodes;      // the step's nodes (the job's outside a step)
  std::vector<std::string> job_nodes;  // SLURM_JOB_NODELIST
  std::vector<int> tasks_per_node;     // parallel to `nodes`
  int restart_count = 0;               // SLURM_RESTART_COUNT
  std::string node_name;               // SLURMD_NODENAME
  std::string cluster_name;            // SLURM_CLUSTER_NAME
  std::string submit_dir;              // SLURM_SUBMIT_DIR
  // Heterogeneous job: SLURM_HET_SIZE > 1 (legacy SLURM_PACK_SIZE).
  int het_size = 0;
  int het_component = -1;  // which component this task belongs to (-1: not heterogeneous)
  std::vector<HetComponent> het_components;
};

// An MPI launcher's view; several may be present at once (mpirun of Open MPI also sets PMIx).
struct MpiEnv {
  std::string kind;  // "openmpi", "pmix" or "pmi2"
  std::optional<int> rank;
  std::optional<int> size;
  std::optional<int> local_rank;
  std::optional<int> local_size;
  std::string nspace;  // PMIX_NAMESPACE / PMI_JOBID
};

// torch.distributed variables already present (torchrun, our agent, or the SPANK plugin set them).
struct TorchEnv {
  int rank = 0;
  int world_size = 1;
  std::optional<int> local_rank;
  std::optional<int> local_world_size;
  std::optional<int> group_rank;
  std::string master_addr;
  std::optional<int> master_port;
  std::string run_id;  // TORCHELASTIC_RUN_ID
};

struct Placement {
  RankSource source = RankSource::Standalone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  int num_nodes = 1;
};

// Deterministic rendezvous endpoint proposal (see docs/environment.md):
// host = first node of the step; port = kPortBase + (job_id * 32 + step) % kPortSpan,
// fallbacks = the following ports of the range (wrapping) to try when the port is taken.
struct Endpoint {
  std::string host;
  std::uint16_t port = 0;
  std::vector<std::uint16_t> fallback_ports;
};
inline constexpr int kPortBase = 24000;  // below Linux's ephemeral range (32768-60999)
inline constexpr int kPortSpan = 8000;
inline constexpr int kPortFallbacks = 8;
Endpoint propose_endpoint(std::string_view host, std::uint64_t job_id, std::uint64_t step);

struct DetectedEnv {
  Placement placement;
  std::optional<SlurmEnv> slurm;
  std::vector<MpiEnv> mpi;  // openmpi, pmix, pmi2 as present
  std::optional<TorchEnv> torch;
  std::map<std::string, std::string> pet_overrides;  // PET_NNODES=2:4 -> {"nnodes","2:4"}
  std::optional<Endpoint> rdzv_endpoint;
  std::string run_id;  // default rendezvous id: <job id>[-r<restart count>] under Slurm
  std::string hostname;
};

DetectedEnv detect_environment(const EnvMap& env, const HostlistExpander& expand_hostlist);

}  // namespace elastrun::rdzv
