// What the SPANK plugin (spank_plugin/, `srun --elastic`) runs this binary for; see
// spank_commands.cpp for the protocol between the plugin and these two entry points.
#pragma once

namespace elastrun::launcher {

// `elastrun store-serve ...`: the rendezvous store alone, forked by the plugin from srun.
int run_store_serve(int argc, char** argv);

// A task of an `srun --elastic` step: ELASTRUN_SPANK_PROGRAM and ELASTRUN_SPANK_AGENT_ARGS
// (set by the plugin's task_init) rebuild `elastrun FLAGS... PROGRAM ARGS...`; runs the agent.
int run_spank_task(int argc, char** argv);

}  // namespace elastrun::launcher
