// How a job ended, as the agents tell each other: the agent that ends the job closes the
// rendezvous with a reason that starts with the outcome's word, and every other agent reads the
// outcome back from RendezvousClosed::reason() to choose its exit code.
#pragma once

#include <string>
#include <string_view>

#include "elastrun/control.hpp"

namespace elastrun::launcher {

enum class JobOutcome { Succeeded, Checkpointed, Failed };

// "succeeded"; "checkpointed and stopped (<detail>)"; "failed: <detail>".
inline std::string close_reason(JobOutcome outcome, std::string_view detail = {}) {
  switch (outcome) {
    case JobOutcome::Succeeded: return "succeeded";
    case JobOutcome::Checkpointed: return "checkpointed and stopped (" + std::string(detail) + ")";
    case JobOutcome::Failed: break;
  }
  return "failed: " + std::string(detail);
}

// The outcome a close reason names; anything unknown (another version's words) is a failure.
inline JobOutcome outcome_of_close(std::string_view reason) {
  if (reason == "succeeded") return JobOutcome::Succeeded;
  if (reason.starts_with("checkpointed")) return JobOutcome::Checkpointed;
  return JobOutcome::Failed;
}

// The agent's exit code for the outcome: 0, 85 (checkpointed: requeue me), 1.
inline int exit_code_of(JobOutcome outcome) {
  switch (outcome) {
    case JobOutcome::Succeeded: return 0;
    case JobOutcome::Checkpointed: return elastrun::control::kCheckpointedExitCode;
    case JobOutcome::Failed: break;
  }
  return 1;
}

}  // namespace elastrun::launcher
