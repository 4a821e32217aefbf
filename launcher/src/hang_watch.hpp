// Hung workers: alive, not progressing (stuck in a collective, a deadlock). Two ways to see them:
//  - torch's own protocol, so scripts that already use it work unchanged: with
//    TORCHELASTIC_ENABLE_FILE_TIMER=1 the agent creates the FIFO named by TORCHELASTIC_TIMER_FILE
//    and serves torch.distributed.elastic.timer.FileTimerClient requests; an expired timer's
//    signal (SIGKILL by default) goes to its worker, as torchrun's FileTimerServer does.
//  - elastrun's opt-in progress call (elastrun::control::progress(), elastrun_control.progress()),
//    which touches $ELASTRUN_PROGRESS_FILE: with --hang-timeout S, a worker that reported progress
//    once and then not for S seconds is hung; the agent dumps its stacks and restarts the group.
// Decisions are pure (TimerTable, is_hung); FileTimerServer owns the FIFO.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "elastrun/util/unique_fd.hpp"

namespace elastrun::launcher {

// One line a FileTimerClient writes: {"version": 1, "pid": P, "scope_id": S, "expiration_time": T
// (seconds since the epoch; negative: release), "signal": N}. nullopt for anything else.
struct TimerRequest {
  pid_t pid = 0;
  std::string scope;
  double expiration = 0;
  int signal = 0;
};
std::optional<TimerRequest> parse_timer_request(std::string_view line);

struct ExpiredTimer {
  pid_t pid = 0;
  std::string scope;
  int signal = 0;  // > 0: send it; 0: the client asked for no kill (logged only)
};

// FileTimerServer's bookkeeping: one timer per (pid, scope); a release removes it.
class TimerTable {
 public:
  void apply(const TimerRequest& request);
  // Per pid with an expired timer: the earliest-expiring one that carries a signal (else the
  // earliest); all that pid's timers are then cleared, as torch does after reaping.
  std::vector<ExpiredTimer> take_expired(double now);
  std::size_t size() const { return timers_.size(); }

 private:
  std::map<std::pair<pid_t, std::string>, TimerRequest> timers_;
};

class FileTimerServer {
 public:
  // Creates the FIFO (replacing a stale file); throws std::system_error naming it.
  explicit FileTimerServer(std::filesystem::path fifo);
  ~FileTimerServer();  // removes the FIFO
  FileTimerServer(const FileTimerServer&) = delete;
  FileTimerServer& operator=(const FileTimerServer&) = delete;
  const std::filesystem::path& path() const { return path_; }
  // Reads what the clients wrote and returns the timers expired by `now` (epoch seconds).
  std::vector<ExpiredTimer> poll(double now);

 private:
  std::filesystem::path path_;
  util::UniqueFd read_, keep_open_;  // our own writer keeps the FIFO from reading end-of-file
  std::string partial_;
  TimerTable table_;
};

// --hang-timeout: hung when progress was reported at least once (the worker opted in) and the
// last report is older than the timeout.
bool is_hung(std::optional<double> last_progress, double now, double timeout_seconds);

// The step a worker last reported with progress(step) (the record of the worker contract,
// contract::kProgressRecordFormat); nullopt when it reported none or the file is unreadable.
std::optional<long> read_progress_step(const std::string& path);
// The same with the compute record that follows it when the worker reports compute times
// (progress(step, compute_s); contract::kComputeRecordFormat): its compute time so far, in us.
struct ProgressReading {
  long step = -1;
  std::optional<long> compute_us;
};
std::optional<ProgressReading> read_progress(const std::string& path);
// Parses one progress record; nullopt unless it holds a step >= 0.
std::optional<long> parse_progress_record(std::string_view record);

// Native stacks of every thread of `pid` with gdb (when installed; bounded by timeout_seconds),
// else what /proc tells (state, wchan, syscall, kernel stack when readable). Never throws.
std::string native_stacks(pid_t pid, int timeout_seconds);

}  // namespace elastrun::launcher
