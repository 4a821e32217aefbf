// Secrets from the kernel's random pool, for tokens that guard a rendezvous.
#pragma once

#include <sys/random.h>

#include <cerrno>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <system_error>

namespace elastrun::util {

// `bytes` random bytes from getrandom(2) as lowercase hex (2 * bytes characters). Throws
// std::system_error if the kernel refuses.
inline std::string random_hex(std::size_t bytes = 24) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * bytes);
  unsigned char buf[64];
  while (bytes > 0) {
    const std::size_t want = bytes < sizeof buf ? bytes : sizeof buf;
    const ssize_t n = ::getrandom(buf, want, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw std::system_error(errno, std::generic_category(), "getrandom");
    for (ssize_t i = 0; i < n; ++i) {
      hex.push_back(kHex[buf[i] >> 4]);
      hex.push_back(kHex[buf[i] & 15]);
    }
    bytes -= static_cast<std::size_t>(n);
  }
  return hex;
}

}  // namespace elastrun::util
