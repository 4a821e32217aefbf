#include "hang_watch.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <system_error>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "elastrun/util/parse.hpp"
#include "elastrun/worker/contract.hpp"
#include "subprocess.hpp"

namespace elastrun::launcher {

std::optional<TimerRequest> parse_timer_request(std::string_view line) {
  const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return std::nullopt;
  const auto pid = j.find("pid");
  const auto scope = j.find("scope_id");
  const auto expiration = j.find("expiration_time");
  if (pid == j.end() || !pid->is_number_integer() || scope == j.end() || !scope->is_string() || expiration == j.end() ||
      !expiration->is_number())
    return std::nullopt;
  TimerRequest r;
  r.pid = static_cast<pid_t>(pid->get<std::int64_t>());
  if (r.pid <= 0) return std::nullopt;
  r.scope = scope->get<std::string>();
  r.expiration = expiration->get<double>();
  if (!std::isfinite(r.expiration)) return std::nullopt;
  const auto sig = j.find("signal");
  r.signal = sig != j.end() && sig->is_number_integer() ? sig->get<int>() : 0;
  if (r.signal < 0 || r.signal >= 65) r.signal = 0;
  return r;
}

void TimerTable::apply(const TimerRequest& request) {
  const auto key = std::make_pair(request.pid, request.scope);
  if (request.expiration < 0)
    timers_.erase(key);
  else
    timers_[key] = request;
}

std::vector<ExpiredTimer> TimerTable::take_expired(double now) {
  std::map<pid_t, std::vector<const TimerRequest*>> expired;
  for (const auto& [key, timer] : timers_)
    if (timer.expiration <= now) expired[key.first].push_back(&timer);
  std::vector<ExpiredTimer> out;
  for (auto& [pid, timers] : expired) {
    std::sort(timers.begin(), timers.end(), [](auto* a, auto* b) { return a->expiration < b->expiration; });
    const auto with_signal = std::find_if(timers.begin(), timers.end(), [](auto* t) { return t->signal > 0; });
    const TimerRequest* chosen = with_signal != timers.end() ? *with_signal : timers.front();
    out.push_back({pid, chosen->scope, chosen->signal});
  }
  std::erase_if(timers_, [&](const auto& entry) { return expired.contains(entry.first.first); });
  return out;
}

FileTimerServer::FileTimerServer(std::filesystem::path fifo) : path_(std::move(fifo)) {
  std::error_code ec;
  std::filesystem::remove(path_, ec);
  if (::mkfifo(path_.c_str(), 0600) != 0)
    throw std::system_error(errno, std::generic_category(), "mkfifo " + path_.string());
  read_ = util::UniqueFd(::open(path_.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  if (!read_) throw std::system_error(errno, std::generic_category(), "open " + path_.string());
  keep_open_ = util::UniqueFd(::open(path_.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC));
  if (!keep_open_) throw std::system_error(errno, std::generic_category(), "open " + path_.string());
}

FileTimerServer::~FileTimerServer() {
  std::error_code ec;
  std::filesystem::remove(path_, ec);
}

std::vector<ExpiredTimer> FileTimerServer::poll(double now) {
  char buffer[4096];
  while (true) {
    const ssize_t n = ::read(read_.get(), buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    partial_.append(buffer, static_cast<std::size_t>(n));
    if (partial_.size() > (1 << 20)) partial_.clear();  // garbage without newlines: drop it
  }
  std::size_t start = 0;
  for (auto nl = partial_.find('\n'); nl != std::string::npos; nl = partial_.find('\n', start)) {
    if (auto request = parse_timer_request(std::string_view(partial_).substr(start, nl - start)))
      table_.apply(*request);
    start = nl + 1;
  }
  partial_.erase(0, start);
  return table_.take_expired(now);
}

std::optional<long> parse_progress_record(std::string_view record) {
  while (!record.empty() && (record.front() == ' ')) record.remove_prefix(1);
  while (!record.empty() && (record.back() == '\n' || record.back() == '\0')) record.remove_suffix(1);
  const auto step = util::parse_integer<long>(record);
  if (!step || *step < 0) return std::nullopt;
  return step;
}

std::optional<ProgressReading> read_progress(const std::string& path) {
  util::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return std::nullopt;
  char records[contract::kComputeRecordOffset + contract::kComputeRecordSize];
  const auto n = ::pread(fd.get(), records, sizeof records, 0);
  if (n <= 0) return std::nullopt;
  const std::string_view text(records, static_cast<std::size_t>(n));
  const auto step = parse_progress_record(text.substr(0, contract::kProgressRecordSize));
  if (!step) return std::nullopt;
  ProgressReading r{*step, std::nullopt};
  if (text.size() == sizeof records) r.compute_us = parse_progress_record(text.substr(contract::kComputeRecordOffset));
  return r;
}

std::optional<long> read_progress_step(const std::string& path) {
  const auto r = read_progress(path);
  return r ? std::optional(r->step) : std::nullopt;
}

bool is_hung(std::optional<double> last_progress, double now, double timeout_seconds) {
  return timeout_seconds > 0 && last_progress && now - *last_progress > timeout_seconds;
}

namespace {
std::string read_small(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  std::string text = s.str();
  if (text.size() > 8192) text.resize(8192);
  return text;
}

// Runs argv with stdout+stderr captured, killed after timeout_seconds. "" if it cannot run.
std::string capture(const std::vector<std::string>& argv, int timeout_seconds) {
  auto r = run_captured(argv, std::chrono::seconds(timeout_seconds));
  if (!r.started) return {};
  if (r.timed_out) r.output += fmt::format("\n[stack dump stopped after {} s]\n", timeout_seconds);
  return r.output;
}

bool on_path(const char* program) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (!dir.empty() && ::access((dir + "/" + program).c_str(), X_OK) == 0) return true;
  return false;
}
}  // namespace

std::string native_stacks(pid_t pid, int timeout_seconds) {
  try {
    std::string out;
    if (on_path("gdb")) {
      const auto text = capture({"gdb", "-nx", "-batch", "-p", std::to_string(pid), "-ex", "set pagination off", "-ex",
                                 "thread apply all bt 40"},
                                timeout_seconds);
      // keep the backtraces, not gdb's banner and symbol-loading chatter
      std::stringstream lines(text);
      for (std::string line; std::getline(lines, line);)
        if (line.starts_with("Thread ") || line.starts_with("#") || line.starts_with("[stack dump")) out += line + "\n";
      if (!out.empty()) return "native stacks (gdb):\n" + out;
    }
    const std::string proc = fmt::format("/proc/{}", pid);
    out = fmt::format("no gdb backtrace; /proc/{0}: wchan {1}, syscall {2}\n", pid, read_small(proc + "/wchan"),
                      read_small(proc + "/syscall"));
    const auto kernel = read_small(proc + "/stack");
    if (!kernel.empty()) out += "kernel stack:\n" + kernel;
    return out;
  } catch (const std::exception& e) {
    return fmt::format("no stacks: {}", e.what());
  }
}

}  // namespace elastrun::launcher
