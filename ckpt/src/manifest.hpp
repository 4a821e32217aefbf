#pragma once
// The checkpoint manifest (the JSON text in index.h5) parsed and validated without HDF5: the
// reader (load.cpp) and the manifest fuzzer (tests/fuzz/fuzz_manifest.cpp) share it.
#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "elastrun/ckpt/checkpoint.hpp"

namespace elastrun::ckpt::detail {

struct ParsedManifest {
  nlohmann::json json;
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::size_t> by_name;  // tensor name -> index in tensors
};

// Deepest nesting accepted: dumping or destroying a 100 000-deep document recurses off the stack
// (elastrun-ckpt inspect and export crashed on one); no manifest of ours is deeper than 8.
inline constexpr int kMaxManifestDepth = 64;

// Parses and checks everything the reader later uses as a size, offset, index or path, so a
// damaged or crafted manifest gives one CheckpointError naming the field and tensor, never a
// crash or another exception type.
ParsedManifest parse_manifest(std::string_view text);

}  // namespace elastrun::ckpt::detail
