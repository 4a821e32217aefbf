#include "elastrun/ckpt/torch_adapter.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

namespace elastrun::ckpt::torch_adapter {

DType to_dtype(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Half: return DType::float16;
    case c10::ScalarType::BFloat16: return DType::bfloat16;
    case c10::ScalarType::Float: return DType::float32;
    case c10::ScalarType::Double: return DType::float64;
    case c10::ScalarType::Char: return DType::int8;
    case c10::ScalarType::Short: return DType::int16;
    case c10::ScalarType::Int: return DType::int32;
    case c10::ScalarType::Long: return DType::int64;
    case c10::ScalarType::Byte: return DType::uint8;
    case c10::ScalarType::Bool: return DType::boolean;
    default:
      throw CheckpointError(
          fmt::format("torch dtype {} cannot be checkpointed; convert it to a "
                      "supported dtype first",
                      c10::toString(type)));
  }
}

c10::ScalarType to_scalar_type(DType dtype) {
  switch (dtype) {
    case DType::float16: return c10::ScalarType::Half;
    case DType::bfloat16: return c10::ScalarType::BFloat16;
    case DType::float32: return c10::ScalarType::Float;
    case DType::float64: return c10::ScalarType::Double;
    case DType::int8: return c10::ScalarType::Char;
    case DType::int16: return c10::ScalarType::Short;
    case DType::int32: return c10::ScalarType::Int;
    case DType::int64: return c10::ScalarType::Long;
    case DType::uint8: return c10::ScalarType::Byte;
    case DType::boolean: return c10::ScalarType::Bool;
  }
  throw CheckpointError("unknown dtype");
}

Shape shape_of(const at::Tensor& tensor) {
  Shape shape;
  for (auto size : tensor.sizes()) shape.push_back(static_cast<std::uint64_t>(size));
  return shape;
}

namespace {
bool usable_in_place(const at::Tensor& tensor) {
  return tensor.device().is_cpu() && tensor.is_contiguous() && !tensor.is_conj() && !tensor.is_neg();
}
}  // namespace

const at::Tensor& SaveViews::keep(const at::Tensor& tensor) {
  // In place when possible; otherwise one contiguous CPU copy.
  keep_alive_.push_back(usable_in_place(tensor) ? tensor : tensor.detach().to(at::kCPU).contiguous());
  return keep_alive_.back();
}

void SaveViews::add_replicated(std::string name, const at::Tensor& tensor) {
  const DType dtype = to_dtype(tensor.scalar_type());
  const at::Tensor& kept = keep(tensor);
  views_.push_back(TensorView::replicated(std::move(name), dtype, shape_of(kept), kept.data_ptr()));
}

void SaveViews::add_sharded(std::string name, const at::Tensor& local, Shape global_shape, Shape offset) {
  const DType dtype = to_dtype(local.scalar_type());
  const at::Tensor& kept = keep(local);
  views_.push_back(TensorView::sharded(std::move(name), dtype, std::move(global_shape), std::move(offset),
                                       shape_of(kept), kept.data_ptr()));
}

void RestoreTargets::add_whole(std::string name, at::Tensor& tensor) {
  add_box(std::move(name), tensor, Shape(static_cast<std::size_t>(tensor.dim()), 0));
}

void RestoreTargets::add_box(std::string name, at::Tensor& local, Shape offset) {
  const DType dtype = to_dtype(local.scalar_type());
  void* data = nullptr;
  if (usable_in_place(local)) {
    data = local.data_ptr();
  } else {
    staged_.push_back({local, at::empty(local.sizes(),
                                        local.options().device(at::kCPU).memory_format(at::MemoryFormat::Contiguous))});
    data = staged_.back().staging.data_ptr();
  }
  targets_.push_back(TensorTarget::box(std::move(name), dtype, std::move(offset), shape_of(local), data));
}

void RestoreTargets::finish() {
  at::NoGradGuard no_grad;
  for (auto& s : staged_) s.destination.copy_(s.staging);
}

}  // namespace elastrun::ckpt::torch_adapter
