#include "job_dir.hpp"

#include <signal.h>
#include <spawn.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "elastrun/util/unique_fd.hpp"

extern char** environ;

namespace elastrun::launcher {

namespace fs = std::filesystem;

namespace {

std::string get(const rdzv::EnvMap& env, std::string_view name) {
  auto it = env.find(name);
  return it == env.end() ? std::string() : it->second;
}

// Creates `dir` (0700 for what we create) and checks we can write there; "" or the reason.
std::string usable(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    fs::create_directories(dir.parent_path(), ec);
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return std::strerror(errno);
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) return std::strerror(errno);
  return {};
}

}  // namespace

std::string replace_job_id(std::string text, const std::string& job_id) {
  for (auto at = text.find("%j"); at != std::string::npos; at = text.find("%j", at + job_id.size()))
    text.replace(at, 2, job_id);
  return text;
}

void add_index_entry(const std::string& link, const std::string& target) {
  if (link.empty()) return;
  std::error_code ec;
  const fs::path entry(link);
  fs::create_directories(entry.parent_path(), ec);
  if (fs::is_symlink(entry, ec) && fs::read_symlink(entry, ec) == fs::path(target)) return;
  // `elastrun run` puts a job's directory at its index entry itself
  if (!fs::is_symlink(entry, ec) && fs::is_directory(entry, ec) && fs::equivalent(entry, target, ec)) return;
  // every agent of the job may get here at once: a private name, then an atomic rename
  const fs::path tmp = entry.string() + fmt::format(".tmp.{}", ::getpid());
  fs::remove(tmp, ec);
  fs::create_symlink(target, tmp, ec);
  if (!ec) fs::rename(tmp, entry, ec);
  if (ec) {
    fs::remove(tmp, ec);
    spdlog::warn("warning: cannot add the job to the index {}: {}", link, ec.message());
  }
}

std::optional<JobDirPlan> plan_job_dir(const rdzv::EnvMap& env) {
  const std::string setting = get(env, kJobDirEnv);
  if (setting == "none") return std::nullopt;
  JobDirPlan plan;
  plan.job_id = get(env, "SLURM_JOB_ID");
  plan.cluster = get(env, "SLURM_CLUSTER_NAME");
  if (plan.cluster.empty()) plan.cluster = "cluster";
  if (plan.job_id.empty()) {  // not a Slurm job: only a directory named outright
    if (setting.empty() || setting.find("%j") != std::string::npos) return std::nullopt;
    plan.path = setting;
    return plan;
  }
  if (!setting.empty()) {
    plan.path = replace_job_id(setting, plan.job_id);
  } else {
    const std::string submit_dir = get(env, "SLURM_SUBMIT_DIR");
    if (submit_dir.empty()) return std::nullopt;
    plan.path = (fs::path(submit_dir) / ("elastrun-" + plan.job_id)).string();
  }
  std::string index = get(env, kIndexDirEnv);
  if (index.empty() && !get(env, "HOME").empty()) index = (fs::path(get(env, "HOME")) / ".elastrun" / "jobs").string();
  if (!index.empty()) plan.index_link = (fs::path(index) / plan.cluster / plan.job_id).string();
  return plan;
}

std::string make_job_dir(const JobDirPlan& plan, const rdzv::EnvMap& env) {
  std::error_code ec;
  const fs::path wanted = fs::absolute(plan.path, ec);
  const std::string why = usable(wanted);
  if (why.empty()) {
    add_index_entry(plan.index_link, wanted.string());
    return wanted.string();
  }
  std::string tmp = get(env, "TMPDIR");
  if (tmp.empty()) tmp = "/tmp";
  const fs::path fallback = fs::path(tmp) / fmt::format("elastrun-{}", ::getuid()) / "jobs" / plan.cluster /
                            (plan.job_id.empty() ? std::string("local") : plan.job_id);
  if (const std::string why2 = usable(fallback); !why2.empty()) {
    spdlog::warn("warning: cannot use the job directory {} ({}) nor {} ({}): no job directory; give one with {}=DIR",
                 wanted.string(), why, fallback.string(), why2, kJobDirEnv);
    return {};
  }
  spdlog::warn("warning: cannot use the job directory {} ({}); this node writes its events and logs to {} instead",
               wanted.string(), why, fallback.string());
  add_index_entry(plan.index_link, fallback.string());
  return fallback.string();
}

int run_job_dir_command(int argc, char** /*argv*/) {
  if (argc > 1) {
    fmt::print(stderr, "elastrun job-dir: takes no arguments (it prints this job's directory)\n");
    return 2;
  }
  const auto plan = plan_job_dir(rdzv::current_environment());
  if (!plan) {
    fmt::print(stderr, "elastrun job-dir: no job directory here: not in a Slurm job (or {}=none); set {}=DIR\n",
               kJobDirEnv, kJobDirEnv);
    return 1;
  }
  std::error_code ec;
  fmt::print("{}\n", fs::absolute(plan->path, ec).string());
  return 0;
}

namespace {

const int kForwarded[] = {SIGTERM, SIGUSR1, SIGUSR2, SIGINT, SIGHUP};

bool outcome_succeeded(const std::string& path) {
  std::ifstream in(path);
  if (!in) return false;
  const auto j = nlohmann::json::parse(in, nullptr, false);
  return j.is_object() && j.value("outcome", "") == "succeeded";
}

}  // namespace

int run_job_step_command(int argc, char** argv) {
  if (argc < 2) {
    fmt::print(stderr, "elastrun job-step: usage: elastrun job-step COMMAND [ARGS...] (e.g. srun ... elastrun ...)\n");
    return 2;
  }
  const auto env = rdzv::current_environment();
  std::string outcome;
  if (auto it = env.find("ELASTRUN_OUTCOME_FILE"); it != env.end() && !it->second.empty()) {
    outcome = it->second;
  } else if (auto plan = plan_job_dir(env)) {
    const std::string dir = make_job_dir(*plan, env);  // before the agents, so it is there for them
    if (!dir.empty()) outcome = (fs::path(dir) / kOutcomeFileName).string();
  }
  std::error_code ec;
  if (!outcome.empty()) fs::remove(outcome, ec);  // a requeued job's earlier run left it

  sigset_t forwarded;
  sigemptyset(&forwarded);
  for (int sig : kForwarded) sigaddset(&forwarded, sig);
  sigaddset(&forwarded, SIGCHLD);
  sigset_t previous;
  if (::sigprocmask(SIG_BLOCK, &forwarded, &previous) != 0) {
    fmt::print(stderr, "elastrun job-step: sigprocmask: {}\n", std::strerror(errno));
    return 1;
  }
  util::UniqueFd signals(::signalfd(-1, &forwarded, SFD_CLOEXEC));
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t defaults;
  sigemptyset(&defaults);
  for (int sig : kForwarded) sigaddset(&defaults, sig);
  sigaddset(&defaults, SIGCHLD);
  posix_spawnattr_setsigmask(&attr, &previous);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t child = -1;
  const int spawned = ::posix_spawnp(&child, argv[1], nullptr, &attr, argv + 1, environ);
  posix_spawnattr_destroy(&attr);
  if (spawned != 0 || !signals) {
    fmt::print(stderr, "elastrun job-step: cannot run {}: {}\n", argv[1],
               std::strerror(spawned != 0 ? spawned : errno));
    return 127;
  }
  int status = 0;
  while (true) {
    const pid_t done = ::waitpid(child, &status, WNOHANG);
    if (done == child) break;
    signalfd_siginfo info{};
    const auto n = ::read(signals.get(), &info, sizeof info);
    if (n != static_cast<ssize_t>(sizeof info)) {
      if (n < 0 && errno == EINTR) continue;
      if (::waitpid(child, &status, 0) == child) break;  // cannot read signals: just wait
      continue;
    }
    if (info.ssi_signo != SIGCHLD) ::kill(child, static_cast<int>(info.ssi_signo));  // e.g. Slurm's --signal
  }
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (rc != 0 && !outcome.empty() && outcome_succeeded(outcome)) {
    fmt::print(
        "elastrun job-step: {} exited {} (tasks of nodes that left the job were ended) but training succeeded "
        "({}); exiting 0\n",
        argv[1], rc, outcome);
    return 0;
  }
  return rc;
}

}  // namespace elastrun::launcher
