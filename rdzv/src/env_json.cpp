#include "elastrun/rdzv/env_json.hpp"

#include "elastrun/rdzv/hostlist.hpp"

namespace elastrun::rdzv {
namespace {

template <typename T>
nlohmann::json opt(const std::optional<T>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

nlohmann::json slurm_json(const SlurmEnv& s) {
  nlohmann::json het = nlohmann::json::array();
  for (const auto& c : s.het_components)
    het.push_back({{"index", c.index},
                   {"job_id", c.job_id},
                   {"nodes", c.nodes},
                   {"tasks_per_node", c.tasks_per_node},
                   {"ntasks", c.ntasks},
                   {"task_offset", c.task_offset},
                   {"node_offset", c.node_offset}});
  return {{"job_id", s.job_id},
          {"step_id", opt(s.step_id)},
          {"proc_id", opt(s.proc_id)},
          {"local_id", opt(s.local_id)},
          {"node_id", opt(s.node_id)},
          {"ntasks", s.ntasks},
          {"nodes", s.nodes},
          {"nodelist", compress_hostlist(s.nodes)},
          {"job_nodes", s.job_nodes},
          {"tasks_per_node", s.tasks_per_node},
          {"restart_count", s.restart_count},
          {"node_name", s.node_name},
          {"cluster_name", s.cluster_name},
          {"het_size", s.het_size},
          {"het_component", s.het_component},
          {"het_components", het}};
}

}  // namespace

nlohmann::json to_json(const DetectedEnv& d) {
  const auto& p = d.placement;
  nlohmann::json j{{"source", std::string(to_string(p.source))},
                   {"rank", p.rank},
                   {"world_size", p.world_size},
                   {"local_rank", p.local_rank},
                   {"local_world_size", p.local_world_size},
                   {"node_rank", p.node_rank},
                   {"num_nodes", p.num_nodes},
                   {"hostname", d.hostname},
                   {"run_id", d.run_id},
                   {"slurm", d.slurm ? slurm_json(*d.slurm) : nlohmann::json(nullptr)},
                   {"pet_overrides", d.pet_overrides}};
  nlohmann::json mpi = nlohmann::json::object();
  for (const auto& m : d.mpi)
    mpi[m.kind] = {{"rank", opt(m.rank)},
                   {"size", opt(m.size)},
                   {"local_rank", opt(m.local_rank)},
                   {"local_size", opt(m.local_size)},
                   {"namespace", m.nspace}};
  j["mpi"] = mpi;
  if (d.torch) {
    const auto& t = *d.torch;
    j["torch"] = {{"rank", t.rank},
                  {"world_size", t.world_size},
                  {"local_rank", opt(t.local_rank)},
                  {"local_world_size", opt(t.local_world_size)},
                  {"group_rank", opt(t.group_rank)},
                  {"master_addr", t.master_addr},
                  {"master_port", opt(t.master_port)},
                  {"run_id", t.run_id}};
  } else {
    j["torch"] = nullptr;
  }
  if (d.rdzv_endpoint)
    j["rdzv_endpoint"] = {{"host", d.rdzv_endpoint->host},
                          {"port", d.rdzv_endpoint->port},
                          {"fallback_ports", d.rdzv_endpoint->fallback_ports}};
  else
    j["rdzv_endpoint"] = nullptr;
  return j;
}

}  // namespace elastrun::rdzv
