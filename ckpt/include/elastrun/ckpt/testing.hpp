// Fault injection for tests of programs that use the checkpoint library (e.g. the fault suite's
// trainer parks a save mid-commit and kills itself there). Not for production code.
//
// The named points, in save order: "async.snapshot" (AsyncSaver::save, before the snapshot),
// "async.fork_child" (in the fork snapshot's child), "commit.before_publish" (rank 0, every
// shard written and voted, before the step directory is renamed into place),
// "commit.between_renames", "commit.published", "remover.before_remove".
#pragma once

#include <functional>
#include <string_view>

namespace elastrun::ckpt::testing {

// Called at each named point with the point and the caller's rank; it may throw (a failure
// there), _exit() (a crash) or block (a stall). Thread-safe; nullptr removes it.
using FaultHook = std::function<void(std::string_view point, int rank)>;
void set_fault_hook(FaultHook hook);

}  // namespace elastrun::ckpt::testing
