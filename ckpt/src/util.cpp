#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <new>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <xxhash.h>

#include "elastrun/ckpt/errors.hpp"
#include "elastrun/ckpt/testing.hpp"
#include "internal.hpp"

namespace elastrun::ckpt::detail {

std::optional<Box> intersect(const Box& a, const Box& b) {
  Box result;
  for (std::size_t d = 0; d < a.offset.size(); ++d) {
    const std::uint64_t begin = std::max(a.offset[d], b.offset[d]);
    const std::uint64_t end = std::min(a.offset[d] + a.extent[d], b.offset[d] + b.extent[d]);
    if (end <= begin) return std::nullopt;
    result.offset.push_back(begin);
    result.extent.push_back(end - begin);
  }
  return result;
}

void copy_box(const std::byte* src, const Shape& src_shape, const Shape& src_start, std::byte* dst,
              const Shape& dst_shape, const Shape& dst_start, const Shape& count, std::size_t element_size) {
  const std::size_t ndim = count.size();
  if (element_count(count) == 0) return;
  if (ndim == 0) {
    std::memcpy(dst, src, element_size);
    return;
  }
  // Merge trailing dimensions that are copied whole in both arrays into one contiguous run.
  std::size_t run_dims = 1;  // dims [ndim-run_dims, ndim) form the run
  std::uint64_t run = count[ndim - 1];
  while (run_dims < ndim) {
    const std::size_t inner = ndim - run_dims;
    if (count[inner] != src_shape[inner] || count[inner] != dst_shape[inner]) break;
    run *= count[inner - 1];
    ++run_dims;
  }
  const std::size_t run_bytes = run * element_size;
  const std::size_t outer_dims = ndim - run_dims;
  std::vector<std::uint64_t> src_stride(ndim, 1), dst_stride(ndim, 1);
  for (std::size_t d = ndim - 1; d > 0; --d) {
    src_stride[d - 1] = src_stride[d] * src_shape[d];
    dst_stride[d - 1] = dst_stride[d] * dst_shape[d];
  }
  std::vector<std::uint64_t> index(outer_dims, 0);
  while (true) {
    std::uint64_t src_elem = 0, dst_elem = 0;
    for (std::size_t d = 0; d < ndim; ++d) {
      const std::uint64_t i = d < outer_dims ? index[d] : 0;
      src_elem += (src_start[d] + i) * src_stride[d];
      dst_elem += (dst_start[d] + i) * dst_stride[d];
    }
    std::memcpy(dst + dst_elem * element_size, src + src_elem * element_size, run_bytes);
    std::size_t d = outer_dims;
    while (d > 0) {
      --d;
      if (++index[d] < count[d]) break;
      index[d] = 0;
      if (d == 0) return;
    }
    if (outer_dims == 0) return;
  }
}

std::optional<Box> replicated_piece(const Shape& shape, int rank, int world_size) {
  if (shape.empty()) {
    if (rank != 0) return std::nullopt;
    return Box{};
  }
  if (element_count(shape) == 0) return std::nullopt;
  std::size_t dim = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] >= static_cast<std::uint64_t>(world_size)) {
      dim = d;
      break;
    }
  }
  const std::uint64_t n = shape[dim];
  const auto world = static_cast<std::uint64_t>(world_size);
  const auto r = static_cast<std::uint64_t>(rank);
  const std::uint64_t base = n / world;
  const std::uint64_t remainder = n % world;
  const std::uint64_t length = base + (r < remainder ? 1 : 0);
  if (length == 0) return std::nullopt;
  Box box{Shape(shape.size(), 0), shape};
  box.offset[dim] = r * base + std::min(r, remainder);
  box.extent[dim] = length;
  return box;
}

std::uint64_t xxh3(const void* data, std::size_t size) { return XXH3_64bits(data, size); }

Xxh3Stream::Xxh3Stream() : state_(XXH3_createState()) {
  if (state_ == nullptr) throw std::bad_alloc();
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}
Xxh3Stream::~Xxh3Stream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Xxh3Stream::update(const void* data, std::size_t size) {
  if (size > 0) XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, size);
}
std::uint64_t Xxh3Stream::digest() const { return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_)); }

void for_each_chunk(const Shape& extent, std::size_t element_size, std::uint64_t max_bytes,
                    const std::function<void(const Shape&, const Shape&, std::uint64_t, std::uint64_t)>& chunk) {
  const std::size_t ndim = extent.size();
  if (ndim == 0) {
    chunk({}, {}, 0, element_size);
    return;
  }
  if (element_count(extent) == 0) return;
  std::vector<std::uint64_t> step_bytes(ndim);  // bytes of one step along dimension d
  std::uint64_t inner = element_size;
  for (std::size_t d = ndim; d > 0; --d) {
    step_bytes[d - 1] = inner;
    inner *= extent[d - 1];
  }
  std::size_t split = 0;  // chunk along this dimension; single indices before it
  while (split + 1 < ndim && step_bytes[split] > max_bytes) ++split;
  const std::uint64_t block =
      std::min<std::uint64_t>(extent[split], std::max<std::uint64_t>(1, max_bytes / step_bytes[split]));
  Shape start(ndim, 0), count(extent);
  for (std::size_t d = 0; d < split; ++d) count[d] = 1;
  std::uint64_t offset = 0;
  while (true) {
    for (std::uint64_t i = 0; i < extent[split]; i += block) {
      start[split] = i;
      count[split] = std::min(block, extent[split] - i);
      const std::uint64_t bytes = count[split] * step_bytes[split];
      chunk(start, count, offset, bytes);
      offset += bytes;
    }
    start[split] = 0;
    std::size_t d = split;
    while (d > 0) {
      --d;
      if (++start[d] < extent[d]) break;
      start[d] = 0;
      if (d == 0) return;
    }
    if (split == 0) return;
  }
}

std::optional<std::uint64_t> checked_add(std::uint64_t a, std::uint64_t b) {
  std::uint64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}
std::optional<std::uint64_t> checked_mul(std::uint64_t a, std::uint64_t b) {
  std::uint64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}
std::optional<std::uint64_t> checked_element_count(const Shape& shape) {
  std::uint64_t count = 1;
  for (std::uint64_t extent : shape) {
    auto next = checked_mul(count, extent);
    if (!next) return std::nullopt;
    count = *next;
  }
  return count;
}

namespace {
// The background remover calls fault_point from its own thread, so the hook is swapped as a
// whole under a mutex and called through a copy of the pointer. Constant-initialized
// namespace-scope objects: they outlive the remover's function-local static, which still calls
// fault_point while it drains at exit. hook_installed keeps the mutex off the path when no hook
// is set (always, outside tests).
std::mutex fault_hook_mutex;
std::shared_ptr<const FaultHook> fault_hook;
std::atomic<bool> hook_installed{false};
// A test hook is also called in forked children (AsyncSaver's snapshot writer): fork() must not
// copy the mutex while another thread (another rank, the remover) holds it, or the child's
// fault_point would block forever. It is held only to copy or swap the pointer.
[[maybe_unused]] const int fault_hook_fork_handlers = ::pthread_atfork(
    [] { fault_hook_mutex.lock(); }, [] { fault_hook_mutex.unlock(); }, [] { fault_hook_mutex.unlock(); });
std::atomic<bool> exchange_disabled{false};
}  // namespace

void set_fault_hook(FaultHook hook) {
  std::shared_ptr<const FaultHook> next;
  if (hook) next = std::make_shared<const FaultHook>(std::move(hook));
  std::lock_guard lock(fault_hook_mutex);
  hook_installed = next != nullptr;
  fault_hook.swap(next);
}  // the old hook is destroyed here, outside the lock, unless a caller still runs it
void fault_point(std::string_view point, int rank) {
  if (!hook_installed) return;
  std::shared_ptr<const FaultHook> hook;
  {
    std::lock_guard lock(fault_hook_mutex);
    hook = fault_hook;
  }
  if (hook) (*hook)(point, rank);
}
void set_rename_exchange_disabled(bool disabled) { exchange_disabled = disabled; }
bool rename_exchange_disabled() { return exchange_disabled; }

std::string hex64(std::uint64_t value) { return fmt::format("{:016x}", value); }

std::string step_name(std::uint64_t step) { return fmt::format("step-{:09d}", step); }

std::optional<std::uint64_t> parse_step_name(std::string_view name) {
  constexpr std::string_view prefix = "step-";
  if (name.size() <= prefix.size() || name.substr(0, prefix.size()) != prefix) return std::nullopt;
  const std::string_view digits = name.substr(prefix.size());
  if (digits.size() > 19) return std::nullopt;
  std::uint64_t value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + static_cast<std::uint64_t>(c - '0');
  }
  return value;
}

bool is_partial_name(std::string_view name) {
  const auto dot = name.find('.');
  return dot != std::string_view::npos && parse_step_name(name.substr(0, dot)).has_value();
}

std::string shard_file_name(int rank, int world_size) {
  return fmt::format("shard-{:05d}-of-{:05d}.h5", rank, world_size);
}

std::string generation_token() {
  std::random_device device;
  std::uint64_t value = (static_cast<std::uint64_t>(device()) << 32) ^ device();
  value ^= static_cast<std::uint64_t>(::getpid()) << 16;
  return fmt::format("{:016x}", value);
}

void fsync_path(const std::filesystem::path& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  if (fd < 0) {
    throw CheckpointError(fmt::format("cannot open {} for fsync: {}", path.string(), std::strerror(errno)));
  }
  const int status = ::fsync(fd);
  const int saved_errno = errno;
  ::close(fd);
  if (status != 0) {
    throw CheckpointError(
        fmt::format("fsync {} failed: {} (data may not be durable)", path.string(), std::strerror(saved_errno)));
  }
}

void rename_path(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    throw CheckpointError(fmt::format("rename {} -> {} failed: {}", from.string(), to.string(), std::strerror(errno)));
  }
}

std::string invalid_name_reason(std::string_view name) {
  if (name.empty()) return "empty tensor name";
  if (name.front() == '/' || name.back() == '/') return "name must not start or end with '/'";
  std::size_t start = 0;
  bool first = true;
  while (start <= name.size()) {
    const auto end = std::min(name.find('/', start), name.size());
    const std::string_view part = name.substr(start, end - start);
    if (part.empty()) return "empty path component";
    if (part == "." || part == "..") return "'.' and '..' components are not allowed";
    if (first && part == kReservedGroup) return "the top-level group _elastrun is reserved";
    first = false;
    start = end + 1;
  }
  return {};
}

std::string shape_string(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

}  // namespace elastrun::ckpt::detail

namespace elastrun::ckpt::testing {

void set_fault_hook(FaultHook hook) { detail::set_fault_hook(std::move(hook)); }

}  // namespace elastrun::ckpt::testing
