#include "events.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <spdlog/spdlog.h>

namespace elastrun::launcher {

std::string event_line(double unix_seconds, std::string_view node, std::string_view run_id, std::string_view event,
                       const nlohmann::json& fields) {
  nlohmann::ordered_json j = {
      {"time", std::round(unix_seconds * 1000.0) / 1000.0}, {"node", node}, {"run_id", run_id}, {"event", event}};
  if (fields.is_object())
    for (const auto& [key, value] : fields.items()) j[key] = value;
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

EventLog::EventLog(const std::string& path, std::string node, std::string run_id)
    : path_(path), node_(std::move(node)), run_id_(std::move(run_id)) {
  std::error_code ec;
  const auto dir = std::filesystem::path(path).parent_path();
  if (!dir.empty()) std::filesystem::create_directories(dir, ec);
  fd_.reset(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
  if (!fd_) throw std::system_error(errno, std::generic_category(), "opening the event log " + path);
}

void EventLog::emit(std::string_view event, const nlohmann::json& fields) {
  if (!fd_) return;
  const auto now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::string line = event_line(now, node_, run_id_, event, fields);
  line += '\n';
  const auto n = ::write(fd_.get(), line.data(), line.size());  // one write: lines never interleave
  if (n != static_cast<ssize_t>(line.size()) && !warned_) {
    warned_ = true;
    spdlog::warn("warning: writing the event log {}: {}", path_, n < 0 ? std::strerror(errno) : "short write");
  }
}

}  // namespace elastrun::launcher
