// The agent's side of the control channel: it writes the file the workers poll
// (elastrun/control.hpp, the worker's side; the format is in docs/launcher.md, "Control channel").
#pragma once

#include <string>

#include "elastrun/control.hpp"

namespace elastrun::launcher {

// "<sequence> <request>\n", the line the workers parse (control::parse).
std::string control_line(const control::Status& status);

// Replaces `path` atomically with `status` (a temporary file in the same directory, then rename),
// so a worker reads the old or the new line, never a torn one. False with errno set on failure.
bool write_control_file(const std::string& path, const control::Status& status);

}  // namespace elastrun::launcher
