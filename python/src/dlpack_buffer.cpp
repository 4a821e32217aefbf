#include "dlpack_buffer.hpp"

#include <stdexcept>

#include <fmt/format.h>

namespace elastrun::python {

using ckpt::DType;

std::optional<DType> dtype_of(const DLDataType& type) {
  if (type.lanes != 1) return std::nullopt;
  switch (type.code) {
    case kDLFloat:
      if (type.bits == 16) return DType::float16;
      if (type.bits == 32) return DType::float32;
      if (type.bits == 64) return DType::float64;
      return std::nullopt;
    case kDLBfloat: return type.bits == 16 ? std::optional(DType::bfloat16) : std::nullopt;
    case kDLInt:
      if (type.bits == 8) return DType::int8;
      if (type.bits == 16) return DType::int16;
      if (type.bits == 32) return DType::int32;
      if (type.bits == 64) return DType::int64;
      return std::nullopt;
    case kDLUInt: return type.bits == 8 ? std::optional(DType::uint8) : std::nullopt;
    default: return std::nullopt;
  }
}

HostBuffer host_buffer(const DLTensor& tensor, std::string_view key, std::optional<DType> as) {
  if (tensor.device.device_type != kDLCPU) {
    throw std::invalid_argument(
        fmt::format("'{}': the tensor is not in host memory (DLPack device type {}); "
                    "pass a CPU tensor",
                    key, static_cast<int>(tensor.device.device_type)));
  }
  const auto dtype = dtype_of(tensor.dtype);
  if (!dtype) {
    throw std::invalid_argument(
        fmt::format("'{}': element type (DLPack code {}, {} bits, {} lanes) is not one a "
                    "checkpoint holds (float16/32/64, bfloat16, int8/16/32/64, uint8, bool)",
                    key, static_cast<int>(tensor.dtype.code), tensor.dtype.bits, tensor.dtype.lanes));
  }
  if (as && ckpt::dtype_size(*as) != ckpt::dtype_size(*dtype)) {
    throw std::invalid_argument(
        fmt::format("'{}': cannot read {} elements as {}", key, ckpt::dtype_name(*dtype), ckpt::dtype_name(*as)));
  }
  if (tensor.ndim < 0 || (tensor.ndim > 0 && tensor.shape == nullptr)) {
    throw std::invalid_argument(fmt::format("'{}': DLPack tensor without a shape", key));
  }
  HostBuffer buffer;
  buffer.dtype = as.value_or(*dtype);
  buffer.shape.reserve(static_cast<std::size_t>(tensor.ndim));
  for (int d = 0; d < tensor.ndim; ++d) {
    if (tensor.shape[d] < 0) throw std::invalid_argument(fmt::format("'{}': negative extent {}", key, tensor.shape[d]));
    buffer.shape.push_back(static_cast<std::uint64_t>(tensor.shape[d]));
  }
  // Strides of dimensions of extent 1, and of empty tensors, are meaningless (torch reports
  // various values).
  if (tensor.strides != nullptr && ckpt::element_count(buffer.shape) != 0) {
    std::int64_t expected_stride = 1;
    for (int d = tensor.ndim - 1; d >= 0; --d) {
      if (tensor.shape[d] > 1 && tensor.strides[d] != expected_stride) {
        throw std::invalid_argument(fmt::format("'{}': the tensor is not C-contiguous; pass tensor.contiguous()", key));
      }
      expected_stride *= tensor.shape[d];
    }
  }
  buffer.data = static_cast<std::byte*>(tensor.data) + tensor.byte_offset;
  if (buffer.data == nullptr && ckpt::element_count(buffer.shape) != 0) {
    throw std::invalid_argument(fmt::format("'{}': DLPack tensor without data", key));
  }
  return buffer;
}

}  // namespace elastrun::python
