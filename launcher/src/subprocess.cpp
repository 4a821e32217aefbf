#include "subprocess.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "elastrun/util/unique_fd.hpp"
#include "reaper.hpp"

extern char** environ;

namespace elastrun::launcher {

namespace {
constexpr std::size_t kMaxOutput = 1 << 20;

void drain(int fd, std::string& out) {
  char buffer[4096];
  ssize_t n;
  while ((n = ::read(fd, buffer, sizeof buffer)) > 0)
    if (out.size() < kMaxOutput) out.append(buffer, static_cast<std::size_t>(n));
}

// The agent's environment with `extra` (NAME=VALUE) added or replacing, built before the fork.
std::vector<std::string> environment_with(const std::vector<std::string>& extra) {
  std::map<std::string, std::string> by_name;
  std::vector<std::string> order;
  auto put = [&](const std::string& entry) {
    const auto eq = entry.find('=');
    const auto name = entry.substr(0, eq);
    if (!by_name.contains(name)) order.push_back(name);
    by_name[name] = entry;
  };
  for (char** e = environ; *e; ++e) put(*e);
  for (const auto& entry : extra) put(entry);
  std::vector<std::string> out;
  for (const auto& name : order) out.push_back(by_name[name]);
  return out;
}
}  // namespace

namespace {
struct Spawned {
  pid_t pid = -1;
  util::UniqueFd read_end;
  std::string error;  // why it could not start
};

// fork + exec with output into a pipe (see the header); async-signal-safe calls only in the child.
Spawned spawn_captured(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env) {
  Spawned s;
  if (argv.empty()) {
    s.error = "no command";
    return s;
  }
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    s.error = fmt::format("pipe: {}", std::strerror(errno));
    return s;
  }
  util::UniqueFd read_end(fds[0]), write_end(fds[1]);
  std::vector<std::string> args_copy = argv;
  std::vector<char*> args;
  for (auto& a : args_copy) args.push_back(a.data());
  args.push_back(nullptr);
  std::vector<std::string> env_copy = environment_with(extra_env);
  std::vector<char*> env;
  for (auto& e : env_copy) env.push_back(e.data());
  env.push_back(nullptr);
  const pid_t child = ::fork();
  if (child < 0) {
    s.error = fmt::format("fork: {}", std::strerror(errno));
    return s;
  }
  if (child == 0) {
    ::setpgid(0, 0);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::dup2(write_end.get(), 1);
    ::dup2(write_end.get(), 2);
    const int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, 0);
    ::execvpe(args[0], args.data(), env.data());
    const char* why = std::strerror(errno);
    [[maybe_unused]] auto ignored = ::write(2, "cannot run it: ", 15);
    ignored = ::write(2, why, std::strlen(why));
    ::_exit(127);
  }
  ::fcntl(read_end.get(), F_SETFL, O_NONBLOCK);
  s.pid = child;
  s.read_end = std::move(read_end);
  return s;
}

void set_status(CommandOutput& out, int status) {
  if (WIFEXITED(status)) out.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) out.signal = WTERMSIG(status);
}
}  // namespace

CommandOutput run_captured(const std::vector<std::string>& argv, std::chrono::milliseconds timeout,
                           const std::vector<std::string>& extra_env) {
  CommandOutput result;
  auto spawned = spawn_captured(argv, extra_env);
  if (spawned.pid < 0) {
    result.output = spawned.error;
    return result;
  }
  result.started = true;
  const pid_t child = spawned.pid;
  const int fd = spawned.read_end.get();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (true) {
    drain(fd, result.output);
    const pid_t done = ::waitpid(child, &status, WNOHANG);
    if (done == child) break;
    if (done < 0 && errno != EINTR) {  // cannot happen for our own child; do not spin
      result.exit_code = -1;
      return result;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(-child, SIGKILL);
      ::kill(child, SIGKILL);
      while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
      }
      result.timed_out = true;
      break;
    }
    ::usleep(20'000);
  }
  ::kill(-child, SIGKILL);  // what it left behind in its group (a backgrounded helper)
  drain(fd, result.output);
  set_status(result, status);
  return result;
}

struct BackgroundCommand::Shared {
  std::mutex mutex;
  std::optional<int> status;  // set by the reaper's handler
};

BackgroundCommand::BackgroundCommand(const std::vector<std::string>& argv, std::chrono::milliseconds timeout,
                                     Reaper& reaper)
    : shared_(std::make_shared<Shared>()), deadline_(std::chrono::steady_clock::now() + timeout) {
  auto spawned = spawn_captured(argv, {});
  if (spawned.pid < 0) {
    output_.output = spawned.error;
    return;
  }
  output_.started = true;
  pid_ = spawned.pid;
  read_end_ = std::move(spawned.read_end);
  reaper.own(pid_, [shared = shared_](pid_t, int status) {
    std::lock_guard lock(shared->mutex);
    shared->status = status;
  });
}

BackgroundCommand::~BackgroundCommand() {
  if (pid_ > 0) {
    std::lock_guard lock(shared_->mutex);
    if (!shared_->status) {
      ::kill(-pid_, SIGKILL);
      ::kill(pid_, SIGKILL);
    }
  }
}

std::optional<CommandOutput> BackgroundCommand::poll() {
  if (pid_ < 0) return output_;  // it never started
  if (read_end_) drain(read_end_.get(), output_.output);
  std::optional<int> status;
  {
    std::lock_guard lock(shared_->mutex);
    status = shared_->status;
  }
  if (!status) {
    if (!output_.timed_out && std::chrono::steady_clock::now() > deadline_) {
      output_.timed_out = true;
      ::kill(-pid_, SIGKILL);
      ::kill(pid_, SIGKILL);
    }
    return std::nullopt;
  }
  ::kill(-pid_, SIGKILL);  // what it left behind in its group
  if (read_end_) drain(read_end_.get(), output_.output);
  set_status(output_, *status);
  return output_;
}

std::string last_line(const std::string& text, std::size_t max_chars) {
  std::size_t end = text.size();
  while (end > 0) {
    while (end > 0 && (text[end - 1] == '\n' || text[end - 1] == '\r' || text[end - 1] == ' ' || text[end - 1] == '\t'))
      --end;
    if (end == 0) break;
    const auto start = text.rfind('\n', end - 1);
    const auto begin = start == std::string::npos ? 0 : start + 1;
    std::string line = text.substr(begin, end - begin);
    const auto first = line.find_first_not_of(" \t");
    if (first != std::string::npos) {
      line = line.substr(first);
      if (line.size() > max_chars) line = line.substr(0, max_chars) + "...";
      return line;
    }
    end = begin;
  }
  return {};
}

}  // namespace elastrun::launcher
