// elastrun/control.hpp: the agent -> worker control channel, the worker's side, for training code
// (header only; C++17 or later, the standard library and POSIX, nothing else). The agent's writer
// is launcher/src/control_file.hpp; the names both use are the worker contract's
// (elastrun/worker/contract.hpp, generated from worker/contract.json).
//
// The elastrun agent tells its workers "checkpoint now" or "checkpoint and stop" through a small
// file named by $ELASTRUN_CONTROL_FILE (one per attempt), not through a signal: NCCL and other
// libraries intercept SIGUSR1, and a signal cannot be polled at a safe point of a training step.
// The file holds one line "<sequence> <request>", e.g. "1 checkpoint-and-stop"; the agent
// replaces it atomically (write a temporary file, rename), so a reader sees the old or the new
// line, never a torn one. poll() costs one stat() while nothing changed: call it every step.
//
//   #include <elastrun/control.hpp>
//   elastrun::control::install_signal_handlers();  // SIGUSR1/SIGUSR2/SIGTERM: stop request, not death
//   for (step...) {
//     train_step();
//     if (elastrun::control::poll().stop()) {        // in multi-rank jobs: all-reduce (max) first
//       save_checkpoint(elastrun::control::checkpoint_dir());
//       return elastrun::control::kCheckpointedExitCode;  // 85: "checkpointed, please requeue"
//     }
//   }
//
// The Python helper elastrun_control.py has the same semantics. See docs/launcher.md.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "elastrun/worker/contract.hpp"

namespace elastrun::control {

// Worker exit code meaning "I saved a checkpoint and stopped; please requeue/restart me".
// 85 is outside the codes programs commonly use: 0-2 (success, error, usage), 64-78
// (sysexits.h), 126/127 (shell: not executable / not found), 128+N (killed by signal N).
inline constexpr int kCheckpointedExitCode = contract::kCheckpointedExitCode;

inline constexpr const char* kControlFileEnv = contract::env::kControlFile.data();
inline constexpr const char* kCheckpointDirEnv = contract::env::kCheckpointDir.data();

enum class Request : int {
  None = 0,               // keep training
  Checkpoint = 1,         // save a checkpoint, keep training
  CheckpointAndStop = 2,  // save a checkpoint, exit with kCheckpointedExitCode
};

inline std::string_view to_string(Request r) {
  const auto level = static_cast<std::size_t>(r);
  return level < contract::kControlRequests.size() ? contract::kControlRequests[level] : contract::kControlRequests[0];
}

inline std::optional<Request> request_from_string(std::string_view text) {
  for (Request r : {Request::None, Request::Checkpoint, Request::CheckpointAndStop})
    if (text == to_string(r)) return r;
  return std::nullopt;
}

struct Status {
  Request request = Request::None;
  std::uint64_t sequence = 0;  // grows with every request the agent writes; 0: none yet
  bool checkpoint() const { return request != Request::None; }
  bool stop() const { return request == Request::CheckpointAndStop; }
};

// "<sequence> <request>[\n]" -> Status; nullopt if malformed.
inline std::optional<Status> parse(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ')) text.remove_suffix(1);
  const auto space = text.find(' ');
  if (space == 0 || space == std::string_view::npos) return std::nullopt;
  Status s;
  for (char c : text.substr(0, space)) {
    if (c < '0' || c > '9') return std::nullopt;
    s.sequence = s.sequence * 10 + static_cast<std::uint64_t>(c - '0');
  }
  auto request = request_from_string(text.substr(space + 1));
  if (!request) return std::nullopt;
  s.request = *request;
  return s;
}

// Suffix of the marker file a reader creates on its first poll, so the agent knows the workers
// use the channel (then a stop signal waits for their checkpoint instead of stopping them).
inline constexpr const char* kSeenSuffix = contract::kControlSeenSuffix.data();

// A reader of one control file. Not thread-safe; cheap to keep per thread.
class Channel {
 public:
  // The file named by $ELASTRUN_CONTROL_FILE; disabled (poll() returns None) when unset.
  Channel() {
    const char* p = std::getenv(kControlFileEnv);
    if (p) path_ = p;
  }
  explicit Channel(std::string path) : path_(std::move(path)) {}

  bool enabled() const { return !path_.empty(); }
  const std::string& path() const { return path_; }

  // The current request. One stat() when the file did not change since the last call (the
  // agent's rename gives it a new inode); an unreadable or missing file reads as the last state.
  Status poll() {
    if (path_.empty()) return last_;
    if (!announced_) {
      announced_ = true;
      const int fd = ::open((path_ + kSeenSuffix).c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
      if (fd >= 0) ::close(fd);
    }
    struct stat st {};
    if (::stat(path_.c_str(), &st) != 0) return last_;
    if (have_stat_ && st.st_ino == ino_ && st.st_dev == dev_ && st.st_size == size_ &&
        st.st_mtim.tv_sec == mtime_.tv_sec && st.st_mtim.tv_nsec == mtime_.tv_nsec)
      return last_;
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return last_;
    char buf[128];
    ssize_t n;
    do n = ::read(fd, buf, sizeof buf);
    while (n < 0 && errno == EINTR);
    ::close(fd);
    if (n <= 0) return last_;
    if (auto s = parse(std::string_view(buf, static_cast<std::size_t>(n)))) {
      last_ = *s;
      have_stat_ = true;
      ino_ = st.st_ino;
      dev_ = st.st_dev;
      size_ = st.st_size;
      mtime_ = st.st_mtim;
    }
    return last_;
  }

 private:
  std::string path_;
  Status last_;
  bool announced_ = false;
  bool have_stat_ = false;
  ino_t ino_ = 0;
  dev_t dev_ = 0;
  off_t size_ = 0;
  timespec mtime_{};
};

namespace detail {
inline volatile sig_atomic_t g_stop_signal = 0;
inline void on_stop_signal(int sig) { g_stop_signal = sig; }
}  // namespace detail

// Makes SIGUSR1, SIGUSR2 and SIGTERM set a process-local checkpoint-and-stop request (seen by
// poll()) instead of killing the process. Slurm delivers its --signal warning and preemption's
// SIGTERM to every process of the step, workers included; with these handlers they survive to
// checkpoint. Call once, early (after libraries that install their own handlers, if any).
inline bool install_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = detail::on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  bool ok = true;
  for (int sig : {SIGUSR1, SIGUSR2, SIGTERM}) ok = ::sigaction(sig, &sa, nullptr) == 0 && ok;
  return ok;
}

// The signal caught by install_signal_handlers' handlers, 0 if none.
inline int signal_received() { return detail::g_stop_signal; }

// The process-wide channel ($ELASTRUN_CONTROL_FILE), merged with a caught stop signal.
inline Status poll() {
  static Channel channel;
  Status s = channel.poll();
  if (signal_received() != 0 && !s.stop()) s.request = Request::CheckpointAndStop;
  return s;
}

namespace detail {
// $ELASTRUN_PROGRESS_FILE, opened once and kept for the process's life; -1 when the agent does
// not watch (no --hang-timeout).
inline int progress_fd() {
  static const int fd = [] {
    const char* path = std::getenv(contract::env::kProgressFile.data());
    if (path == nullptr || *path == '\0') return -1;
    return ::open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  }();
  return fd;
}
}  // namespace detail

// Tells the agent this worker made progress (elastrun --hang-timeout): call it once per step with
// the step number. One pwrite() of a fixed-size record (contract::kProgressRecordFormat; Python's
// elastrun.control.progress writes the same) at the start of $ELASTRUN_PROGRESS_FILE: the agent
// reads the step from it, and the file's modification time is the time of the last progress.
// Nothing when the agent does not watch.
inline void progress(std::int64_t step) {
  const int fd = detail::progress_fd();
  if (fd < 0) return;
  char record[contract::kProgressRecordSize + 1];
  std::snprintf(record, sizeof record, contract::kProgressRecordFormat, static_cast<long>(step));
  while (::pwrite(fd, record, contract::kProgressRecordSize, 0) < 0 && errno == EINTR) {
  }
}

namespace detail {
inline std::int64_t& compute_us_so_far() {
  static std::int64_t total = 0;
  return total;
}
}  // namespace detail

// The same with this step's compute time: the seconds this rank spent computing before the
// step's collectives (forward, loss, backward before the gradients' all-reduce). In synchronous
// training every rank's step takes as long as the slowest's, so step times cannot find a slow
// node; compute times can: the agent compares them across nodes (--straggler-action). Writes the
// compute record (contract::kComputeRecordFormat: the sum so far, in microseconds) after the
// progress record, in the same pwrite().
inline void progress(std::int64_t step, double compute_seconds) {
  const int fd = detail::progress_fd();
  if (fd < 0) return;
  auto& total = detail::compute_us_so_far();
  total += static_cast<std::int64_t>(std::floor(compute_seconds * 1e6 + 0.5));
  char record[contract::kComputeRecordOffset + contract::kComputeRecordSize + 1];
  std::snprintf(record, contract::kProgressRecordSize + 1, contract::kProgressRecordFormat, static_cast<long>(step));
  std::snprintf(record + contract::kComputeRecordOffset, contract::kComputeRecordSize + 1,
                contract::kComputeRecordFormat, static_cast<long>(total));
  while (::pwrite(fd, record, contract::kComputeRecordOffset + contract::kComputeRecordSize, 0) < 0 && errno == EINTR) {
  }
}

// Progress without a step (a long save, a slow data loader): only the modification time changes,
// the last step reported stays.
inline void progress() {
  const int fd = detail::progress_fd();
  if (fd >= 0) ::futimens(fd, nullptr);
}

// $ELASTRUN_CHECKPOINT_DIR (elastrun --checkpoint-dir), "" if not given.
inline std::string checkpoint_dir() {
  const char* p = std::getenv(kCheckpointDirEnv);
  return p ? p : "";
}

}  // namespace elastrun::control
