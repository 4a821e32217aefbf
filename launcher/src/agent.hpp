// The elastic agent: `elastrun [torchrun flags] PROGRAM [ARGS...]`.
// States (named in code and logs): RENDEZVOUS -> START_WORKERS -> MONITOR ->
//   SUCCEEDED | FAILED -> RESTART -> RENDEZVOUS | MEMBERSHIP_CHANGED -> RENDEZVOUS.
// See docs/launcher.md.
#pragma once

namespace elastrun::launcher {

// Parses the command line and runs the agent. Returns the process exit code:
// 0 success, 1 failure (workers failed past --max-restarts, rendezvous error), 2 bad command
// line, 128+N stopped by signal N.
int run_agent(int argc, char** argv);

}  // namespace elastrun::launcher
