#include "segment_copy.hpp"

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <system_error>
#include <vector>

#include <unistd.h>

#include <cerrno>

#include <fmt/format.h>
#include <xxhash.h>

namespace elastrun::python {
namespace {

constexpr std::size_t kChunkBytes = std::size_t{1} << 20;

struct StateDeleter {
  void operator()(XXH3_state_t* state) const noexcept { XXH3_freeState(state); }
};

}  // namespace

std::uint64_t copy_and_hash(std::byte* dst, std::size_t size, std::vector<SegmentPiece> pieces, bool hash) {
  std::sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  std::size_t end = 0;
  for (const auto& p : pieces) {
    if (p.offset < end || p.bytes > size || p.offset > size - p.bytes)
      throw std::invalid_argument(
          fmt::format("memory snapshot: a piece of {} bytes at offset {} overlaps another or ends past the "
                      "segment's {} bytes",
                      p.bytes, p.offset, size));
    end = p.offset + p.bytes;
  }
  if (!hash) {
    for (const auto& p : pieces) std::memcpy(dst + p.offset, p.data, p.bytes);
    return 0;
  }
  std::unique_ptr<XXH3_state_t, StateDeleter> state(XXH3_createState());
  if (!state || XXH3_64bits_reset(state.get()) != XXH_OK) throw std::bad_alloc();
  std::size_t hashed = 0;
  const auto hash_up_to = [&](std::size_t upto) {
    if (upto > hashed) XXH3_64bits_update(state.get(), dst + hashed, upto - hashed);
    hashed = std::max(hashed, upto);
  };
  for (const auto& p : pieces) {
    for (std::size_t done = 0; done < p.bytes;) {
      const std::size_t n = std::min(kChunkBytes, p.bytes - done);
      std::memcpy(dst + p.offset + done, p.data + done, n);
      done += n;
      hash_up_to(p.offset + done);
    }
  }
  hash_up_to(size);
  return XXH3_64bits_digest(state.get());
}

std::uint64_t hash_bytes(const std::byte* data, std::size_t size) { return XXH3_64bits(data, size); }

namespace {

void read_exactly(int fd, std::byte* into, std::size_t bytes, std::size_t offset) {
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, into, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw std::system_error(errno, std::generic_category(), "reading a memory snapshot");
    if (n == 0)
      throw std::system_error(EIO, std::generic_category(),
                              fmt::format("reading a memory snapshot: it ends before byte {}", offset));
    into += n, bytes -= static_cast<std::size_t>(n), offset += static_cast<std::size_t>(n);
  }
}

}  // namespace

std::uint64_t hash_fd(int fd, std::size_t size) {
  std::unique_ptr<XXH3_state_t, StateDeleter> state(XXH3_createState());
  if (!state || XXH3_64bits_reset(state.get()) != XXH_OK) throw std::bad_alloc();
  std::vector<std::byte> chunk(std::min(kChunkBytes, size));
  for (std::size_t done = 0; done < size;) {
    const std::size_t n = std::min(chunk.size(), size - done);
    read_exactly(fd, chunk.data(), n, done);
    XXH3_64bits_update(state.get(), chunk.data(), n);
    done += n;
  }
  return XXH3_64bits_digest(state.get());
}

void read_pieces(int fd, const std::vector<SegmentRead>& pieces) {
  for (const auto& p : pieces) read_exactly(fd, p.into, p.bytes, p.offset);
}

}  // namespace elastrun::python
