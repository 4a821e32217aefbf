// Environment detection: Slurm (incl. heterogeneous steps), Open MPI, PMIx, PMI2, torchrun.
#include "elastrun/rdzv/env.hpp"
#include "elastrun/util/parse.hpp"
#include "elastrun/worker/contract.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <numeric>
#include <string>

extern char** environ;

namespace elastrun::rdzv {
namespace torch_var = contract::env;  // the torch variables: the worker contract's names
namespace {

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw EnvError(fmt::format(format, std::forward<Args>(args)...));
}

std::optional<std::string_view> lookup(const EnvMap& env, std::string_view name) {
  auto it = env.find(name);
  if (it == env.end()) return std::nullopt;
  return std::string_view(it->second);
}

// First present variable among `names` (Slurm kept several spellings over the years).
std::optional<std::pair<std::string_view, std::string_view>> lookup_any(const EnvMap& env,
                                                                        std::initializer_list<std::string_view> names) {
  for (auto name : names)
    if (auto v = lookup(env, name)) return std::pair{name, *v};
  return std::nullopt;
}

std::optional<std::uint64_t> parse_u64(std::string_view text) { return util::parse_integer<std::uint64_t>(text); }

int to_int(std::string_view name, std::string_view text) {
  auto value = parse_u64(text);
  if (!value || *value > static_cast<std::uint64_t>(INT_MAX))
    fail("{}='{}' is not a non-negative integer; unset it or fix the launcher that set it", name, text);
  return static_cast<int>(*value);
}

std::optional<int> int_var(const EnvMap& env, std::string_view name) {
  if (auto v = lookup(env, name)) return to_int(name, *v);
  return std::nullopt;
}

std::optional<int> int_var_any(const EnvMap& env, std::initializer_list<std::string_view> names) {
  if (auto v = lookup_any(env, names)) return to_int(v->first, v->second);
  return std::nullopt;
}

std::vector<std::string> expand_or_throw(const HostlistExpander& expand, std::string_view name,
                                         std::string_view expression) {
  if (auto n = hostlist_size(expression); n && *n > kMaxHostlistNodes)
    fail("{}='{}' names more than {} nodes; elastrun refuses to expand it (fix or unset it)", name,
         expression.substr(0, 80), kMaxHostlistNodes);
  auto hosts = expand(expression);
  if (!hosts || hosts->empty())
    fail("{}='{}' is not a valid Slurm hostlist (e.g. n[1-4],gpu01); fix or unset it", name, expression);
  return *hosts;
}

std::vector<int> tasks_or_throw(std::string_view name, std::string_view spec) {
  try {
    return parse_tasks_per_node(spec);
  } catch (const std::invalid_argument& e) {
    fail("{}='{}' cannot be parsed ({}); expected a form like 2(x3),1", name, spec, e.what());
  }
}

void require_below(std::string_view name, int value, std::string_view bound_name, int bound, std::string_view hint) {
  if (value >= bound) fail("{}={} is not below {}={}; {}", name, value, bound_name, bound, hint);
}

constexpr std::string_view kStaleHint =
    "the Slurm environment is inconsistent (stale SLURM_* variables from another job?) - run "
    "inside srun/sbatch or unset them";

// ---- heterogeneous jobs --------------------------------------------------------------------

// Slurm names per-component variables <NAME>_HET_GROUP_<n>; before 20.02 it was _PACK_GROUP_<n>.
std::optional<std::pair<std::string, std::string_view>> het_var(const EnvMap& env, std::string_view base, int group) {
  for (std::string_view kind : {"HET", "PACK"}) {
    std::string name = std::string(base) + "_" + std::string(kind) + "_GROUP_" + std::to_string(group);
    if (auto v = lookup(env, name)) return std::pair{name, *v};
  }
  return std::nullopt;
}

void detect_het(const EnvMap& env, const HostlistExpander& expand, SlurmEnv& s) {
  auto size_var = lookup_any(env, {"SLURM_HET_SIZE", "SLURM_PACK_SIZE"});
  if (!size_var) return;
  s.het_size = to_int(size_var->first, size_var->second);
  if (s.het_size <= 1) return;

  // Slurm 22.05 (verified on the testbed): a heterogeneous step has global SLURM_PROCID,
  // SLURM_NODEID, SLURM_STEP_NODELIST and SLURM_STEP_TASKS_PER_NODE spanning its components,
  // while each component's allocation is only described by the job-level
  // SLURM_{JOB_ID,JOB_NODELIST,NTASKS,TASKS_PER_NODE}_HET_GROUP_<n>. A step may use a subset
  // of the components (srun --het-group=1); those whose nodes are in the step take part, in
  // component order, and their ranks follow each other.
  auto index_of = [&](const std::string& host) {
    auto it = std::find(s.nodes.begin(), s.nodes.end(), host);
    return it == s.nodes.end() ? -1 : static_cast<int>(it - s.nodes.begin());
  };
  int task_offset = 0;
  for (int g = 0; g < s.het_size; ++g) {
    auto nodelist = het_var(env, "SLURM_JOB_NODELIST", g);
    if (!nodelist) continue;
    HetComponent c;
    c.index = g;
    if (auto id = het_var(env, "SLURM_JOB_ID", g)) c.job_id = std::string(id->second);
    c.nodes = expand_or_throw(expand, nodelist->first, nodelist->second);
    bool in_step = true;
    for (const auto& host : c.nodes) in_step = in_step && index_of(host) >= 0;
    if (s.step_id && !in_step) continue;
    if (s.step_id && !s.tasks_per_node.empty()) {
      for (const auto& host : c.nodes) c.tasks_per_node.push_back(s.tasks_per_node[index_of(host)]);
    } else if (auto tpn = het_var(env, "SLURM_TASKS_PER_NODE", g)) {
      c.tasks_per_node = tasks_or_throw(tpn->first, tpn->second);
      if (c.tasks_per_node.size() != c.nodes.size())
        fail("{}='{}' describes {} nodes but {} names {}; {}", tpn->first, tpn->second, c.tasks_per_node.size(),
             nodelist->first, c.nodes.size(), kStaleHint);
    }
    if (!c.tasks_per_node.empty())
      c.ntasks = std::accumulate(c.tasks_per_node.begin(), c.tasks_per_node.end(), 0);
    else if (auto n = het_var(env, "SLURM_NTASKS", g))
      c.ntasks = to_int(n->first, n->second);
    c.node_offset = s.step_id ? index_of(c.nodes.front()) : 0;
    c.task_offset = task_offset;
    task_offset += c.ntasks;
    s.het_components.push_back(std::move(c));
  }
  if (s.het_components.empty())
    fail("{}={} but no SLURM_JOB_NODELIST_HET_GROUP_<n> matches the step's nodes; {}", size_var->first,
         size_var->second, kStaleHint);
  if (s.proc_id && s.step_id) {
    for (const auto& c : s.het_components)
      if (*s.proc_id >= c.task_offset && *s.proc_id < c.task_offset + c.ntasks) s.het_component = c.index;
  } else if (!s.job_nodes.empty()) {
    // A batch script runs in component 0's allocation.
    for (const auto& c : s.het_components)
      if (c.nodes == s.job_nodes) s.het_component = c.index;
  }
}

// ---- Slurm ---------------------------------------------------------------------------------

std::optional<SlurmEnv> detect_slurm(const EnvMap& env, const HostlistExpander& expand) {
  auto job = lookup_any(env, {"SLURM_JOB_ID", "SLURM_JOBID"});
  if (!job) {
    for (auto name : {"SLURM_PROCID", "SLURM_NODEID", "SLURM_STEP_ID", "SLURM_LOCALID"})
      if (lookup(env, name)) fail("{} is set but SLURM_JOB_ID is not; {}", name, kStaleHint);
    return std::nullopt;
  }
  SlurmEnv s;
  s.job_id = std::string(job->second);
  if (!parse_u64(s.job_id)) fail("{}='{}' is not a job id; unset it or run inside srun/sbatch", job->first, s.job_id);
  if (auto step = lookup_any(env, {"SLURM_STEP_ID", "SLURM_STEPID"})) s.step_id = std::string(step->second);
  s.proc_id = int_var(env, "SLURM_PROCID");
  s.local_id = int_var(env, "SLURM_LOCALID");
  s.node_id = int_var(env, "SLURM_NODEID");
  s.restart_count = int_var(env, "SLURM_RESTART_COUNT").value_or(0);
  if (auto v = lookup(env, "SLURMD_NODENAME")) s.node_name = std::string(*v);
  if (auto v = lookup(env, "SLURM_CLUSTER_NAME")) s.cluster_name = std::string(*v);
  if (auto v = lookup(env, "SLURM_SUBMIT_DIR")) s.submit_dir = std::string(*v);

  if (auto v = lookup_any(env, {"SLURM_JOB_NODELIST", "SLURM_NODELIST"}))
    s.job_nodes = expand_or_throw(expand, v->first, v->second);

  // Inside a step the step's variables describe our peers; in a batch script or salloc shell
  // only the job's variables exist.
  std::optional<std::pair<std::string_view, std::string_view>> nodelist, tpn, ntasks, nnodes;
  if (s.step_id) {
    nodelist = lookup_any(env, {"SLURM_STEP_NODELIST"});
    tpn = lookup_any(env, {"SLURM_STEP_TASKS_PER_NODE"});
    ntasks = lookup_any(env, {"SLURM_STEP_NUM_TASKS"});
    nnodes = lookup_any(env, {"SLURM_STEP_NUM_NODES"});
  }
  if (!nodelist) nodelist = lookup_any(env, {"SLURM_JOB_NODELIST", "SLURM_NODELIST"});
  if (!tpn) tpn = lookup_any(env, {"SLURM_TASKS_PER_NODE"});
  if (!ntasks) ntasks = lookup_any(env, {"SLURM_NTASKS", "SLURM_NPROCS"});
  if (!nnodes) nnodes = lookup_any(env, {"SLURM_NNODES", "SLURM_JOB_NUM_NODES"});

  if (!nodelist) {
    if (s.node_id)
      fail("SLURM_NODEID is set but no node list (SLURM_STEP_NODELIST/SLURM_JOB_NODELIST) is; {}", kStaleHint);
    fail("{} is set but SLURM_JOB_NODELIST is not; {}", job->first, kStaleHint);
  }
  s.nodes = s.job_nodes.empty() || nodelist->first != "SLURM_JOB_NODELIST"
                ? expand_or_throw(expand, nodelist->first, nodelist->second)
                : s.job_nodes;
  const int node_count = static_cast<int>(s.nodes.size());
  if (nnodes) {
    int n = to_int(nnodes->first, nnodes->second);
    if (n != node_count)
      fail("{}={} but {}='{}' names {} nodes; {}", nnodes->first, n, nodelist->first, nodelist->second, node_count,
           kStaleHint);
  }
  if (tpn) {
    s.tasks_per_node = tasks_or_throw(tpn->first, tpn->second);
    if (static_cast<int>(s.tasks_per_node.size()) != node_count)
      fail("{}='{}' describes {} nodes but {} names {}; {}", tpn->first, tpn->second, s.tasks_per_node.size(),
           nodelist->first, node_count, kStaleHint);
  }
  const int tpn_sum = std::accumulate(s.tasks_per_node.begin(), s.tasks_per_node.end(), 0);
  if (ntasks) {
    s.ntasks = to_int(ntasks->first, ntasks->second);
    if (tpn && tpn_sum != s.ntasks)
      fail("{}={} but {}='{}' sums to {}; {}", ntasks->first, s.ntasks, tpn->first, tpn->second, tpn_sum, kStaleHint);
  } else {
    s.ntasks = tpn ? tpn_sum : node_count;
  }

  if (s.proc_id) require_below("SLURM_PROCID", *s.proc_id, ntasks ? ntasks->first : "tasks", s.ntasks, kStaleHint);
  if (s.node_id) {
    require_below("SLURM_NODEID", *s.node_id, fmt::format("{} count", nodelist->first), node_count, kStaleHint);
    if (!s.node_name.empty() && s.nodes[*s.node_id] != s.node_name)
      fail("SLURMD_NODENAME={} but SLURM_NODEID={} names '{}' in {}; {}", s.node_name, *s.node_id, s.nodes[*s.node_id],
           nodelist->first, kStaleHint);
    if (s.local_id && !s.tasks_per_node.empty())
      require_below("SLURM_LOCALID", *s.local_id, "tasks on this node", s.tasks_per_node[*s.node_id], kStaleHint);
  }
  detect_het(env, expand, s);
  return s;
}

// ---- MPI launchers -------------------------------------------------------------------------

std::vector<MpiEnv> detect_mpi(const EnvMap& env) {
  std::vector<MpiEnv> found;
  if (auto rank = int_var(env, "OMPI_COMM_WORLD_RANK")) {
    MpiEnv m{.kind = "openmpi",
             .rank = rank,
             .size = int_var(env, "OMPI_COMM_WORLD_SIZE"),
             .local_rank = int_var(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
             .local_size = int_var(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
             .nspace = {}};
    if (!m.size)
      throw EnvError(
          "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not; run under mpirun "
          "or unset the OMPI_COMM_WORLD_* variables");
    require_below("OMPI_COMM_WORLD_RANK", *m.rank, "OMPI_COMM_WORLD_SIZE", *m.size,
                  "fix the launcher or unset the OMPI_COMM_WORLD_* variables");
    if (m.local_rank && m.local_size)
      require_below("OMPI_COMM_WORLD_LOCAL_RANK", *m.local_rank, "OMPI_COMM_WORLD_LOCAL_SIZE", *m.local_size,
                    "fix the launcher or unset the OMPI_COMM_WORLD_* variables");
    found.push_back(std::move(m));
  }
  if (auto rank = int_var(env, "PMIX_RANK")) {
    MpiEnv m{.kind = "pmix",
             .rank = rank,
             .size = std::nullopt,
             .local_rank = std::nullopt,
             .local_size = std::nullopt,
             .nspace = {}};
    if (auto ns = lookup(env, "PMIX_NAMESPACE")) m.nspace = std::string(*ns);
    found.push_back(std::move(m));
  }
  if (auto rank = int_var(env, "PMI_RANK")) {
    MpiEnv m{.kind = "pmi2",
             .rank = rank,
             .size = int_var(env, "PMI_SIZE"),
             .local_rank = std::nullopt,
             .local_size = std::nullopt,
             .nspace = {}};
    if (auto id = lookup(env, "PMI_JOBID")) m.nspace = std::string(*id);
    if (m.size) require_below("PMI_RANK", *m.rank, "PMI_SIZE", *m.size, "fix the launcher or unset PMI_RANK/PMI_SIZE");
    found.push_back(std::move(m));
  }
  return found;
}

const MpiEnv* find_mpi(const std::vector<MpiEnv>& mpi, std::string_view kind) {
  for (const auto& m : mpi)
    if (m.kind == kind) return &m;
  return nullptr;
}

// ---- torchrun ------------------------------------------------------------------------------

std::optional<TorchEnv> detect_torch(const EnvMap& env) {
  auto rank = int_var(env, torch_var::kRank);
  auto world = int_var(env, torch_var::kWorldSize);
  if (!rank && !world) return std::nullopt;
  if (!rank || !world)
    fail("{} is set but {} is not; set both (torch.distributed env:// needs them) or neither",
         rank ? "RANK" : "WORLD_SIZE", rank ? "WORLD_SIZE" : "RANK");
  TorchEnv t;
  t.rank = *rank;
  t.world_size = *world;
  require_below(torch_var::kRank, t.rank, torch_var::kWorldSize, t.world_size, "fix or unset RANK/WORLD_SIZE");
  t.local_rank = int_var(env, torch_var::kLocalRank);
  t.local_world_size = int_var(env, torch_var::kLocalWorldSize);
  if (t.local_rank && t.local_world_size)
    require_below(torch_var::kLocalRank, *t.local_rank, torch_var::kLocalWorldSize, *t.local_world_size,
                  "fix or unset LOCAL_RANK/LOCAL_WORLD_SIZE");
  t.group_rank = int_var_any(env, {torch_var::kGroupRank, torch_var::kNodeRank});
  if (auto v = lookup(env, torch_var::kMasterAddr)) t.master_addr = std::string(*v);
  t.master_port = int_var(env, torch_var::kMasterPort);
  if (t.master_port && (*t.master_port == 0 || *t.master_port > 65535))
    fail("MASTER_PORT={} is not a TCP port (1-65535); fix or unset it", *t.master_port);
  if (auto v = lookup(env, torch_var::kRunId)) t.run_id = std::string(*v);
  return t;
}

std::map<std::string, std::string> detect_pet(const EnvMap& env) {
  // torchrun reads PET_<FLAG> for every flag (PET_NNODES, PET_RDZV_ENDPOINT, ...).
  std::map<std::string, std::string> out;
  for (auto it = env.lower_bound("PET_"); it != env.end() && it->first.starts_with("PET_"); ++it) {
    std::string flag = it->first.substr(4);
    std::transform(flag.begin(), flag.end(), flag.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (!flag.empty()) out[flag] = it->second;
  }
  return out;
}

Placement place_from_slurm(const SlurmEnv& s) {
  Placement p;
  p.source = RankSource::Slurm;
  if (!s.step_id) {
    // A batch script or salloc shell is one process, not a member of a parallel step.
    p.rank = 0;
    p.world_size = 1;
    p.node_rank = s.node_id.value_or(0);
    p.num_nodes = static_cast<int>(s.nodes.size());
    return p;
  }
  p.rank = s.proc_id.value_or(0);
  p.world_size = s.ntasks;
  p.local_rank = s.local_id.value_or(0);
  p.node_rank = s.node_id.value_or(0);
  p.num_nodes = static_cast<int>(s.nodes.size());
  p.local_world_size = s.tasks_per_node.empty() ? 1 : s.tasks_per_node[p.node_rank];
  return p;
}

}  // namespace

EnvMap current_environment() {
  EnvMap env;
  for (char** e = environ; e && *e; ++e) {
    std::string_view entry(*e);
    auto eq = entry.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(entry.substr(0, eq)), std::string(entry.substr(eq + 1)));
  }
  return env;
}

std::vector<int> parse_tasks_per_node(std::string_view spec) {
  std::vector<int> out;
  if (spec.empty()) throw std::invalid_argument("empty");
  std::size_t pos = 0;
  while (pos <= spec.size()) {
    auto comma = spec.find(',', pos);
    auto item = spec.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
    auto paren = item.find('(');
    auto count_text = item.substr(0, paren);
    auto count = parse_u64(count_text);
    if (!count || *count > 1'000'000) throw std::invalid_argument("bad count '" + std::string(item) + "'");
    std::uint64_t repeat = 1;
    if (paren != std::string_view::npos) {
      auto rest = item.substr(paren);
      if (rest.size() < 4 || rest.substr(0, 2) != "(x" || rest.back() != ')')
        throw std::invalid_argument("bad repetition '" + std::string(item) + "'");
      auto r = parse_u64(rest.substr(2, rest.size() - 3));
      if (!r || *r == 0 || *r > 1'000'000) throw std::invalid_argument("bad repetition '" + std::string(item) + "'");
      repeat = *r;
    }
    if (out.size() + repeat > 1'000'000) throw std::invalid_argument("too many nodes");
    out.insert(out.end(), repeat, static_cast<int>(*count));
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return out;
}

std::string_view to_string(RankSource source) {
  switch (source) {
    case RankSource::Torchrun: return "torchrun";
    case RankSource::OpenMPI: return "openmpi";
    case RankSource::Slurm: return "slurm";
    case RankSource::PMI2: return "pmi2";
    case RankSource::Standalone: return "standalone";
  }
  return "unknown";
}

Endpoint propose_endpoint(std::string_view host, std::uint64_t job_id, std::uint64_t step) {
  Endpoint e;
  e.host = std::string(host);
  // 32 consecutive steps of one job get distinct ports; consecutive jobs are 32 apart.
  const std::uint64_t slot = (job_id * 32 + step % 32) % kPortSpan;
  e.port = static_cast<std::uint16_t>(kPortBase + slot);
  for (int i = 1; i <= kPortFallbacks; ++i)
    e.fallback_ports.push_back(static_cast<std::uint16_t>(kPortBase + (slot + i) % kPortSpan));
  return e;
}

std::optional<std::uint64_t> hostlist_size(std::string_view text) {
  constexpr std::uint64_t cap = kMaxHostlistNodes + 1;
  std::uint64_t total = 0, term = 1;
  bool in_term = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == ',') {  // a comma outside brackets ends a term
      if (in_term) total = std::min(cap, total + term);
      term = 1, in_term = false;
    } else if (c == '[') {
      const auto close = text.find(']', i);
      if (close == std::string_view::npos) return std::nullopt;
      std::uint64_t names = 0;
      for (auto range : util::split_list(text.substr(i + 1, close - i - 1))) {
        const auto dash = range.find('-');
        auto lo = util::parse_integer<std::uint64_t>(range.substr(0, dash));
        auto hi = dash == std::string_view::npos ? lo : util::parse_integer<std::uint64_t>(range.substr(dash + 1));
        if (!lo || !hi || *hi < *lo) return std::nullopt;
        names = std::min(cap, names + (*hi - *lo + 1));
      }
      term = std::min(cap, term * std::max<std::uint64_t>(names, 1));
      in_term = true;
      i = close;
    } else if (c == ']') {
      return std::nullopt;
    } else if (c != ' ') {
      in_term = true;
    }
  }
  if (in_term) total = std::min(cap, total + term);
  return total;
}

DetectedEnv detect_environment(const EnvMap& env, const HostlistExpander& expand_hostlist) {
  DetectedEnv d;
  if (auto h = lookup(env, "HOSTNAME")) d.hostname = std::string(*h);
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) == 0) d.hostname = buf;

  d.slurm = detect_slurm(env, expand_hostlist);
  d.mpi = detect_mpi(env);
  d.torch = detect_torch(env);
  d.pet_overrides = detect_pet(env);

  if (d.torch) {
    auto& t = *d.torch;
    d.placement = {.source = RankSource::Torchrun,
                   .rank = t.rank,
                   .world_size = t.world_size,
                   .local_rank = t.local_rank.value_or(0),
                   .local_world_size = t.local_world_size.value_or(1),
                   .node_rank = t.group_rank.value_or(0),
                   .num_nodes = int_var(env, torch_var::kGroupWorldSize).value_or(1)};
  } else if (const auto* ompi = find_mpi(d.mpi, "openmpi")) {
    Placement p;
    p.source = RankSource::OpenMPI;
    p.rank = *ompi->rank;
    p.world_size = *ompi->size;
    p.local_rank = ompi->local_rank.value_or(0);
    p.local_world_size = ompi->local_size.value_or(1);
    // Open MPI exports no node index; with the default by-slot mapping and equal node sizes
    // rank / local_size is the node index.
    p.node_rank = p.rank / std::max(1, p.local_world_size);
    p.num_nodes = (p.world_size + p.local_world_size - 1) / std::max(1, p.local_world_size);
    d.placement = p;
  } else if (d.slurm) {
    d.placement = place_from_slurm(*d.slurm);
    // srun --mpi=pmix|pmi2 sets both; they must agree or one of them is stale.
    if (d.slurm->step_id)
      for (const auto& m : d.mpi)
        if (*m.rank != d.placement.rank)
          fail("{}={} but SLURM_PROCID={}; {}", m.kind == "pmix" ? "PMIX_RANK" : "PMI_RANK", *m.rank, d.placement.rank,
               kStaleHint);
  } else if (const auto* pmi = find_mpi(d.mpi, "pmi2"); pmi && pmi->size) {
    d.placement = {.source = RankSource::PMI2,
                   .rank = *pmi->rank,
                   .world_size = *pmi->size,
                   .local_rank = 0,
                   .local_world_size = 1,
                   .node_rank = *pmi->rank,
                   .num_nodes = *pmi->size};
  } else if (!d.mpi.empty()) {
    const auto& m = d.mpi.front();
    fail("{}", m.kind == "pmix" ? "PMIX_RANK is set but the world size is unknown outside Slurm/mpirun; set "
                                  "WORLD_SIZE and RANK, or launch with srun --mpi=pmix"
                                : "PMI_RANK is set but PMI_SIZE is not; fix the launcher or unset PMI_RANK");
  }

  if (d.slurm) {
    const auto& s = *d.slurm;
    d.run_id = format_run_id(s.job_id, std::nullopt, std::to_string(s.restart_count));
    // The rendezvous host is the first node of the whole (possibly heterogeneous) step.
    const std::string& first = s.het_components.empty() ? s.nodes.front() : s.het_components.front().nodes.front();
    std::uint64_t step = 0;
    if (s.step_id) step = parse_u64(*s.step_id).value_or(0);
    d.rdzv_endpoint = propose_endpoint(first, *parse_u64(s.job_id), step);
  }
  if (d.torch && !d.torch->run_id.empty()) d.run_id = d.torch->run_id;
  return d;
}

std::string format_run_id(std::string_view job_id, std::optional<std::string_view> step_id, std::string_view restarts) {
  if (restarts.empty()) restarts = "0";
  if (step_id) return fmt::format("{}.{}.r{}", job_id, *step_id, restarts);
  return fmt::format("{}.r{}", job_id, restarts);
}

}  // namespace elastrun::rdzv
