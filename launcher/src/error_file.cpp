#include "error_file.hpp"

#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

namespace elastrun::launcher {
namespace {

std::string first_line(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    auto start = line.find_first_not_of(" \t\r");
    if (start != std::string::npos) return line.substr(start, 400);
  }
  return {};
}

std::string as_text(const nlohmann::json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_null()) return {};
  return j.dump();
}

}  // namespace

std::optional<ErrorFileInfo> read_error_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) return std::nullopt;
  ErrorFileInfo info;
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    info.message = first_line(text);
    return info;
  }
  const nlohmann::json* msg = j.is_object() && j.contains("message") ? &j["message"] : &j;
  if (msg->is_object()) {
    if (msg->contains("message")) info.message = first_line(as_text((*msg)["message"]));
    if (msg->contains("extraInfo") && (*msg)["extraInfo"].is_object()) {
      const auto& extra = (*msg)["extraInfo"];
      if (extra.contains("py_callstack")) info.traceback = as_text(extra["py_callstack"]);
      if (extra.contains("timestamp")) info.timestamp = as_text(extra["timestamp"]);
    }
    if (info.message.empty()) info.message = first_line(msg->dump());
  } else {
    info.message = first_line(as_text(*msg));
  }
  return info;
}

}  // namespace elastrun::launcher
