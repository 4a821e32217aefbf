// Reading a worker's TORCHELASTIC_ERROR_FILE (PyTorch's @record JSON) into the failure summary.
#pragma once

#include <optional>
#include <string>

namespace elastrun::launcher {

struct ErrorFileInfo {
  std::string message;    // first line of the error message
  std::string traceback;  // extraInfo.py_callstack, if present
  std::string timestamp;  // extraInfo.timestamp (seconds since the epoch), if present
};

// Accepts {"message": {"message": "...", "extraInfo": {"py_callstack": ..., "timestamp": ...}}},
// {"message": "..."}, and, leniently, any other JSON or plain text (its first non-empty line).
// nullopt if the file does not exist or is empty.
std::optional<ErrorFileInfo> read_error_file(const std::string& path);

}  // namespace elastrun::launcher
