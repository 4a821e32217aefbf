// Test support: a daemon (etcd, munged, ...) started for one test program, in a private temp
// directory, and stopped and reaped by PID when the program ends. Header-only, tests only.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace elastrun::testing_support {

// Runs a command to completion; returns its exit code (-1 if it could not run or was killed).
inline int run_command(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return -1;
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

class Daemon {
 public:
  // `name` names the temp dir (elastrun-<name>-<pid>) and the log file there (<name>.log,
  // which receives the daemon's stdout and stderr).
  explicit Daemon(const std::string& name)
      : dir_(std::filesystem::temp_directory_path() / ("elastrun-" + name + "-" + std::to_string(getpid()))),
        log_(dir_ / (name + ".log")) {
    std::filesystem::create_directories(dir_);
  }
  ~Daemon() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  const std::filesystem::path& dir() const { return dir_; }

  // Starts `args` (looked up in PATH), then polls `ready` for up to `patience`. A daemon that
  // cannot start fails the whole test program with one line: every test needs it, and a
  // skipped suite would pass silently.
  void start(std::vector<std::string> args, const std::function<bool()>& ready,
             std::chrono::milliseconds patience = std::chrono::seconds(60)) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    int rc = posix_spawnp(&pid_, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) die("cannot start " + args[0] + " (is its Debian package installed? scripts/setup installs it)");
    auto deadline = std::chrono::steady_clock::now() + patience;
    while (std::chrono::steady_clock::now() < deadline) {
      if (ready()) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    die(args[0] + " did not become ready within " + std::to_string(patience.count()) + " ms (log " + log_.string() +
        ")");
  }

  [[noreturn]] static void die(const std::string& why) {
    std::fprintf(stderr, "FAIL: %s\n", why.c_str());
    std::exit(1);
  }

 private:
  std::filesystem::path dir_;
  std::filesystem::path log_;
  pid_t pid_ = -1;
};

}  // namespace elastrun::testing_support
