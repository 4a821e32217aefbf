// The FAILED state's decision, as a pure function of what the agent has observed so far (the
// way torch's _RendezvousJoinOp returns an _Action): the agent performs the action, adds what
// it learnt to the observation, and asks again until the action is final.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "elastrun/rdzv/rendezvous.hpp"

namespace elastrun::launcher {

enum class FailedAction {
  ClaimRestart,     // not final: add 1 to this round's restart claim (job-wide), observe it
  CountRestart,     // not final: add 1 to the job-wide restart counter, observe it
  ExitClosed,       // the rendezvous was closed meanwhile: stop workers, exit with the close reason
  ReformUncounted,  // a membership change explains the failure: stop workers, re-form, no restart
  AwaitClaimer,     // another agent claimed this round's restart: stop workers, follow its decision
  Restart,          // a restart within --max-restarts: ask for a new round, stop workers, re-form
  GiveUp,           // --max-restarts used up: close the rendezvous for everyone, exit 1
};
std::string_view to_string(FailedAction action);

struct FailedObservation {
  // A membership change seen after the local failure, while the members confirmed they are alive.
  rdzv::Change settle_change = rdzv::Change::None;
  // Members of the round whose agents did not confirm they are alive after the failure
  // (Rendezvous::confirm_members): lost, though the store may not say so yet.
  std::vector<std::string> unconfirmed;
  std::optional<std::int64_t> claims;    // this round's restart claims after our ClaimRestart
  std::optional<std::int64_t> restarts;  // the job-wide restart count after our CountRestart
  int max_restarts = 0;
};

FailedAction next_failed_action(const FailedObservation& seen);

}  // namespace elastrun::launcher
