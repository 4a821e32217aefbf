// elastrun: the elastic agent. Verbs that are not programs to launch come first on the line.
#include <fmt/format.h>

#include <cstring>
#include <string_view>

#include "env_command.hpp"

#ifndef ELASTRUN_VERSION
#define ELASTRUN_VERSION "unknown"
#endif

namespace {

constexpr std::string_view kUsage =
    "usage: elastrun env [--json]          print the detected Slurm/MPI/torch environment\n"
    "       elastrun --version\n"
    "(the elastic agent, `elastrun [torchrun flags] prog args`, is not part of this build yet)\n";

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2) {
    std::string_view verb = argv[1];
    if (verb == "env") return elastrun::launcher::run_env_command(argc - 1, argv + 1);
    if (verb == "--version" || verb == "-V") {
      fmt::print("elastrun {}\n", ELASTRUN_VERSION);
      return 0;
    }
    if (verb == "--help" || verb == "-h") {
      fmt::print("{}", kUsage);
      return 0;
    }
  }
  fmt::print(stderr, "elastrun: error: unknown command line; run 'elastrun --help'\n{}", kUsage);
  return 2;
}
