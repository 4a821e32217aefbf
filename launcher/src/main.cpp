// elastrun: the elastic agent. Verbs that are not programs to launch come first on the line:
//   elastrun env [--json]      the detected environment
//   elastrun --version
//   elastrun store-serve ...   the rendezvous store alone (spank_commands.cpp; srun --elastic)
//   elastrun [torchrun flags] PROGRAM [ARGS...]   the agent (agent.hpp)
#include <fmt/format.h>

#include <cstdlib>
#include <string_view>

#include "agent.hpp"
#include "env_command.hpp"

namespace elastrun::launcher {  // spank_commands.cpp: what the SPANK plugin (srun --elastic) runs
int run_store_serve(int argc, char** argv);
int run_spank_task(int argc, char** argv);
}  // namespace elastrun::launcher

#ifndef ELASTRUN_VERSION
#define ELASTRUN_VERSION "unknown"
#endif

int main(int argc, char** argv) {
  if (std::getenv("ELASTRUN_SPANK_PROGRAM")) return elastrun::launcher::run_spank_task(argc, argv);
  if (argc >= 2) {
    std::string_view verb = argv[1];
    if (verb == "store-serve") return elastrun::launcher::run_store_serve(argc - 1, argv + 1);
    if (verb == "env") return elastrun::launcher::run_env_command(argc - 1, argv + 1);
    if (verb == "--version" || verb == "-V") {
      fmt::print("elastrun {}\n", ELASTRUN_VERSION);
      return 0;
    }
  }
  return elastrun::launcher::run_agent(argc, argv);
}
