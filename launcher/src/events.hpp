// The agent's event log (`--events FILE`): one JSON object per line for everything a timeline or
// a post-mortem needs — state transitions, rounds, members lost, worker exits, restarts,
// checkpoint requests and their outcome, requeues. Schema: docs/launcher.md, "Event log".
//
// Several processes may append to one file (the agents of one node's log directory, the
// workers through ELASTRUN_EVENTS_FILE): the file is opened O_APPEND and every line goes out in
// one write(2), so on a local filesystem lines never interleave. On NFS O_APPEND is not atomic:
// give each node its own file (the default, events-<node>.jsonl).
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "elastrun/util/unique_fd.hpp"

namespace elastrun::launcher {

// {"time": <unix seconds, ms precision>, "node": ..., "run_id": ..., "event": ..., <fields>}
// without a trailing newline; invalid UTF-8 in a field is replaced, never thrown about.
std::string event_line(double unix_seconds, std::string_view node, std::string_view run_id, std::string_view event,
                       const nlohmann::json& fields);

class EventLog {
 public:
  EventLog() = default;  // off: emit() does nothing
  // Opens (creating, 0644) `path` for appending; its directory is created. Throws
  // std::system_error naming the path.
  EventLog(const std::string& path, std::string node, std::string run_id);

  bool enabled() const { return static_cast<bool>(fd_); }
  const std::string& path() const { return path_; }

  // Appends one event; a failed write is logged once as a warning and the job goes on.
  void emit(std::string_view event, const nlohmann::json& fields = nlohmann::json::object());

 private:
  util::UniqueFd fd_;
  std::string path_, node_, run_id_;
  bool warned_ = false;
};

}  // namespace elastrun::launcher
