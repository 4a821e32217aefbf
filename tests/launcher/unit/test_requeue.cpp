// The requeue policy (decide_requeue) with canned slurmctld answers, and the ledger on real files.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "requeue.hpp"
#include "temp_dir.hpp"

namespace elastrun::launcher {
namespace {

namespace fs = std::filesystem;
using Verdict = RequeueDecision::Verdict;
constexpr std::array<std::int64_t, kFailureClasses> kBudgets{0, 3, kUnlimited, kUnlimited};

using test_support::TempDir;

TEST(RequeuePolicy, NotUnderSlurm) {
  RequeueLedger ledger("", "", 0);
  EXPECT_EQ(decide_requeue(FailureClass::TimeLimit, SIGUSR1, false, std::nullopt, ledger, kBudgets).verdict,
            Verdict::NotSlurm);
}

TEST(RequeuePolicy, BudgetsPerClass) {
  RequeueLedger fresh("", "12", 0);
  EXPECT_EQ(decide_requeue(FailureClass::App, 0, true, std::nullopt, fresh, kBudgets).verdict, Verdict::BudgetUsedUp);
  auto d = decide_requeue(FailureClass::Node, 0, true, std::nullopt, fresh, kBudgets);
  EXPECT_EQ(d.verdict, Verdict::Requeue);
  EXPECT_EQ(d.used, 0);
  EXPECT_EQ(d.budget, 3);
  // without a checkpoint directory every class is charged SLURM_RESTART_COUNT
  RequeueLedger third("", "12", 3);
  EXPECT_EQ(decide_requeue(FailureClass::Node, 0, true, std::nullopt, third, kBudgets).verdict, Verdict::BudgetUsedUp);
  EXPECT_EQ(decide_requeue(FailureClass::TimeLimit, SIGUSR1, true, std::nullopt, third, kBudgets).verdict,
            Verdict::Requeue);
}

TEST(RequeuePolicy, SigtermAsksSlurmctld) {
  RequeueLedger ledger("", "12", 0);
  auto with = [&](bool cancelled, bool preempted, bool timed_out) {
    SlurmJobView job;
    job.cancelled = cancelled;
    job.preempted = preempted;
    job.timed_out = timed_out;
    return decide_requeue(FailureClass::Preempt, SIGTERM, true, job, ledger, kBudgets);
  };
  EXPECT_EQ(with(true, false, false).verdict, Verdict::Cancelled);
  EXPECT_EQ(with(false, false, false).verdict, Verdict::NotPreempted);
  auto preempted = with(false, true, false);
  EXPECT_EQ(preempted.verdict, Verdict::Requeue);
  EXPECT_EQ(preempted.cls, FailureClass::Preempt);
  auto timed_out = with(false, false, true);
  EXPECT_EQ(timed_out.verdict, Verdict::Requeue);
  EXPECT_EQ(timed_out.cls, FailureClass::TimeLimit);
  auto unknown = decide_requeue(FailureClass::Preempt, SIGTERM, true, std::nullopt, ledger, kBudgets);
  EXPECT_EQ(unknown.verdict, Verdict::Requeue);
  EXPECT_TRUE(unknown.slurmctld_unreachable);
  // another signal is not checked with slurmctld
  EXPECT_EQ(decide_requeue(FailureClass::TimeLimit, SIGUSR1, true, SlurmJobView{}, ledger, kBudgets).verdict,
            Verdict::Requeue);
}

TEST(RequeueLedger, CountsSurviveInTheCheckpointDirectory) {
  TempDir dir;
  {
    RequeueLedger ledger(dir.path().string(), "77", 5);
    EXPECT_EQ(ledger.used(FailureClass::Node), 0);  // the ledger, not SLURM_RESTART_COUNT
    EXPECT_TRUE(ledger.charge(FailureClass::Node).ok);
    EXPECT_TRUE(ledger.charge(FailureClass::Node).ok);
    EXPECT_TRUE(ledger.charge(FailureClass::Preempt).ok);
  }
  RequeueLedger again(dir.path().string(), "77", 6);
  EXPECT_EQ(again.used(FailureClass::Node), 2);
  EXPECT_EQ(again.used(FailureClass::Preempt), 1);
  EXPECT_EQ(again.used(FailureClass::App), 0);
  EXPECT_EQ(again.path(), (dir.path() / "elastrun-requeue.json").string());
  // another job's ledger in the same directory is not ours
  RequeueLedger other(dir.path().string(), "78", 0);
  EXPECT_EQ(other.used(FailureClass::Node), 0);
  auto d = decide_requeue(FailureClass::Node, 0, true, std::nullopt, again, {0, 2, kUnlimited, kUnlimited});
  EXPECT_EQ(d.verdict, Verdict::BudgetUsedUp);
}

TEST(RequeueLedger, DamagedFileCountsAsEmptyAndUnwritableIsReported) {
  TempDir dir;
  std::ofstream(dir.path() / "elastrun-requeue.json") << "{not json";
  RequeueLedger ledger(dir.path().string(), "9", 0);
  EXPECT_EQ(ledger.used(FailureClass::Node), 0);
  RequeueLedger nowhere((dir.path() / "missing" / "dir").string(), "9", 0);
  auto r = nowhere.charge(FailureClass::App);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.error.find("cannot write"), std::string::npos) << r.error;
  EXPECT_EQ(nowhere.used(FailureClass::App), 1);  // counted in memory all the same
}

TEST(SlurmCalls, BadJobIdsAreRefusedWithoutCallingSlurm) {
  EXPECT_FALSE(requeue_slurm_job("abc").ok);
  EXPECT_FALSE(exclude_nodes_from_job("", {"n1"}).ok);
  EXPECT_FALSE(load_slurm_job("12x"));
  EXPECT_TRUE(exclude_nodes_from_job("5", {}).ok);  // nothing to exclude
}

}  // namespace
}  // namespace elastrun::launcher
