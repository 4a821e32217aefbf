#pragma once
// Export of a checkpoint to the safetensors format (8-byte little-endian header length, JSON
// header with dtype/shape/data_offsets per tensor, then the raw bytes).
#include <filesystem>
#include <string_view>

#include "elastrun/ckpt/checkpoint.hpp"

namespace elastrun::ckpt {

// "F32", "BF16", "BOOL", ...
std::string_view safetensors_dtype(DType dtype);

// Writes every tensor of `checkpoint` (hash-verified) to `output` via a temporary file renamed
// into place. The checkpoint's step, world size and user metadata go to "__metadata__".
void export_safetensors(Checkpoint& checkpoint, const std::filesystem::path& output);

}  // namespace elastrun::ckpt
