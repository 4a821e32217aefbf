// `elastrun run`'s command line (jobs/src/run_spec.hpp) and the batch script it becomes
// (batch_script.hpp): pure, canned words in, spec or one-line refusal out.
#include <gtest/gtest.h>

#include "batch_script.hpp"
#include "run_spec.hpp"

using namespace elastrun::jobs;

namespace {

std::string refusal(const std::vector<std::string>& words) {
  try {
    parse_run(words);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(accepted)";
}

ScriptContext context() {
  return {"/opt/elastrun/bin/elastrun", "/home/me/proj", "/home/me/.elastrun/jobs/c1/%j", "2026-12-06 23:50 UTC",
          "python3"};
}

}  // namespace

TEST(RunSpec, TorchXsDistDdpLine) {
  const auto s = parse_run({"-s", "slurm", "dist.ddp", "-j", "2:4x8", "--script", "main.py", "--", "--lr", "0.1"});
  EXPECT_EQ(s.scheduler, "slurm");
  EXPECT_EQ(s.component, "dist.ddp");
  EXPECT_EQ(s.min_nodes, 2);
  EXPECT_EQ(s.max_nodes, 4);
  EXPECT_EQ(s.nproc_per_node, 8);
  EXPECT_EQ(s.script, "main.py");
  EXPECT_EQ(s.script_args, (std::vector<std::string>{"--lr", "0.1"}));
  EXPECT_EQ(job_name(s), "main");
}

TEST(RunSpec, JobShapes) {
  const auto a = parse_job_shape("2x8");
  EXPECT_EQ(a.min_nodes, 2);
  EXPECT_EQ(a.max_nodes, 2);
  EXPECT_EQ(a.nproc_per_node, 8);
  const auto b = parse_job_shape("3");
  EXPECT_EQ(b.min_nodes, 3);
  EXPECT_EQ(b.nproc_per_node, 1);
  for (const char* bad : {"", "x8", "2x", "0x1", "4:2x1", "2:x1", "a:bxc", "2x8x1"})
    EXPECT_THROW(parse_job_shape(bad), UsageError) << bad;
}

TEST(RunSpec, CfgEnvAndOurFlags) {
  const auto s = parse_run({"-cfg",
                            "partition=debug,time=00:10:00,exclusive=",
                            "--dryrun",
                            "dist.ddp",
                            "-j",
                            "1:2x2",
                            "-m",
                            "pkg.train",
                            "--env",
                            "A=1,B=x=y",
                            "--max_retries",
                            "2",
                            "--checkpoint-dir=/ckpt",
                            "--spares",
                            "1",
                            "--preload",
                            "torch",
                            "--memory-checkpoints=1G",
                            "--signal",
                            "none",
                            "--max-restarts",
                            "5"});
  EXPECT_TRUE(s.dryrun);
  ASSERT_EQ(s.cfg.size(), 3u);
  EXPECT_EQ(s.cfg[2].first, "exclusive");
  EXPECT_EQ(s.cfg[2].second, "");
  ASSERT_EQ(s.env.size(), 2u);
  EXPECT_EQ(s.env[1].second, "x=y");
  EXPECT_EQ(s.module, "pkg.train");
  EXPECT_EQ(job_name(s), "train");
  EXPECT_EQ(s.max_retries, 2);
  EXPECT_EQ(s.spares, 1);
  EXPECT_EQ(*s.memory_checkpoints, "1G");
  EXPECT_EQ(*s.max_restarts, 5);
}

TEST(RunSpec, UtilsComponents) {
  const auto sh = parse_run({"utils.sh", "echo", "hello world", "--flag"});
  EXPECT_EQ(sh.command, (std::vector<std::string>{"echo", "hello world", "--flag"}));
  EXPECT_EQ(job_name(sh), "echo");
  const auto py = parse_run({"-s", "local_cwd", "utils.python", "-c", "print(1)"});
  EXPECT_EQ(py.scheduler, "local");
  EXPECT_EQ(py.code, "print(1)");
}

TEST(RunSpec, EachBadLineIsOneLineNamingWhat) {
  EXPECT_NE(refusal({"dist.dpp", "--script", "a.py"}).find("unknown component 'dist.dpp'"), std::string::npos);
  EXPECT_NE(refusal({"dist.ddp", "-j", "4:2x1", "--script", "a.py"}).find("MIN 4 is above MAX 2"), std::string::npos);
  EXPECT_NE(refusal({"dist.ddp", "-j", "2"}).find("needs --script FILE or -m MODULE"), std::string::npos);
  EXPECT_NE(refusal({"dist.ddp", "--script", "a.py", "-m", "b"}).find("not several"), std::string::npos);
  EXPECT_NE(refusal({"-s", "kubernetes", "dist.ddp"}).find("unknown scheduler 'kubernetes'"), std::string::npos);
  EXPECT_NE(refusal({"dist.ddp", "--script", "a.py", "--bogus"}).find("unknown option '--bogus'"), std::string::npos);
  EXPECT_NE(refusal({"utils.sh"}).find("needs a command"), std::string::npos);
  EXPECT_NE(refusal({"-cfg", "partition", "utils.sh", "true"}).find("KEY=VALUE"), std::string::npos);
  EXPECT_NE(refusal({"dist.ddp", "--script", "a.py", "--env", "1A=2"}).find("bad --env name"), std::string::npos);
  EXPECT_NE(refusal({"dist.ddp", "--script", "a.py", "--memory-checkpoints=lots"}).find("not a size"),
            std::string::npos);
  EXPECT_NE(refusal({"dist.ddp", "--script", "a.py", "--het", "-j", "1x1"}).find("two or more"), std::string::npos);
  EXPECT_NE(refusal({"dist.ddp", "--script", "a.py", "-j", "2x1,1x1"}).find("needs --het"), std::string::npos);
  EXPECT_NE(refusal({"dist.ddp", "--script", "a.py", "-j", "2x1", "--het", "-j", "1x1"}).find("before"),
            std::string::npos);
  EXPECT_NE(refusal({"dist.ddp", "--script", "a.py", "--het", "-j", "2x1,1x1", "--spares", "1"}).find("--spares"),
            std::string::npos);
  EXPECT_NE(refusal({"-s", "local", "dist.ddp", "--script", "a.py", "--het", "-j", "2x1,1x1"}).find("-s local"),
            std::string::npos);
  EXPECT_NE(refusal({"dist.ddp", "--script", "a.py", "--het", "-j", "2x1,0x1"}).find("bad -j '0x1'"),
            std::string::npos);
  EXPECT_NE(refusal({}).find("no component"), std::string::npos);
  for (const auto& words : std::vector<std::vector<std::string>>{{"dist.dpp"}, {"dist.ddp", "-j"}, {"utils.sh"}})
    EXPECT_EQ(refusal(words).find('\n'), std::string::npos);
}

TEST(BatchScript, DistDdpIsOneAgentPerNodeUnderJobStep) {
  const auto s = parse_run({"-cfg", "partition=debug,mail-type=END", "dist.ddp", "-j", "2:4x2", "--script", "train.py",
                            "--env", "LR=0.1", "--", "--msg", "it's"});
  const auto text = batch_script(s, context());
  EXPECT_EQ(text.rfind("#!/bin/bash\n", 0), 0u);
  for (const char* line :
       {"#SBATCH --job-name=train\n", "#SBATCH --nodes=4\n", "#SBATCH --no-kill\n", "#SBATCH --requeue\n",
        "#SBATCH --signal=USR1@120\n", "#SBATCH --output=/home/me/.elastrun/jobs/c1/%j/batch.out\n",
        "#SBATCH --chdir=/home/me/proj\n", "#SBATCH --partition=debug\n", "#SBATCH --mail-type=END\n",
        "export ELASTRUN_JOB_DIR=/home/me/.elastrun/jobs/c1/%j\n", "export LR=0.1\n",
        "ELASTRUN=/opt/elastrun/bin/elastrun\n", "job-step srun --no-kill", "--nnodes=\"2:$SLURM_JOB_NUM_NODES\"",
        "--nproc-per-node=2", "--requeue-budget=app:0,node:0", "train.py", "--msg", "'it'\\''s'"})
    EXPECT_NE(text.find(line), std::string::npos) << line << " in\n" << text;
  EXPECT_EQ(text.find("job_dir"), std::string::npos);
}

TEST(BatchScript, HetIsOneComponentPerJAndOneStepOverAll) {
  const auto s = parse_run({"-cfg", "partition=debug,comment=x", "dist.ddp", "--het", "-j", "2:3x2", "-j", "1x1",
                            "--script", "train.py", "--max-restarts", "2"});
  ASSERT_EQ(s.het.size(), 2u);
  EXPECT_EQ(s.het[0].min_nodes, 2);
  EXPECT_EQ(s.het[0].max_nodes, 3);
  EXPECT_EQ(s.het[1].nproc_per_node, 1);
  EXPECT_EQ(parse_run({"dist.ddp", "--het", "-j", "2:3x2,1x1", "--script", "t.py"}).het.size(), 2u);
  const auto text = batch_script(s, context());
  const auto hetjob = text.find("#SBATCH hetjob\n");
  ASSERT_NE(hetjob, std::string::npos) << text;
  const std::string first = text.substr(0, hetjob), second = text.substr(hetjob);
  for (const char* line :
       {"#SBATCH --nodes=3 --no-kill --ntasks-per-node=1\n", "#SBATCH --requeue\n", "#SBATCH --signal=USR1@120\n",
        "#SBATCH --partition=debug\n", "#SBATCH --comment=x\n", "#SBATCH --job-name=train\n"})
    EXPECT_NE(first.find(line), std::string::npos) << line << " in\n" << text;
  EXPECT_NE(second.find("#SBATCH --nodes=1 --no-kill --ntasks-per-node=1\n"), std::string::npos) << text;
  EXPECT_NE(second.find("#SBATCH --partition=debug\n"), std::string::npos) << text;  // per component
  EXPECT_EQ(second.find("comment"), std::string::npos) << text;                      // the job's: once
  EXPECT_EQ(second.find("--job-name"), std::string::npos) << text;
  const std::string bounds = "\"--het-nnodes=2:$SLURM_JOB_NUM_NODES_HET_GROUP_0,1:$SLURM_JOB_NUM_NODES_HET_GROUP_1\"";
  const auto step = text.find("job-step srun --no-kill --ntasks=\"$SLURM_JOB_NUM_NODES_HET_GROUP_0\"");
  const auto colon = text.find(": --no-kill --ntasks=\"$SLURM_JOB_NUM_NODES_HET_GROUP_1\"");
  ASSERT_NE(step, std::string::npos) << text;
  ASSERT_NE(colon, std::string::npos) << text;
  EXPECT_NE(text.find(bounds, step), std::string::npos) << text;
  EXPECT_NE(text.find("--nproc-per-node=2", step), std::string::npos) << text;
  EXPECT_LT(text.find("--nproc-per-node=2", step), colon) << text;
  EXPECT_NE(text.find(bounds, colon), std::string::npos) << text;
  EXPECT_NE(text.find("--nproc-per-node=1", colon), std::string::npos) << text;
  EXPECT_NE(text.find("--max-restarts=2", colon), std::string::npos) << text;
}

TEST(BatchScript, SparesAndFixedSize) {
  const auto s = parse_run({"dist.ddp", "-j", "3x1", "--spares", "1", "--script", "t.py", "--signal", "none"});
  const auto text = batch_script(s, context());
  EXPECT_NE(text.find("#SBATCH --nodes=4\n"), std::string::npos) << text;
  EXPECT_NE(text.find("--nnodes=\"3:$((SLURM_JOB_NUM_NODES - 1))\""), std::string::npos) << text;
  EXPECT_EQ(text.find("#SBATCH --signal"), std::string::npos) << text;
}

TEST(BatchScript, UtilsJobsAreNotRequeuedAndNomemDropsTheMemoryRequest) {
  // a utils job does not checkpoint: a time-limit signal and requeue would restart it from scratch
  const auto text = batch_script(parse_run({"utils.sh", "sleep", "600"}), context());
  EXPECT_EQ(text.find("#SBATCH --requeue"), std::string::npos) << text;
  EXPECT_EQ(text.find("#SBATCH --signal"), std::string::npos) << text;
  const auto mem = parse_run({"-cfg", "nomem=True", "dist.ddp", "--memMB", "1000", "--script", "t.py"});
  EXPECT_EQ(batch_script(mem, context()).find("#SBATCH --mem"), std::string::npos);
  const auto with_mem = parse_run({"dist.ddp", "--memMB", "1000", "--script", "t.py"});
  EXPECT_NE(batch_script(with_mem, context()).find("#SBATCH --mem=1000M\n"), std::string::npos);
}

TEST(BatchScript, ANewlineInAnArgumentStaysInsideTheHeaderComment) {
  const auto text = batch_script(parse_run({"utils.python", "-c", "import os\nprint(1)"}), context());
  EXPECT_NE(text.find("#   elastrun run utils.python -c 'import os\\nprint(1)'\n"), std::string::npos) << text;
}

TEST(BatchScript, UtilsShRunsUnderOneAgent) {
  const auto s = parse_run({"utils.sh", "echo", "a b"});
  const auto words = agent_words(s, "python3");
  EXPECT_EQ(words, (std::vector<std::string>{"--nproc-per-node=1", "/bin/sh", "-c", "echo a b"}));  // TorchX's join
  EXPECT_EQ(job_name(parse_run({"utils.sh", "exit 7"})), "exit");
  EXPECT_EQ(job_name(parse_run({"utils.sh", "--name", "my job/1", "true"})), "my_job_1");
  const auto py = parse_run({"utils.python", "-c", "print(1)"});
  EXPECT_EQ(agent_words(py, "/usr/bin/python3"),
            (std::vector<std::string>{"--nproc-per-node=1", "/usr/bin/python3", "-u", "-c", "print(1)"}));
}
