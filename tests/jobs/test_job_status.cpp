// `elastrun status`'s pure parts (jobs/src/job_status.hpp): the AppState mapping and the summary
// of a job's event logs, from canned events.
#include <gtest/gtest.h>

#include <algorithm>

#include "job_status.hpp"

using namespace elastrun::jobs;
using nlohmann::json;

TEST(AppState, SlurmStatesAsTorchXMapsThem) {
  EXPECT_EQ(app_state_of_slurm("PENDING"), "PENDING");
  EXPECT_EQ(app_state_of_slurm("REQUEUED"), "PENDING");
  EXPECT_EQ(app_state_of_slurm("SUSPENDED"), "PENDING");
  EXPECT_EQ(app_state_of_slurm("RUNNING"), "RUNNING");
  EXPECT_EQ(app_state_of_slurm("COMPLETING"), "RUNNING");
  EXPECT_EQ(app_state_of_slurm("COMPLETED"), "SUCCEEDED");
  EXPECT_EQ(app_state_of_slurm("TIMEOUT"), "FAILED");
  EXPECT_EQ(app_state_of_slurm("PREEMPTED"), "FAILED");
  EXPECT_EQ(app_state_of_slurm("NODE_FAIL"), "FAILED");
  EXPECT_EQ(app_state_of_slurm("CANCELLED"), "CANCELLED");
  EXPECT_EQ(app_state_of_slurm("SOMETHING_NEW"), "UNKNOWN");
}

TEST(AppState, OurRecordsDecideOnceSlurmIsDoneOrHasForgotten) {
  EXPECT_EQ(app_state("RUNNING", "", true), "RUNNING");  // cancel asked, not yet done
  EXPECT_EQ(app_state("FAILED", "checkpointed", true), "CANCELLED");
  EXPECT_EQ(app_state("COMPLETED", "checkpointed", true), "CANCELLED");
  EXPECT_EQ(app_state("FAILED", "succeeded", false), "SUCCEEDED");  // srun's code after a shrink
  EXPECT_EQ(app_state("CANCELLED", "succeeded", false), "CANCELLED");
  EXPECT_EQ(app_state("TIMEOUT", "succeeded", false), "SUCCEEDED");
  EXPECT_EQ(app_state("", "succeeded", false), "SUCCEEDED");  // after MinJobAge
  EXPECT_EQ(app_state("", "failed", false), "FAILED");
  EXPECT_EQ(app_state("", "", false), "UNKNOWN");
  EXPECT_EQ(app_state("", "", true), "CANCELLED");
}

namespace {
json ev(double t, const char* node, const char* event, json fields, const char* run = "7.r0") {
  json e = {{"v", 1}, {"time", t}, {"node", node}, {"run_id", run}, {"event", event}};
  e.update(fields);
  return e;
}
}  // namespace

TEST(JobSummary, RoundsLossesStepsCheckpointsAndTimeLost) {
  std::vector<json> events = {
      ev(100.0, "n1", "round",
         {{"generation", 1}, {"world_size", 8}, {"members", {"n1", "n2", "n3", "n4"}}, {"restart_count", 0}}),
      ev(100.0, "n2", "round",
         {{"generation", 1}, {"world_size", 8}, {"members", {"n1", "n2", "n3", "n4"}}, {"restart_count", 0}}),
      ev(100.5, "n1", "workers_started", {{"attempt", 0}, {"ranks", {0, 1}}}),
      ev(101.0, "n1", "step", {{"rank", 0}, {"step", 1}, {"world_size", 8}}),
      ev(102.0, "n1", "step", {{"rank", 0}, {"step", 2}, {"world_size", 8}}),
      ev(102.1, "n1", "checkpoint_saved", {{"rank", 0}, {"step", 2}, {"tier", "file"}, {"blocked_s", 0.1}}),
      ev(103.0, "n1", "step", {{"rank", 0}, {"step", 3}, {"world_size", 8}}),
      ev(103.1, "n1", "checkpoint_saved", {{"rank", 0}, {"step", 3}, {"tier", "memory"}}),
      // n3 dies: both survivors see it; their workers die of it afterwards
      ev(104.0, "n1", "member_lost", {{"member", "n3"}, {"how", "holder disconnected"}}),
      ev(104.1, "n2", "member_lost", {{"member", "n3"}, {"how", "holder disconnected"}}),
      ev(104.2, "n1", "worker_exit", {{"rank", 1}, {"exit_code", 1}, {"signal", ""}}),
      ev(104.3, "n1", "round",
         {{"generation", 2}, {"world_size", 6}, {"members", {"n1", "n2", "n4"}}, {"restart_count", 0}}),
      ev(104.5, "n1", "workers_started", {{"attempt", 1}, {"ranks", {0, 1}}}),
      ev(105.5, "n1", "step", {{"rank", 0}, {"step", 4}, {"world_size", 6}}),
      ev(106.5, "n1", "step", {{"rank", 0}, {"step", 6}, {"world_size", 6}}),
      ev(106.6, "n1", "requeue", {{"class", "timelimit"}, {"requeued", true}}),
      json("not an event"),
  };
  std::reverse(events.begin(), events.end());  // any order in: sorted by time
  const auto s = summarise(events);
  ASSERT_EQ(s.rounds.size(), 2u);
  EXPECT_EQ(s.rounds[0].world_size, 8);
  EXPECT_EQ(s.rounds[1].world_size, 6);
  EXPECT_EQ(s.rounds[1].members, (std::vector<std::string>{"n1", "n2", "n4"}));
  ASSERT_EQ(s.lost.size(), 1u);
  EXPECT_EQ(s.lost[0].node, "n3");
  EXPECT_DOUBLE_EQ(s.lost[0].time, 104.0);
  EXPECT_EQ(s.root_cause, "node n3 lost");
  EXPECT_EQ(*s.step, 6);
  ASSERT_TRUE(s.steps_per_s);
  EXPECT_NEAR(*s.steps_per_s, 2.0, 1e-9);  // the newest round: steps 4..6 in 1 s
  ASSERT_TRUE(s.checkpoint);
  EXPECT_EQ(s.checkpoint->step, 3);
  EXPECT_EQ(s.checkpoint->tier, "memory");
  EXPECT_NEAR(s.time_lost_s, 1.5, 1e-9);  // n3 lost at 104.0 -> the next step at 105.5
  EXPECT_EQ(s.requeues, 1);
}

TEST(JobSummary, StragglersAndNodesThatFailedTheirHealthCheckAreNamed) {
  const auto s = summarise({
      ev(9, "n3", "health_check", {{"ok", false}, {"check", "command"}, {"what", "'gpu-ok' exited 1: GPU 2 ECC"}}),
      ev(9.5, "n2", "health_check", {{"ok", true}}),
      ev(10, "n1", "round", {{"generation", 1}, {"world_size", 6}, {"restart_count", 0}}),
      ev(20, "n1", "straggler", {{"member", "n4"}, {"member_rank", 5}, {"ratio", 2.345}, {"action", "report"}}),
      ev(30, "n1", "straggler", {{"member", "n4"}, {"member_rank", 5}, {"ratio", 3.0}, {"action", "report"}}),
  });
  ASSERT_EQ(s.unhealthy.size(), 1u);
  EXPECT_EQ(s.unhealthy[0].node, "n3");
  EXPECT_EQ(s.unhealthy[0].what, "command: 'gpu-ok' exited 1: GPU 2 ECC");
  ASSERT_EQ(s.stragglers.size(), 1u) << "one per node";
  EXPECT_EQ(s.stragglers[0].node, "n4");
  EXPECT_EQ(s.stragglers[0].what, "2.35x the median node's compute time (rank 5; report)");
}

TEST(JobSummary, AWorkerFailureIsTheRootCauseWhenNoNodeWasLost) {
  const auto s = summarise({
      ev(10, "n1", "round", {{"generation", 1}, {"world_size", 2}, {"restart_count", 0}}),
      ev(11, "n1", "worker_exit", {{"rank", 0}, {"exit_code", 0}}),
      // a planned stop (a scale-up re-form): SIGTERM from the agent, no failure
      ev(11.5, "n1", "worker_exit", {{"rank", 1}, {"exit_code", 0}, {"signal", "SIGTERM"}}),
      ev(11.6, "n1", "workers_started", {{"attempt", 1}, {"ranks", {0, 1}}}),
      ev(12, "n2", "worker_exit", {{"rank", 2}, {"exit_code", 85}, {"signal", ""}}),
      ev(12, "n2", "worker_exit", {{"rank", 3}, {"exit_code", 0}, {"signal", "SIGSEGV"}}),
      ev(12.1, "n2", "worker_exit", {{"rank", 2}, {"exit_code", 0}, {"signal", "SIGTERM"}}),
      ev(12.5, "n2", "failure_decision", {{"action", "restart"}, {"restarts", 1}, {"max_restarts", 3}}),
      ev(13, "n2", "workers_started", {{"attempt", 1}, {"ranks", {2, 3}}}),
  });
  EXPECT_EQ(s.root_cause, "rank 3 on node n2 killed by SIGSEGV");
  EXPECT_EQ(s.restarts, 1);
  EXPECT_EQ(s.max_restarts, 3);
  EXPECT_NEAR(s.time_lost_s, 1.0, 1e-9);  // no step events: until the workers started again
  EXPECT_FALSE(s.step);
}
