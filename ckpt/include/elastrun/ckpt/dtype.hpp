#pragma once
// Element types a checkpoint can hold and their on-disk names.
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace elastrun::ckpt {

enum class DType : std::uint8_t {
  float16,
  bfloat16,  // stored on disk as uint16 with attribute dtype="bfloat16" (HDF5 1.10 has no bf16)
  float32,
  float64,
  int8,
  int16,
  int32,
  int64,
  uint8,
  boolean,  // stored as the h5py-compatible enum {FALSE=0, TRUE=1} over int8
};

// Bytes per element.
std::size_t dtype_size(DType dtype);
// Name used in attributes, the manifest and the CLI ("float32", "bfloat16", "bool", ...).
std::string_view dtype_name(DType dtype);
// Inverse of dtype_name; throws std::invalid_argument for unknown names.
DType dtype_from_name(std::string_view name);

}  // namespace elastrun::ckpt
