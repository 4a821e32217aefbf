// Writes the checkpoints test_cli_diff.sh compares with `elastrun-ckpt diff`: a base, the same
// values saved by another world size, small and large perturbations, missing/extra tensors,
// other shapes and dtypes, NaNs. Every directory is a checkpoint root whose `latest` is step 10.
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>

#include "test_support.hpp"

namespace {

using namespace elastrun::ckpt;

struct Tensor {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<std::byte> bytes;
};

template <typename T>
Tensor make(std::string name, DType dtype, Shape shape, std::vector<T> values) {
  Tensor t{std::move(name), dtype, std::move(shape), {}};
  if (values.size() != element_count(t.shape)) throw std::logic_error("fixture: wrong value count for " + t.name);
  t.bytes.resize(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

std::vector<Tensor> base_tensors() {
  std::vector<float> w(30);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.25f - 3.0f;
  return {
      make("model/w", DType::float32, {6, 5}, w),
      // float16 bits: 1.0, 0.5, -2.0, 0, 1.0, 0.5, -2.0
      make("model/h", DType::float16, {7},
           std::vector<std::uint16_t>{0x3C00, 0x3800, 0xC000, 0x0000, 0x3C00, 0x3800, 0xC000}),
      // bfloat16 bits: 1.0, 2.0, -1.0, 0.5, 0, 2.0
      make("model/b", DType::bfloat16, {2, 3}, std::vector<std::uint16_t>{0x3F80, 0x4000, 0xBF80, 0x3F00, 0, 0x4000}),
      make("optim/step", DType::int64, {}, std::vector<std::int64_t>{10}),
      make("mask", DType::boolean, {4}, std::vector<std::uint8_t>{1, 0, 0, 1}),
      make("empty", DType::float32, {0, 3}, std::vector<float>{}),
      make("d", DType::float64, {3}, std::vector<double>{0.125, -7.5, 1e10}),
  };
}

Tensor& find(std::vector<Tensor>& tensors, const std::string& name) {
  for (auto& t : tensors)
    if (t.name == name) return t;
  throw std::logic_error("fixture: no tensor " + name);
}

template <typename T>
void set(Tensor& t, std::size_t index, T value) {
  std::memcpy(t.bytes.data() + index * sizeof(T), &value, sizeof(T));
}

// Saves `tensors` as step `step` of `root` from `world` ranks (threads): tensors with a first
// dimension >= world are sharded along it, the others replicated.
void save(const std::filesystem::path& root, std::uint64_t step, const std::vector<Tensor>& tensors, int world) {
  testing::run_ranks(world, [&](int rank, Communicator& comm) {
    std::vector<std::vector<std::byte>> pieces;
    pieces.reserve(tensors.size());
    std::vector<TensorView> views;
    for (const auto& t : tensors) {
      if (!t.shape.empty() && t.shape[0] >= static_cast<std::uint64_t>(world) && world > 1) {
        const auto [begin, length] = testing::split(t.shape[0], world, rank);
        Shape offset(t.shape.size(), 0), extent = t.shape;
        offset[0] = begin;
        extent[0] = length;
        pieces.push_back(testing::extract_box(t.bytes, t.shape, offset, extent, dtype_size(t.dtype)));
        views.push_back(TensorView::sharded(t.name, t.dtype, t.shape, offset, extent, pieces.back().data()));
      } else {
        views.push_back(TensorView::replicated(t.name, t.dtype, t.shape, t.bytes.data()));
      }
    }
    SaveOptions options;
    options.fsync = false;
    save_checkpoint(root, step, views, {{"step", step}}, comm, options);
  });
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: ckpt_diff_fixture OUTPUT_DIR\n";
    return 2;
  }
  const std::filesystem::path out = argv[1];
  try {
    const auto base = base_tensors();
    auto older = base;
    set<float>(find(older, "model/w"), 0, -2.0f);  // step 5 of base: w[0] differs by 1
    save(out / "base", 5, older, 1);
    save(out / "base", 10, base, 1);
    save(out / "resharded", 10, base, 3);  // same values, another world size and layout of pieces

    auto near = base;
    set<float>(find(near, "model/w"), 7, -1.25f + 5e-5f);  // w[7] = -1.25: |Δ| ≈ 5e-5
    save(out / "near", 10, near, 2);

    auto far = base;
    set<std::uint16_t>(find(far, "model/h"), 4, 0x3E00);  // 1.0 -> 1.5
    save(out / "far", 10, far, 2);

    auto extra = base;
    extra.push_back(make("model/x", DType::float32, {2}, std::vector<float>{1, 2}));
    save(out / "extra", 10, extra, 1);

    auto missing = base;
    std::erase_if(missing, [](const Tensor& t) { return t.name == "mask"; });
    save(out / "missing", 10, missing, 1);

    auto reshaped = base;
    find(reshaped, "model/w").shape = {5, 6};
    save(out / "reshaped", 10, reshaped, 1);

    auto retyped = base;
    {
      auto& w = find(retyped, "model/w");
      std::vector<double> values(30);
      for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<double>(i) * 0.25 - 3.0;
      w = make("model/w", DType::float64, {6, 5}, values);
    }
    save(out / "retyped", 10, retyped, 1);

    auto nan_a = base;
    set<double>(find(nan_a, "d"), 1, std::numeric_limits<double>::quiet_NaN());
    save(out / "nan_a", 10, nan_a, 1);
    save(out / "nan_b", 10, nan_a, 2);
  } catch (const std::exception& e) {
    std::cerr << "ckpt_diff_fixture: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
