// elastrun: the elastic agent, and the few verbs that share its binary. The mode is chosen here,
// once, in this order:
//   1. a task of an `srun --elastic` step (spank_commands.hpp): the SPANK plugin replaced the
//      task's argv[0] with this binary and put the user's program in ELASTRUN_SPANK_PROGRAM, so
//      argv holds the *user's* arguments, which must not be read as our verbs;
//   2. a verb first on the line: `env [--json]` (env_command.hpp), `store-serve ...`
//      (spank_commands.hpp), `job-dir` and `job-step COMMAND...` (job_dir.hpp), `node-status [ADDRESS]`
//      (node_endpoint.hpp), the job CLI's `run|status|log|cancel|list|describe` (jobs/), `--version`;
//   3. otherwise the agent: `elastrun [torchrun flags] PROGRAM [ARGS...]` (agent.hpp); `elastrun --
//      run ...` runs a program called like a verb.
#include <fmt/format.h>

#include <cstdlib>
#include <string_view>

#include "agent.hpp"
#include "env_command.hpp"
#include "job_cli.hpp"
#include "job_dir.hpp"
#include "node_endpoint.hpp"
#include "spank_commands.hpp"

#ifndef ELASTRUN_VERSION
#define ELASTRUN_VERSION "unknown"
#endif

int main(int argc, char** argv) {
  namespace launcher = elastrun::launcher;
  if (std::getenv("ELASTRUN_SPANK_PROGRAM")) return launcher::run_spank_task(argc, argv);
  if (argc >= 2) {
    const std::string_view verb = argv[1];
    if (verb == "store-serve") return launcher::run_store_serve(argc - 1, argv + 1);
    if (verb == "env") return launcher::run_env_command(argc - 1, argv + 1);
    if (verb == "job-dir") return launcher::run_job_dir_command(argc - 1, argv + 1);
    if (verb == "job-step") return launcher::run_job_step_command(argc - 1, argv + 1);
    if (verb == "node-status") return launcher::run_node_status_command(argc - 1, argv + 1);
    if (elastrun::jobs::is_job_verb(verb)) return elastrun::jobs::run_job_verb(argc - 1, argv + 1);
    if (verb == "--version" || verb == "-V") {
      fmt::print("elastrun {}\n", ELASTRUN_VERSION);
      return 0;
    }
  }
  return launcher::run_agent(argc, argv);
}
