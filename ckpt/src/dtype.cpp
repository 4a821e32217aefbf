#include "elastrun/ckpt/dtype.hpp"

#include <stdexcept>
#include <string>

#include "elastrun/ckpt/tensor.hpp"

namespace elastrun::ckpt {

namespace {
struct DTypeRow {
  DType dtype;
  std::string_view name;
  std::size_t size;
};
constexpr DTypeRow kRows[] = {
    {DType::float16, "float16", 2}, {DType::bfloat16, "bfloat16", 2}, {DType::float32, "float32", 4},
    {DType::float64, "float64", 8}, {DType::int8, "int8", 1},         {DType::int16, "int16", 2},
    {DType::int32, "int32", 4},     {DType::int64, "int64", 8},       {DType::uint8, "uint8", 1},
    {DType::boolean, "bool", 1},
};
const DTypeRow& row(DType dtype) {
  for (const auto& r : kRows) {
    if (r.dtype == dtype) return r;
  }
  throw std::invalid_argument("unknown DType value " + std::to_string(static_cast<int>(dtype)));
}
}  // namespace

std::size_t dtype_size(DType dtype) { return row(dtype).size; }
std::string_view dtype_name(DType dtype) { return row(dtype).name; }

DType dtype_from_name(std::string_view name) {
  for (const auto& r : kRows) {
    if (r.name == name) return r.dtype;
  }
  throw std::invalid_argument("unknown dtype name '" + std::string(name) +
                              "' (expected float16, bfloat16, float32, float64, int8, int16, "
                              "int32, int64, uint8 or bool)");
}

std::uint64_t element_count(const Shape& shape) {
  std::uint64_t count = 1;
  for (auto extent : shape) count *= extent;
  return count;
}

TensorView TensorView::replicated(std::string name, DType dtype, Shape shape, const void* data) {
  TensorView view;
  view.name = std::move(name);
  view.dtype = dtype;
  view.slice_offset.assign(shape.size(), 0);
  view.slice_extent = shape;
  view.global_shape = std::move(shape);
  view.data = static_cast<const std::byte*>(data);
  view.placement = Placement::replicated;
  return view;
}

TensorView TensorView::sharded(std::string name, DType dtype, Shape global_shape, Shape offset, Shape extent,
                               const void* data) {
  TensorView view;
  view.name = std::move(name);
  view.dtype = dtype;
  view.global_shape = std::move(global_shape);
  view.slice_offset = std::move(offset);
  view.slice_extent = std::move(extent);
  view.data = static_cast<const std::byte*>(data);
  view.placement = Placement::sharded;
  return view;
}

TensorTarget TensorTarget::whole(std::string name, DType dtype, Shape shape, void* data) {
  TensorTarget target;
  target.name = std::move(name);
  target.dtype = dtype;
  target.offset.assign(shape.size(), 0);
  target.extent = std::move(shape);
  target.data = static_cast<std::byte*>(data);
  return target;
}

TensorTarget TensorTarget::box(std::string name, DType dtype, Shape offset, Shape extent, void* data) {
  TensorTarget target;
  target.name = std::move(name);
  target.dtype = dtype;
  target.offset = std::move(offset);
  target.extent = std::move(extent);
  target.data = static_cast<std::byte*>(data);
  return target;
}

}  // namespace elastrun::ckpt
