#pragma once
// A DLPack tensor (what torch.utils.dlpack.to_dlpack and __dlpack__() export) as the bytes, dtype
// and shape the checkpoint library reads and writes: CPU memory, C-contiguous, one lane.
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include <dlpack/dlpack.h>

#include "elastrun/ckpt/dtype.hpp"
#include "elastrun/ckpt/tensor.hpp"

namespace elastrun::python {

struct HostBuffer {
  ckpt::DType dtype = ckpt::DType::float32;
  ckpt::Shape shape;
  std::byte* data = nullptr;
};

// The checkpoint dtype of a DLPack element type, or nullopt (complex, uint16, several lanes...).
std::optional<ckpt::DType> dtype_of(const DLDataType& type);

// Checks `tensor` (device, lanes, dtype, C-contiguous strides) and returns its memory. `as`
// reinterprets same-sized elements (torch's DLPack export rejects bool: the package passes a
// uint8 view with as = boolean). Throws std::invalid_argument naming `key` and what to do.
HostBuffer host_buffer(const DLTensor& tensor, std::string_view key, std::optional<ckpt::DType> as = {});

}  // namespace elastrun::python
