// elastrun/worker/events.hpp: the event writer of schema v1 (docs/events.md), the one the agent
// and training code both use (header only: the standard library, POSIX and nlohmann-json).
//
//   auto events = elastrun::worker::EventWriter::from_environment(rank);  // off without the agent's log
//   events.write(elastrun::contract::event::kStep, {{"step", step}, {"loss", loss}});
//
// A line is {"v":1,"time":...,"node":...,"run_id":...,"event":...,["rank":...,]<fields>}. Several
// processes append to one file (the agent and the workers of a node): it is opened O_APPEND and
// every line goes out in one write(2), so on a local filesystem lines never interleave.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <nlohmann/json.hpp>

#include "elastrun/worker/contract.hpp"

namespace elastrun::worker {

// One event line without its newline. `fields` (an object) follow the common ones in their
// order; a field that repeats a common one is ignored. Invalid UTF-8 is replaced, never thrown.
inline std::string event_line(double unix_seconds, std::string_view node, std::string_view run_id,
                              std::string_view event, std::optional<int> rank, const nlohmann::ordered_json& fields) {
  namespace field = contract::field;
  nlohmann::ordered_json j = {{field::kV, contract::kEventsSchemaVersion},
                              {field::kTime, std::round(unix_seconds * 1000.0) / 1000.0},
                              {field::kNode, node},
                              {field::kRunId, run_id},
                              {field::kEvent, event}};
  if (rank) j[std::string(field::kRank)] = *rank;
  if (fields.is_object())
    for (const auto& [key, value] : fields.items())
      if (!j.contains(key)) j[key] = value;
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

class EventWriter {
 public:
  EventWriter() = default;  // off: write() does nothing
  // Opens (creating, 0644) `path` for appending. Throws std::system_error naming the path.
  EventWriter(const std::string& path, std::string node, std::string run_id, std::optional<int> rank = std::nullopt)
      : path_(path), node_(std::move(node)), run_id_(std::move(run_id)), rank_(rank) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "opening the event log " + path);
  }
  // A worker's writer: $ELASTRUN_EVENTS_FILE, $ELASTRUN_NODE and $TORCHELASTIC_RUN_ID from the
  // agent; off when the agent keeps no event log (or the file cannot be opened).
  static EventWriter from_environment(std::optional<int> rank) {
    auto get = [](std::string_view name) {
      const char* v = std::getenv(std::string(name).c_str());
      return std::string(v ? v : "");
    };
    const std::string path = get(contract::env::kEventsFile);
    if (path.empty()) return {};
    try {
      return EventWriter(path, get(contract::env::kNode), get(contract::env::kRunId), rank);
    } catch (const std::system_error&) {
      return {};
    }
  }
  EventWriter(EventWriter&& other) noexcept { *this = std::move(other); }
  EventWriter& operator=(EventWriter&& other) noexcept {
    if (this != &other) {
      close();
      fd_ = std::exchange(other.fd_, -1);
      path_ = std::move(other.path_);
      node_ = std::move(other.node_);
      run_id_ = std::move(other.run_id_);
      rank_ = other.rank_;
    }
    return *this;
  }
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;
  ~EventWriter() { close(); }

  bool enabled() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  const std::string& node() const { return node_; }
  const std::string& run_id() const { return run_id_; }

  // Appends one line, now. False (errno set) when it could not be written whole.
  bool write(std::string_view event, const nlohmann::ordered_json& fields = nlohmann::ordered_json::object()) {
    if (fd_ < 0) return true;
    const auto now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    std::string line = event_line(now, node_, run_id_, event, rank_, fields);
    line += '\n';
    ssize_t n;
    do n = ::write(fd_, line.data(), line.size());  // one write: lines never interleave
    while (n < 0 && errno == EINTR);
    if (n >= 0 && static_cast<std::size_t>(n) != line.size()) errno = EIO;
    return n >= 0 && static_cast<std::size_t>(n) == line.size();
  }

 private:
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int fd_ = -1;
  std::string path_, node_, run_id_;
  std::optional<int> rank_;
};

}  // namespace elastrun::worker
