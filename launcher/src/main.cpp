// elastrun: the elastic agent. Verbs that are not programs to launch come first on the line:
//   elastrun env [--json]      the detected environment
//   elastrun --version
//   elastrun [torchrun flags] PROGRAM [ARGS...]   the agent (agent.hpp)
#include <fmt/format.h>

#include <string_view>

#include "agent.hpp"
#include "env_command.hpp"

#ifndef ELASTRUN_VERSION
#define ELASTRUN_VERSION "unknown"
#endif

int main(int argc, char** argv) {
  if (argc >= 2) {
    std::string_view verb = argv[1];
    if (verb == "env") return elastrun::launcher::run_env_command(argc - 1, argv + 1);
    if (verb == "--version" || verb == "-V") {
      fmt::print("elastrun {}\n", ELASTRUN_VERSION);
      return 0;
    }
  }
  return elastrun::launcher::run_agent(argc, argv);
}
