// The agent's decisions as pure functions, driven with canned observations: the FAILED state
// (next_failed_action), the signal thread (decide_signal), and the close reasons (job_outcome).
#include <gtest/gtest.h>
#include <signal.h>

#include "job_outcome.hpp"
#include "restart_policy.hpp"
#include "signals.hpp"

namespace elastrun::launcher {
namespace {

using rdzv::Change;

// Runs the FAILED decision the way the agent does: ClaimRestart/CountRestart are answered from
// the canned counters, until a final action.
FailedAction run_failed(Change settle, std::int64_t claims_after, std::int64_t restarts_after, int max_restarts,
                        std::vector<FailedAction>* steps = nullptr) {
  FailedObservation seen;
  seen.settle_change = settle;
  seen.max_restarts = max_restarts;
  for (int i = 0; i < 10; ++i) {
    const auto action = next_failed_action(seen);
    if (steps) steps->push_back(action);
    if (action == FailedAction::ClaimRestart)
      seen.claims = claims_after;
    else if (action == FailedAction::CountRestart)
      seen.restarts = restarts_after;
    else
      return action;
  }
  ADD_FAILURE() << "no final action";
  return FailedAction::GiveUp;
}

TEST(FailedDecision, MembershipChangesAreNotRestarts) {
  for (auto c : {Change::MemberLost, Change::Fenced, Change::StoreLost, Change::Reform}) {
    std::vector<FailedAction> steps;
    EXPECT_EQ(run_failed(c, 1, 1, 0, &steps), FailedAction::ReformUncounted) << to_string(c);
    EXPECT_EQ(steps.size(), 1u) << "a membership change must not touch the counters";
  }
}

TEST(FailedDecision, AMemberThatDoesNotConfirmItIsAliveIsALossNotARestart) {
  // etcd: the peer node's death broke our collectives long before its lease ends
  FailedObservation seen;
  seen.settle_change = Change::None;
  seen.unconfirmed = {"n3"};
  seen.max_restarts = 0;
  EXPECT_EQ(next_failed_action(seen), FailedAction::ReformUncounted);
  seen.settle_change = Change::Closed;
  EXPECT_EQ(next_failed_action(seen), FailedAction::ExitClosed) << "a close still wins";
}

TEST(FailedDecision, ClosedMeansExit) { EXPECT_EQ(run_failed(Change::Closed, 1, 1, 5), FailedAction::ExitClosed); }

TEST(FailedDecision, FirstClaimerCountsAndRestartsWithinBudget) {
  std::vector<FailedAction> steps;
  EXPECT_EQ(run_failed(Change::None, 1, 2, 2, &steps), FailedAction::Restart);
  EXPECT_EQ(steps,
            (std::vector<FailedAction>{FailedAction::ClaimRestart, FailedAction::CountRestart, FailedAction::Restart}));
  EXPECT_EQ(run_failed(Change::MemberWaiting, 1, 1, 1), FailedAction::Restart);
}

TEST(FailedDecision, BudgetUsedUpGivesUp) {
  EXPECT_EQ(run_failed(Change::None, 1, 1, 0), FailedAction::GiveUp);
  EXPECT_EQ(run_failed(Change::None, 1, 4, 3), FailedAction::GiveUp);
}

TEST(FailedDecision, LaterClaimersFollowTheFirst) {
  std::vector<FailedAction> steps;
  EXPECT_EQ(run_failed(Change::None, 2, 1, 9, &steps), FailedAction::AwaitClaimer);
  EXPECT_EQ(steps, (std::vector<FailedAction>{FailedAction::ClaimRestart, FailedAction::AwaitClaimer}))
      << "a later claimer must not count a restart";
}

TEST(SignalDecision, AllCases) {
  const auto context = [](bool checkpoint_stopping, bool workers_active, bool requeuer_armed) {
    SignalContext c;
    c.checkpoint_stopping = checkpoint_stopping;
    c.workers_active = workers_active;
    c.requeuer_armed = requeuer_armed;
    return c;
  };
  const auto running = context(false, true, false);
  const auto idle = context(false, false, false);
  const auto stopping = context(true, true, false);
  const auto rank0_reforming = context(false, false, true);
  for (int sig : {SIGUSR1, SIGUSR2, SIGTERM}) {
    EXPECT_TRUE(is_checkpoint_signal(sig));
    EXPECT_EQ(decide_signal(sig, running), SignalAction::CheckpointStop);
    EXPECT_EQ(decide_signal(sig, idle), SignalAction::Exit);
    EXPECT_EQ(decide_signal(sig, stopping), SignalAction::Ignore);
    EXPECT_EQ(decide_signal(sig, rank0_reforming), SignalAction::RequeueThenExit);
  }
  for (int sig : {SIGINT, SIGHUP, SIGQUIT}) {
    EXPECT_FALSE(is_checkpoint_signal(sig));
    EXPECT_EQ(decide_signal(sig, running), SignalAction::Stop);
    EXPECT_EQ(decide_signal(sig, idle), SignalAction::Exit);
    EXPECT_EQ(decide_signal(sig, stopping), SignalAction::Stop) << "a stop signal is never ignored";
    EXPECT_EQ(decide_signal(sig, rank0_reforming), SignalAction::Exit);
  }
}

TEST(JobOutcome, CloseReasonsRoundTrip) {
  for (auto o : {JobOutcome::Succeeded, JobOutcome::Checkpointed, JobOutcome::Failed})
    EXPECT_EQ(outcome_of_close(close_reason(o, "timelimit")), o);
  EXPECT_EQ(close_reason(JobOutcome::Checkpointed, "preempt"), "checkpointed and stopped (preempt)");
  EXPECT_EQ(close_reason(JobOutcome::Failed, "rank 3 exited"), "failed: rank 3 exited");
  EXPECT_EQ(outcome_of_close("something else"), JobOutcome::Failed);
  EXPECT_EQ(exit_code_of(JobOutcome::Succeeded), 0);
  EXPECT_EQ(exit_code_of(JobOutcome::Checkpointed), 85);
  EXPECT_EQ(exit_code_of(JobOutcome::Failed), 1);
  const rdzv::RendezvousClosed closed("run1", close_reason(JobOutcome::Succeeded));
  EXPECT_STREQ(closed.what(), "rendezvous 'run1' is closed: succeeded");
  EXPECT_EQ(outcome_of_close(closed.reason()), JobOutcome::Succeeded);
}

}  // namespace
}  // namespace elastrun::launcher
