#pragma once
// Shared helpers for the checkpoint tests: temp dirs, deterministic tensors, threads as ranks.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "elastrun/ckpt/checkpoint.hpp"

// From ckpt/src/internal.hpp (not on every test target's include path): blocks until rank 0's
// background removals of retired steps are done.
namespace elastrun::ckpt::detail {
void wait_for_background_removals();
}  // namespace elastrun::ckpt::detail

namespace elastrun::ckpt::testing {

// A fresh directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::random_device device;
    path_ = std::filesystem::temp_directory_path() /
            ("elastrun-ckpt-test-" + std::to_string(device()) + std::to_string(device()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    // The remover thread may still be deleting a retired step in here: let it finish first, so
    // it does not race this remove_all, and no test's removals run into the next test.
    detail::wait_for_background_removals();
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Deterministic bytes for element `index` of a tensor seeded by `seed`; bools are 0/1.
inline std::vector<std::byte> make_tensor(std::uint64_t seed, DType dtype, const Shape& shape) {
  const std::size_t element_size = dtype_size(dtype);
  std::vector<std::byte> bytes(element_count(shape) * element_size);
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ULL + 1;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    bytes[i] = static_cast<std::byte>(state & 0xff);
  }
  if (dtype == DType::boolean) {
    for (auto& b : bytes) b = static_cast<std::byte>(static_cast<unsigned>(b) & 1U);
  }
  return bytes;
}

// Naive reference extraction of a box from a C-contiguous global array.
inline std::vector<std::byte> extract_box(const std::vector<std::byte>& global, const Shape& shape, const Shape& offset,
                                          const Shape& extent, std::size_t element_size) {
  std::vector<std::byte> out(element_count(extent) * element_size);
  const std::size_t ndim = shape.size();
  const std::uint64_t count = element_count(extent);
  for (std::uint64_t flat = 0; flat < count; ++flat) {
    std::uint64_t rest = flat;
    std::uint64_t source = 0;
    std::uint64_t stride = 1;
    for (std::size_t d = ndim; d > 0; --d) {
      const std::uint64_t i = rest % extent[d - 1];
      rest /= extent[d - 1];
      source += (offset[d - 1] + i) * stride;
      stride *= shape[d - 1];
    }
    for (std::size_t b = 0; b < element_size; ++b) {
      out[flat * element_size + b] = global[source * element_size + b];
    }
  }
  return out;
}

// Runs fn(rank, communicator) on `world` threads; rethrows the first exception.
inline void run_ranks(int world, const std::function<void(int, Communicator&)>& fn) {
  InProcessGroup group(world);
  std::mutex mutex;
  std::exception_ptr first_error;
  std::vector<std::jthread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        fn(rank, group.communicator(rank));
      } catch (...) {
        std::lock_guard lock(mutex);
        if (!first_error) first_error = std::current_exception();
      }
    });
  }
  threads.clear();  // joins
  if (first_error) std::rethrow_exception(first_error);
}

// Even split of n into parts; part `index` as (begin, length).
inline std::pair<std::uint64_t, std::uint64_t> split(std::uint64_t n, int parts, int index) {
  const auto p = static_cast<std::uint64_t>(parts);
  const auto i = static_cast<std::uint64_t>(index);
  const std::uint64_t base = n / p;
  const std::uint64_t remainder = n % p;
  return {i * base + std::min(i, remainder), base + (i < remainder ? 1 : 0)};
}

struct GlobalTensor {
  std::string name;
  DType dtype;
  Shape shape;
  Placement placement;
  std::vector<std::byte> bytes;
};

// The world-4 model: sharded 2-D grid, uneven row shards, column shards, a rank with an empty
// slice, and replicated tensors of every awkward kind (0-d, empty, split along dim 1).
inline std::vector<GlobalTensor> world4_model(std::uint64_t seed) {
  std::vector<GlobalTensor> model = {
      {"model/w", DType::float32, {10, 7}, Placement::sharded, {}},
      {"model/emb", DType::bfloat16, {9, 3}, Placement::sharded, {}},
      {"model/col", DType::int16, {3, 8}, Placement::sharded, {}},
      {"model/ragged", DType::int8, {17}, Placement::sharded, {}},
      {"model/bias", DType::float16, {5}, Placement::replicated, {}},
      {"opt/step", DType::int64, {}, Placement::replicated, {}},
      {"opt/mask", DType::boolean, {4, 4}, Placement::replicated, {}},
      {"opt/empty", DType::float64, {0, 3}, Placement::replicated, {}},
      {"data/u8", DType::uint8, {2, 5, 3}, Placement::replicated, {}},
      {"data/i32", DType::int32, {6, 1}, Placement::replicated, {}},
  };
  for (auto& t : model) t.bytes = make_tensor(seed++, t.dtype, t.shape);
  return model;
}

// This rank's slice (offset, extent) of a sharded tensor of world4_model.
inline std::pair<Shape, Shape> world4_slice(const GlobalTensor& t, int rank) {
  if (t.name == "model/w") {
    const auto [r0, rn] = split(10, 2, rank / 2);
    const auto [c0, cn] = split(7, 2, rank % 2);
    return {{r0, c0}, {rn, cn}};
  }
  if (t.name == "model/emb") {
    const auto [r0, rn] = split(9, 4, rank);
    return {{r0, 0}, {rn, 3}};
  }
  if (t.name == "model/col") return {{0, 2ULL * rank}, {3, 2}};
  // ragged: ranks 0..2 get 6, 6, 5; rank 3 nothing.
  if (rank == 3) return {{17}, {0}};
  const auto [b, n] = split(17, 3, rank);
  return {{b}, {n}};
}

inline void save_world4(const std::filesystem::path& root, std::uint64_t step, const std::vector<GlobalTensor>& model,
                        const SaveOptions& options = {}) {
  run_ranks(4, [&](int rank, Communicator& comm) {
    std::vector<std::vector<std::byte>> slices;
    slices.reserve(model.size());
    std::vector<TensorView> views;
    for (const auto& t : model) {
      if (t.placement == Placement::replicated) {
        views.push_back(TensorView::replicated(t.name, t.dtype, t.shape, t.bytes.data()));
        continue;
      }
      auto [offset, extent] = world4_slice(t, rank);
      slices.push_back(extract_box(t.bytes, t.shape, offset, extent, dtype_size(t.dtype)));
      views.push_back(TensorView::sharded(t.name, t.dtype, t.shape, offset, extent, slices.back().data()));
    }
    save_checkpoint(root, step, views, {{"step_meta", step}}, comm, options);
  });
}

}  // namespace elastrun::ckpt::testing
