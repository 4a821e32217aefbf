#include "worker_env.hpp"

#include "collective_env.hpp"
#include "gpu_binding.hpp"

#include <algorithm>
#include <csignal>
#include <fstream>
#include <stdexcept>

#include <fmt/format.h>

#include "elastrun/control.hpp"
#include "elastrun/worker/contract.hpp"
#include "elastrun/util/parse.hpp"

namespace elastrun::launcher {

namespace fs = std::filesystem;
namespace env_name = contract::env;

namespace {
std::string replace_all(std::string text, std::string_view from, const auto& to) {
  if (text.find(from) == std::string::npos) return text;
  const std::string with = fmt::format("{}", to);
  for (std::size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + with.size()))
    text.replace(at, from.size(), with);
  return text;
}
}  // namespace

std::filesystem::path progress_file(const std::filesystem::path& attempt_dir, int local) {
  return attempt_dir / std::to_string(local) / "progress";
}
std::filesystem::path python_stacks_file(const std::filesystem::path& attempt_dir, int local) {
  return attempt_dir / std::to_string(local) / "python-stacks.txt";
}
int python_stacks_signal() { return SIGRTMIN + 4; }

std::string console_prefix(const std::string& line_template, int rank, int local_rank, const std::string& role,
                           const std::string& node) {
  if (line_template.empty()) return fmt::format("[rank {}] ", rank);
  std::string prefix = replace_all(line_template, "${rank}", rank);
  prefix = replace_all(prefix, "${local_rank}", local_rank);
  prefix = replace_all(prefix, "${role_name}", role);
  return replace_all(prefix, "${hostname}", node);
}

std::vector<int> parse_cpu_list(std::string_view text) {
  std::vector<int> cpus;
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  for (auto item : util::split_list(text)) {
    const auto dash = item.find('-');
    const auto first = util::parse_integer<long>(item.substr(0, dash));
    const auto last = dash == std::string_view::npos ? first : util::parse_integer<long>(item.substr(dash + 1));
    if (!first || !last || *first < 0 || *last < *first || *last > 1 << 20) return {};
    for (auto c = *first; c <= *last; ++c) cpus.push_back(static_cast<int>(c));
  }
  return cpus;
}

std::vector<int> numa_cpus_for(int local_rank, int nproc, const std::vector<std::vector<int>>& node_cpus) {
  if (node_cpus.size() < 2 || nproc < 1) return {};
  const auto nodes = static_cast<long>(node_cpus.size());
  const auto node = static_cast<std::size_t>(static_cast<long>(local_rank) * nodes / nproc);
  return node_cpus[std::min(node, node_cpus.size() - 1)];
}

std::vector<std::vector<int>> read_numa_nodes(const fs::path& root) {
  std::vector<std::vector<int>> nodes;
  for (int n = 0; n < 4096; ++n) {
    std::ifstream in(root / fmt::format("node{}", n) / "cpulist");
    if (!in) break;
    std::string line;
    std::getline(in, line);
    auto cpus = parse_cpu_list(line);
    if (!cpus.empty()) nodes.push_back(std::move(cpus));
  }
  return nodes;
}

std::vector<std::vector<int>> cpus_near_gpus(const GpuSet& gpus, const std::vector<GpuNumaNode>& topology,
                                             const fs::path& numa_root) {
  std::vector<std::vector<int>> near(gpus.size());
  for (std::size_t i = 0; i < gpus.size(); ++i) {
    const auto node = numa_node_of_gpu(gpus.driver_id(i), topology);
    if (!node) continue;
    std::ifstream in(numa_root / fmt::format("node{}", *node) / "cpulist");
    std::string line;
    if (std::getline(in, line)) near[i] = parse_cpu_list(line);
  }
  return near;
}

const std::vector<std::string>& worker_variable_names() {
  static const std::vector<std::string> names(contract::env::kReplaced.begin(), contract::env::kReplaced.end());
  return names;
}

std::vector<std::string> inherited_environment(char** entries) {
  const auto& ours = worker_variable_names();
  std::vector<std::string> kept;
  for (char** e = entries; e && *e; ++e) {
    std::string_view kv(*e);
    auto name = kv.substr(0, kv.find('='));
    if (std::find(ours.begin(), ours.end(), name) == ours.end()) kept.emplace_back(kv);
  }
  return kept;
}

int cpus_for_workers(int affinity_cpus, const std::optional<std::string>& slurm_cpus_per_task) {
  const auto allocated = slurm_cpus_per_task ? util::parse_integer<int>(*slurm_cpus_per_task) : std::nullopt;
  return allocated && *allocated > 0 ? std::min(affinity_cpus, *allocated) : affinity_cpus;
}

int omp_threads_per_worker(int cpus, int nproc) { return nproc < 1 || cpus < 1 ? 1 : std::max(1, cpus / nproc); }

std::vector<std::string> worker_variables(const AttemptContext& a, int local, const std::string& error_file,
                                          const std::vector<std::string>& inherited) {
  const auto& o = a.options;
  const auto& r = a.round;
  std::vector<std::string> env;
  auto set = [&](std::string_view key, const auto& value) { env.push_back(fmt::format("{}={}", key, value)); };
  set(env_name::kNodeRank, r.group_rank);  // torch.distributed.launch's name for GROUP_RANK
  set(env_name::kRank, r.rank_offset + local);
  set(env_name::kLocalRank, o.virtual_local_rank ? 0 : local);
  // its GPU(s): LOCAL_RANK indexes the step's list, or it sees only its own (gpu_binding.hpp)
  const auto device = device_for_worker(a.gpus, local, o.gpus_per_worker, o.virtual_local_rank);
  if (device.cuda_visible_devices) set("CUDA_VISIBLE_DEVICES", *device.cuda_visible_devices);
  if (a.gpus.size() > 0) set(env_name::kDevice, device.device);
  set(env_name::kGroupRank, r.group_rank);
  set(env_name::kRoleRank, r.role_rank_offset + local);
  set(env_name::kRoleName, o.role);
  set(env_name::kLocalWorldSize, o.nproc_per_node);
  set(env_name::kWorldSize, r.world_size);
  set(env_name::kGroupWorldSize, r.group_world_size);
  set(env_name::kRoleWorldSize, r.role_world_size);
  set(env_name::kMasterAddr, r.master_addr);
  // the static form keeps the user's port for the workers (Options::static_form)
  set(env_name::kMasterPort, o.static_form() ? o.static_master_port() : r.master_port);
  set(env_name::kRestartCount, a.restart_count);
  set(env_name::kMaxRestarts, o.max_restarts);
  set(env_name::kRunId, a.run_id);
  set(env_name::kErrorFile, error_file);
  set(env_name::kUseAgentStore, "False");
  set(env_name::kGeneration, r.generation);
  set(env_name::kNode, a.node_name);
  set(env_name::kControlFile, a.control_file);
  set(env_name::kCheckpointedExitCodeVar, elastrun::control::kCheckpointedExitCode);
  if (!o.checkpoint_dir.empty()) set(env_name::kCheckpointDir, o.checkpoint_dir);
  if (!a.agent_tag.empty()) env.push_back(a.agent_tag);
  // (an inherited TORCHELASTIC_TIMER_FILE is the same path: the agent created the FIFO there)
  if (!a.timer_file.empty() && std::none_of(inherited.begin(), inherited.end(), [](const std::string& kv) {
        return kv.starts_with(fmt::format("{}=", env_name::kTimerFile));
      }))
    set(env_name::kTimerFile, a.timer_file);
  // the progress file: read by the hang watch (--hang-timeout) and the straggler watch
  if (o.hang_timeout.count() > 0 || o.straggler_action != "off")
    set(env_name::kProgressFile, progress_file(a.attempt_dir, local).string());
  if (o.hang_timeout.count() > 0) {
    set(env_name::kStacksFile, python_stacks_file(a.attempt_dir, local).string());
    set(env_name::kStacksSignal, python_stacks_signal());
  }  // the watchdog finds the workers' descendants by it
  if (!a.events_file.empty()) set(env_name::kEventsFile, a.events_file);
  if (!a.node_socket.empty()) set(env_name::kNodeSocket, a.node_socket);
  if (a.memory_budget && !a.node_socket.empty()) set(env_name::kMemoryCheckpoints, std::to_string(*a.memory_budget));
  const bool omp_set = std::any_of(inherited.begin(), inherited.end(),
                                   [](const std::string& kv) { return kv.starts_with("OMP_NUM_THREADS="); });
  if (!omp_set && o.nproc_per_node > 1) set("OMP_NUM_THREADS", omp_threads_per_worker(a.cpus, o.nproc_per_node));
  for (const auto& [key, value] : collective_defaults(a.socket_ifname, inherited)) set(key, value);
  return env;
}

std::vector<WorkerSpec> worker_specs(const AttemptContext& a, const std::vector<std::string>& inherited) {
  const auto& o = a.options;
  std::vector<WorkerSpec> specs;
  for (int local = 0; local < o.nproc_per_node; ++local) {
    WorkerSpec s;
    s.local_rank = local;
    s.global_rank = a.round.rank_offset + local;
    s.path = a.program_path;
    s.argv = a.argv;
    // torchrun replaces ${local_rank} in the program's arguments; torch.distributed.launch also
    // passes --local-rank=N (--local_rank=N in 1.x) before them (--local-rank-arg)
    for (std::size_t i = 1; i < s.argv.size(); ++i) s.argv[i] = replace_all(s.argv[i], "${local_rank}", local);
    if (!o.local_rank_arg.empty())
      s.argv.insert(s.argv.begin() + static_cast<std::ptrdiff_t>(std::min(a.argv_program_end, s.argv.size())),
                    fmt::format("{}={}", o.local_rank_arg, local));
    s.console_prefix = console_prefix(o.log_line_prefix_template, s.global_rank, local, o.role, a.node_name);
    if (!o.numa_binding.empty()) {
      // next to the worker's (first) GPU when the topology says where it is, else the even spread
      const int per_worker = o.gpus_per_worker >= 1 ? o.gpus_per_worker : (o.virtual_local_rank ? 1 : 0);
      const auto gpu = a.gpus.size() == 0 ? a.gpu_cpus.size()
                       : per_worker > 0   ? static_cast<std::size_t>(local * per_worker)
                                          : static_cast<std::size_t>(local) % a.gpus.size();
      s.cpus = gpu < a.gpu_cpus.size() && !a.gpu_cpus[gpu].empty()
                   ? a.gpu_cpus[gpu]
                   : numa_cpus_for(local, o.nproc_per_node, a.numa_nodes);
    }
    const fs::path dir = a.attempt_dir / std::to_string(local);
    fs::create_directories(dir);
    s.error_file = (dir / "error.json").string();
    std::error_code ec;
    fs::remove(s.error_file, ec);
    fs::remove(progress_file(a.attempt_dir, local), ec);  // progress of an earlier run of this attempt number
    fs::remove(python_stacks_file(a.attempt_dir, local), ec);
    s.env = inherited;
    if (!a.events_file.empty())  // ours replaces one the user exported; without ours, the user's stays
      std::erase_if(s.env,
                    [](const std::string& kv) { return kv.starts_with(fmt::format("{}=", env_name::kEventsFile)); });
    auto ours = worker_variables(a, local, s.error_file, inherited);
    const auto is_visible_devices = [](const std::string& kv) { return kv.starts_with("CUDA_VISIBLE_DEVICES="); };
    if (std::any_of(ours.begin(), ours.end(), is_visible_devices))  // ours narrows it to this worker's GPUs
      std::erase_if(s.env, is_visible_devices);
    s.env.insert(s.env.end(), std::make_move_iterator(ours.begin()), std::make_move_iterator(ours.end()));

    const bool shown = !o.local_ranks_filter || o.local_ranks_filter->contains(local);
    const int redirect = o.log_dir.empty() ? 0 : o.redirects.for_rank(local);
    const int tee = o.log_dir.empty() ? 0 : o.tee.for_rank(local);
    s.console_stdout = shown && (!(redirect & 1) || (tee & 1));
    s.console_stderr = shown && (!(redirect & 2) || (tee & 2));
    if ((redirect | tee) & 1) s.stdout_file = (dir / "stdout.log").string();
    if ((redirect | tee) & 2) s.stderr_file = (dir / "stderr.log").string();
    // --duplicate-*-filters: as torchrun, only streams that are tee'd (file and console)
    if (!o.duplicate_stdout_filters.empty() && (tee & 1) && s.console_stdout) {
      s.stdout_filters = o.duplicate_stdout_filters;
      s.stdout_filtered_file = (a.attempt_dir / "filtered_stdout.log").string();
    }
    if (!o.duplicate_stderr_filters.empty() && (tee & 2) && s.console_stderr) {
      s.stderr_filters = o.duplicate_stderr_filters;
      s.stderr_filtered_file = (a.attempt_dir / "filtered_stderr.log").string();
    }
    specs.push_back(std::move(s));
  }
  return specs;
}

}  // namespace elastrun::launcher
