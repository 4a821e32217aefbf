// The job directory (launcher/src/job_dir.hpp): where it is for each environment (pure), what
// make_job_dir creates (0700, the index entry, the fallback with a warning), and `elastrun
// job-step`'s outcome rule and signal forwarding with real processes.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/format.h>

#include "job_dir.hpp"
#include "temp_dir.hpp"

namespace elastrun::launcher {
namespace {

namespace fs = std::filesystem;
using test_support::TempDir;

rdzv::EnvMap slurm_job(std::string submit_dir) {
  return {{"SLURM_JOB_ID", "42"},
          {"SLURM_CLUSTER_NAME", "testbed"},
          {"SLURM_SUBMIT_DIR", std::move(submit_dir)},
          {"HOME", "/home/me"}};
}

TEST(JobDir, DefaultIsBesideTheSubmitDirWithAnIndexByCluster) {
  const auto plan = plan_job_dir(slurm_job("/work/proj"));
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan->path, "/work/proj/elastrun-42");
  EXPECT_EQ(plan->index_link, "/home/me/.elastrun/jobs/testbed/42");
}

TEST(JobDir, OverriddenWithJobIdPatternOrOff) {
  auto env = slurm_job("/work/proj");
  env["ELASTRUN_JOB_DIR"] = "/scratch/%j/run-%j";
  env["ELASTRUN_INDEX_DIR"] = "/idx";
  const auto plan = plan_job_dir(env);
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan->path, "/scratch/42/run-42");
  EXPECT_EQ(plan->index_link, "/idx/testbed/42");
  env["ELASTRUN_JOB_DIR"] = "none";
  EXPECT_FALSE(plan_job_dir(env));
}

TEST(JobDir, OutsideSlurmOnlyANamedDirectory) {
  EXPECT_FALSE(plan_job_dir({{"HOME", "/home/me"}}));
  EXPECT_FALSE(plan_job_dir({{"ELASTRUN_JOB_DIR", "/x/%j"}}));  // no job id to put there
  const auto plan = plan_job_dir({{"ELASTRUN_JOB_DIR", "/x/mine"}});
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan->path, "/x/mine");
  EXPECT_EQ(plan->index_link, "");
}

TEST(JobDir, MadePrivateAndIndexed) {
  TempDir tmp;
  auto env = slurm_job(tmp.path().string());
  env["ELASTRUN_INDEX_DIR"] = (tmp.path() / "index").string();
  const auto plan = plan_job_dir(env);
  ASSERT_TRUE(plan);
  const auto dir = make_job_dir(*plan, env);
  EXPECT_EQ(dir, (tmp.path() / "elastrun-42").string());
  struct stat st {};
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(fs::read_symlink(tmp.path() / "index" / "testbed" / "42"), fs::path(dir));
  EXPECT_EQ(make_job_dir(*plan, env), dir) << "a second agent of the job uses the same directory";
}

TEST(JobDir, UnusableFallsBackToANodeLocalOne) {
  TempDir tmp;
  auto env = slurm_job("/dev/null");  // /dev/null/elastrun-42 can never be made (root included)
  env["TMPDIR"] = tmp.path().string();
  env["ELASTRUN_INDEX_DIR"] = (tmp.path() / "index").string();
  const auto plan = plan_job_dir(env);
  ASSERT_TRUE(plan);
  const auto dir = make_job_dir(*plan, env);
  EXPECT_EQ(dir, (tmp.path() / fmt::format("elastrun-{}", ::getuid()) / "jobs" / "testbed" / "42").string());
  EXPECT_TRUE(fs::is_directory(dir));
}

int run(const std::string& command) {
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(JobStep, SucceededOutcomeOverrulesTheStepsExitCode) {
  TempDir tmp;
  const auto outcome = (tmp.path() / "outcome.json").string();
  const std::string step = fmt::format("ELASTRUN_OUTCOME_FILE={} {} job-step sh -c ", outcome, ELASTRUN_BIN);
  std::ofstream(outcome) << R"({"outcome":"succeeded"})"
                         << "\n";  // stale: removed before the step runs
  EXPECT_EQ(run(step + "'exit 3'"), 3);
  EXPECT_FALSE(fs::exists(outcome));
  EXPECT_EQ(run(step + "'echo {\\\"outcome\\\":\\\"succeeded\\\"} >$ELASTRUN_OUTCOME_FILE; exit 3'"), 0);
  EXPECT_TRUE(fs::exists(outcome)) << "the outcome is kept after the job";
  EXPECT_EQ(run(step + "'echo {\\\"outcome\\\":\\\"failed\\\"} >$ELASTRUN_OUTCOME_FILE; exit 4'"), 4);
  EXPECT_EQ(run(step + "'exit 0'"), 0);
  EXPECT_EQ(run(std::string(ELASTRUN_BIN) + " job-step 2>/dev/null"), 2);
  EXPECT_EQ(run(std::string(ELASTRUN_BIN) + " job-step /no/such/program 2>/dev/null"), 127);
}

TEST(JobStep, ForwardsSignalsToTheStep) {
  TempDir tmp;
  const auto ready = tmp.path() / "ready";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::setenv("ELASTRUN_OUTCOME_FILE", (tmp.path() / "outcome.json").c_str(), 1);
    const std::string script =
        fmt::format("trap 'exit 7' USR1; touch {}; while :; do sleep 0.05; done", ready.string());
    ::execl(ELASTRUN_BIN, ELASTRUN_BIN, "job-step", "sh", "-c", script.c_str(), nullptr);
    ::_exit(126);
  }
  for (int i = 0; i < 200 && !fs::exists(ready); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  ASSERT_TRUE(fs::exists(ready));
  ::kill(pid, SIGUSR1);  // as Slurm's --signal does to the batch script
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 7) << "the step got SIGUSR1 and exited by its trap";
}

}  // namespace
}  // namespace elastrun::launcher
