#pragma once
// Descriptors of the bytes a rank hands to save() and of the boxes it asks restore() to fill.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "elastrun/ckpt/dtype.hpp"

namespace elastrun::ckpt {

using Shape = std::vector<std::uint64_t>;

// Product of the extents; 1 for a 0-d shape.
std::uint64_t element_count(const Shape& shape);

enum class Placement : std::uint8_t {
  sharded,     // each rank owns a disjoint rectangular slice of the global tensor
  replicated,  // every rank holds the whole tensor; written once, its bytes split across ranks
};

// A tensor (or this rank's slice of it) to be saved. The bytes are C-contiguous and must stay
// valid and unchanged until save() returns (AsyncSaver copies them, so only until it returns).
struct TensorView {
  std::string name;  // "model/layer1.weight": '/' separates HDF5 groups
  DType dtype = DType::float32;
  Shape global_shape;
  Shape slice_offset;  // sharded: where this rank's slice starts; replicated: zeros
  Shape slice_extent;  // sharded: this rank's slice shape; replicated: == global_shape
  const std::byte* data = nullptr;
  Placement placement = Placement::replicated;

  static TensorView replicated(std::string name, DType dtype, Shape shape, const void* data);
  static TensorView sharded(std::string name, DType dtype, Shape global_shape, Shape offset, Shape extent,
                            const void* data);
  std::uint64_t slice_bytes() const { return element_count(slice_extent) * dtype_size(dtype); }
};

// A box of a global tensor to read into caller-owned, C-contiguous memory of shape `extent`.
// To restore a replicated tensor ask for offset zeros, extent == global shape.
struct TensorTarget {
  std::string name;
  DType dtype = DType::float32;
  Shape offset;
  Shape extent;
  std::byte* data = nullptr;

  static TensorTarget whole(std::string name, DType dtype, Shape shape, void* data);
  static TensorTarget box(std::string name, DType dtype, Shape offset, Shape extent, void* data);
  std::uint64_t bytes() const { return element_count(extent) * dtype_size(dtype); }
};

}  // namespace elastrun::ckpt
