#include "events.hpp"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <spdlog/spdlog.h>

namespace elastrun::launcher {

std::string event_line(double unix_seconds, std::string_view node, std::string_view run_id, std::string_view event,
                       const nlohmann::ordered_json& fields) {
  return worker::event_line(unix_seconds, node, run_id, event, std::nullopt, fields);
}

EventLog::EventLog(const std::string& path, std::string node, std::string run_id) {
  std::error_code ec;
  const auto dir = std::filesystem::path(path).parent_path();
  if (!dir.empty()) std::filesystem::create_directories(dir, ec);
  writer_ = worker::EventWriter(path, std::move(node), std::move(run_id));
}

void EventLog::emit(std::string_view event, const nlohmann::ordered_json& fields) {
  if (!writer_.write(event, fields) && !warned_) {
    warned_ = true;
    spdlog::warn("warning: writing the event log {}: {}", writer_.path(), std::strerror(errno));
  }
}

}  // namespace elastrun::launcher
