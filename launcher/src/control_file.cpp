#include "control_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <string_view>

#include "elastrun/util/unique_fd.hpp"

namespace elastrun::launcher {

std::string control_line(const control::Status& status) {
  return std::to_string(status.sequence) + " " + std::string(control::to_string(status.request)) + "\n";
}

bool write_control_file(const std::string& path, const control::Status& status) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  auto fail = [&] {
    const int e = errno;
    ::unlink(tmp.c_str());
    errno = e;
    return false;
  };
  {
    util::UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd) return false;
    const std::string line = control_line(status);
    for (std::string_view rest = line; !rest.empty();) {
      const ssize_t n = ::write(fd.get(), rest.data(), rest.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return fail();
      rest.remove_prefix(static_cast<std::size_t>(n));
    }
    if (::close(fd.release()) != 0) return fail();
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fail();
  return true;
}

}  // namespace elastrun::launcher
