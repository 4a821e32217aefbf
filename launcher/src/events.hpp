// The agent's event log (`--events FILE`, or the job directory's events-<node>.jsonl): one JSON
// object per line, schema v1 (docs/events.md), for everything a timeline or a post-mortem needs —
// state transitions, rounds, members lost, worker exits, restarts, checkpoint requests and their
// outcome, requeues. The line format and the writer are the worker contract's
// (elastrun/worker/events.hpp): the workers append their own events to the same file.
//
// On NFS O_APPEND is not atomic: give each node its own file (the default, events-<node>.jsonl).
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "elastrun/worker/contract.hpp"
#include "elastrun/worker/events.hpp"

namespace elastrun::launcher {

// The agent's lines: no rank. See worker::event_line.
std::string event_line(double unix_seconds, std::string_view node, std::string_view run_id, std::string_view event,
                       const nlohmann::ordered_json& fields);

class EventLog {
 public:
  EventLog() = default;  // off: emit() does nothing
  // Opens (creating, 0644) `path` for appending; its directory is created. Throws
  // std::system_error naming the path.
  EventLog(const std::string& path, std::string node, std::string run_id);

  bool enabled() const { return writer_.enabled(); }
  const std::string& path() const { return writer_.path(); }

  // Appends one event; a failed write is logged once as a warning and the job goes on.
  void emit(std::string_view event, const nlohmann::ordered_json& fields = nlohmann::ordered_json::object());

 private:
  worker::EventWriter writer_;
  bool warned_ = false;
};

}  // namespace elastrun::launcher
