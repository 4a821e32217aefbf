#include "restart_policy.hpp"

namespace elastrun::launcher {

using rdzv::Change;

std::string_view to_string(FailedAction action) {
  switch (action) {
    case FailedAction::ClaimRestart: return "claim-restart";
    case FailedAction::CountRestart: return "count-restart";
    case FailedAction::ExitClosed: return "exit-closed";
    case FailedAction::ReformUncounted: return "reform-uncounted";
    case FailedAction::AwaitClaimer: return "await-claimer";
    case FailedAction::Restart: return "restart";
    case FailedAction::GiveUp: return "give-up";
  }
  return "?";
}

FailedAction next_failed_action(const FailedObservation& seen) {
  switch (seen.settle_change) {
    case Change::Closed: return FailedAction::ExitClosed;
    // A failure caused by a lost peer or by another node's failure (a collective broke) is a
    // membership change, not a restart of ours.
    case Change::MemberLost:
    case Change::Fenced:
    case Change::StoreLost:
    case Change::Reform: return FailedAction::ReformUncounted;
    case Change::None:
    case Change::MemberWaiting: break;
  }
  // A member that cannot confirm it is alive is lost: its node's death broke our collectives.
  if (!seen.unconfirmed.empty()) return FailedAction::ReformUncounted;
  // Workers failed on several nodes in this round at once (one crash breaks the others'
  // collectives): one restart per round, counted by the agent that claimed it first.
  if (!seen.claims) return FailedAction::ClaimRestart;
  if (*seen.claims > 1) return FailedAction::AwaitClaimer;
  if (!seen.restarts) return FailedAction::CountRestart;
  return *seen.restarts > seen.max_restarts ? FailedAction::GiveUp : FailedAction::Restart;
}

}  // namespace elastrun::launcher
