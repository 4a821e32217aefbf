// launcher_test_worker: a worker for the agent's tests. Prints its torch/elastrun environment
// as one JSON line on stdout (and a line on stderr), then, as asked through the environment:
//   TEST_WORKER_OUT_DIR=DIR        also write DIR/rank<RANK>.gen<ELASTRUN_GENERATION>.json and DIR/pids/<pid>
//   TEST_WORKER_FAIL_RANK=N        rank N fails (exit TEST_WORKER_EXIT_CODE, default 3, or
//   TEST_WORKER_SIGNAL=SIG         raises signal SIG instead)
//   TEST_WORKER_FAIL_ONCE=FILE     ... only if FILE does not exist yet (it is created): first attempt only
//   TEST_WORKER_ERROR_MESSAGE=TEXT writes TORCHELASTIC_ERROR_FILE like PyTorch's @record first
//   TEST_WORKER_SLEEP=SECONDS      sleeps before exiting (failing ranks fail after TEST_WORKER_FAIL_AFTER s, default 0)
//   TEST_WORKER_SPAWN_ORPHAN=1     leaves a grandchild behind in a session of its own (setsid), sleeping
//   TEST_WORKER_SLEEP_WORLD_SIZE=N ... only when WORLD_SIZE is N (e.g. only in the first, larger round;
//                                  also bounds the polling below)
//   TEST_WORKER_POLL_CONTROL=1     sleeps polling the control channel (elastrun/control.hpp, with its
//                                  signal handlers) every 20 ms; on checkpoint-and-stop writes
//                                  DIR/checkpoint.rank<RANK>.json and exits 85 (checkpointed); after
//                                  its first poll (handlers installed) it writes DIR/polling.rank<RANK>,
//                                  which tests wait for before they signal
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "elastrun/control.hpp"

namespace {
std::string env(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}
void sleep_seconds(double s) {
  if (s > 0) std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<long>(s * 1000)));
}
}  // namespace

int main(int argc, char** argv) {
  nlohmann::json j;
  for (const char* key : {"RANK",
                          "LOCAL_RANK",
                          "GROUP_RANK",
                          "ROLE_RANK",
                          "ROLE_NAME",
                          "LOCAL_WORLD_SIZE",
                          "WORLD_SIZE",
                          "GROUP_WORLD_SIZE",
                          "ROLE_WORLD_SIZE",
                          "MASTER_ADDR",
                          "MASTER_PORT",
                          "TORCHELASTIC_RESTART_COUNT",
                          "TORCHELASTIC_MAX_RESTARTS",
                          "TORCHELASTIC_RUN_ID",
                          "TORCHELASTIC_ERROR_FILE",
                          "OMP_NUM_THREADS",
                          "ELASTRUN_GENERATION",
                          "ELASTRUN_NODE",
                          "ELASTRUN_CONTROL_FILE",
                          "ELASTRUN_CHECKPOINT_DIR",
                          "ELASTRUN_CHECKPOINTED_EXIT_CODE",
                          "SLURM_JOB_ID",
                          "SLURM_RESTART_COUNT"})
    if (const char* v = std::getenv(key)) j[key] = v;
  j["pid"] = getpid();
  j["pgid"] = getpgrp();
  nlohmann::json args = nlohmann::json::array();
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  j["args"] = args;
  std::cout << j.dump() << std::endl;
  std::cerr << "stderr line from pid " << getpid() << std::endl;

  const std::string out_dir = env("TEST_WORKER_OUT_DIR");
  if (!out_dir.empty()) {
    std::ofstream(out_dir + "/rank" + env("RANK") + ".gen" + env("ELASTRUN_GENERATION") + ".json") << j.dump() << "\n";
    ::mkdir((out_dir + "/pids").c_str(), 0755);
    std::ofstream(out_dir + "/pids/" + std::to_string(getpid())) << env("RANK") << "\n";
  }

  if (env("TEST_WORKER_SPAWN_ORPHAN") == "1") {
    pid_t child = fork();
    if (child == 0) {
      setsid();
      if (!out_dir.empty()) std::ofstream(out_dir + "/pids/" + std::to_string(getpid())) << "orphan\n";
      for (int i = 0; i < 300; ++i) sleep(1);
      _exit(0);
    }
    for (int i = 0; i < 100 && !out_dir.empty(); ++i) {  // until the grandchild recorded its pid
      if (access((out_dir + "/pids/" + std::to_string(child)).c_str(), F_OK) == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  const std::string fail_rank = env("TEST_WORKER_FAIL_RANK");
  if (!fail_rank.empty() && fail_rank == env("RANK")) {
    bool fail = true;
    const std::string once = env("TEST_WORKER_FAIL_ONCE");
    if (!once.empty()) {
      int fd = ::open(once.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0644);
      if (fd < 0)
        fail = false;  // already failed once
      else
        ::close(fd);
    }
    if (fail) {
      sleep_seconds(std::atof(env("TEST_WORKER_FAIL_AFTER", "0").c_str()));
      const std::string message = env("TEST_WORKER_ERROR_MESSAGE");
      const std::string error_file = env("TORCHELASTIC_ERROR_FILE");
      if (!message.empty() && !error_file.empty()) {
        nlohmann::json e = {{"message",
                             {{"message", message},
                              {"extraInfo",
                               {{"py_callstack", "Traceback (most recent call last):\n  File \"train.py\", line 1"},
                                {"timestamp", "1700000000"}}}}}};
        std::ofstream(error_file) << e.dump();
      }
      std::cerr << "rank " << env("RANK") << " failing on purpose" << std::endl;
      const int sig = std::atoi(env("TEST_WORKER_SIGNAL", "0").c_str());
      if (sig > 0) {
        ::signal(sig, SIG_DFL);
        ::raise(sig);
      }
      return std::atoi(env("TEST_WORKER_EXIT_CODE", "3").c_str());
    }
  }
  if (env("TEST_WORKER_POLL_CONTROL") == "1") {
    namespace control = elastrun::control;
    control::install_signal_handlers();
    const std::string poll_world = env("TEST_WORKER_SLEEP_WORLD_SIZE");
    const double poll_seconds =
        poll_world.empty() || poll_world == env("WORLD_SIZE") ? std::atof(env("TEST_WORKER_SLEEP", "0").c_str()) : 0.0;
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<long>(poll_seconds * 1000));
    bool announced = false;
    while (std::chrono::steady_clock::now() < until) {
      const auto status = control::poll();
      if (!announced && !out_dir.empty()) {
        std::ofstream(out_dir + "/polling.rank" + env("RANK")) << ::getpid() << "\n";
        announced = true;
      }
      if (status.stop()) {
        nlohmann::json c = {{"rank", env("RANK")},
                            {"request", std::string(control::to_string(status.request))},
                            {"sequence", status.sequence},
                            {"signal", control::signal_received()},
                            {"checkpoint_dir", control::checkpoint_dir()},
                            {"restart_count", env("SLURM_RESTART_COUNT")}};
        if (!out_dir.empty()) std::ofstream(out_dir + "/checkpoint.rank" + env("RANK") + ".json") << c.dump() << "\n";
        std::cout << "checkpointed: " << c.dump() << std::endl;
        return control::kCheckpointedExitCode;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return 0;
  }
  const std::string sleep_world = env("TEST_WORKER_SLEEP_WORLD_SIZE");
  if (sleep_world.empty() || sleep_world == env("WORLD_SIZE"))
    sleep_seconds(std::atof(env("TEST_WORKER_SLEEP", "0").c_str()));
  return 0;
}
