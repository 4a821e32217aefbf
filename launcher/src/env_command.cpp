#include "env_command.hpp"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iostream>

#include "elastrun/rdzv/env.hpp"
#include "elastrun/rdzv/env_json.hpp"
#include "elastrun/rdzv/hostlist.hpp"

namespace elastrun::launcher {
namespace {

void print_human(const rdzv::DetectedEnv& d) {
  const auto& p = d.placement;
  fmt::print("{:<16}{}\n", "source", rdzv::to_string(p.source));
  fmt::print("{:<16}{} of {}\n", "rank", p.rank, p.world_size);
  fmt::print("{:<16}{} of {}\n", "local rank", p.local_rank, p.local_world_size);
  fmt::print("{:<16}{} of {}\n", "node rank", p.node_rank, p.num_nodes);
  fmt::print("{:<16}{}\n", "hostname", d.hostname);
  if (!d.run_id.empty()) fmt::print("{:<16}{}\n", "run id", d.run_id);
  if (d.slurm) {
    const auto& s = *d.slurm;
    fmt::print("{:<16}job {} step {} on {} ({} tasks: {}) restart {}\n", "slurm", s.job_id, s.step_id.value_or("-"),
               rdzv::compress_hostlist(s.nodes), s.ntasks, fmt::join(s.tasks_per_node, ","), s.restart_count);
    for (const auto& c : s.het_components)
      fmt::print("{:<16}component {} job {} on {}: {} tasks from rank {}, nodes from {}\n", "het", c.index, c.job_id,
                 rdzv::compress_hostlist(c.nodes), c.ntasks, c.task_offset, c.node_offset);
  }
  for (const auto& m : d.mpi)
    fmt::print("{:<16}{} rank {} size {} {}\n", "mpi", m.kind, m.rank ? std::to_string(*m.rank) : "-",
               m.size ? std::to_string(*m.size) : "-", m.nspace);
  if (d.torch)
    fmt::print("{:<16}RANK {} WORLD_SIZE {} MASTER {}:{}\n", "torch", d.torch->rank, d.torch->world_size,
               d.torch->master_addr, d.torch->master_port ? std::to_string(*d.torch->master_port) : "-");
  if (d.rdzv_endpoint)
    fmt::print("{:<16}{}:{} (fallback ports {})\n", "rdzv endpoint", d.rdzv_endpoint->host, d.rdzv_endpoint->port,
               fmt::join(d.rdzv_endpoint->fallback_ports, ","));
  for (const auto& [flag, value] : d.pet_overrides) fmt::print("{:<16}--{}={}\n", "PET override", flag, value);
}

}  // namespace

int run_env_command(int argc, char** argv) {
  CLI::App app{
      "Print what elastrun detects from the environment (Slurm, het jobs, PMI/PMIx, "
      "Open MPI, torchrun variables).",
      "elastrun env"};
  bool json = false;
  app.add_flag("--json", json, "Machine-readable output (keys in docs/environment.md)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    auto detected = rdzv::detect_environment(rdzv::current_environment(), rdzv::expand_hostlist);
    if (json)
      std::cout << rdzv::to_json(detected).dump() << '\n';
    else
      print_human(detected);
    return 0;
  } catch (const rdzv::EnvError& e) {
    fmt::print(stderr, "elastrun: error: {}\n", e.what());
    return 1;
  }
}

}  // namespace elastrun::launcher
