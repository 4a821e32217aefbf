#pragma once

namespace elastrun::launcher {

// `elastrun env [--json]`: print what the environment says about this process and its peers.
int run_env_command(int argc, char** argv);

}  // namespace elastrun::launcher
