// libFuzzer target: the checkpoint manifest parser (the JSON text of index.h5), as the reader,
// elastrun-ckpt inspect/verify and restore's skip report use it. A damaged or crafted manifest
// must end in one CheckpointError -- never a crash, a hang, or another exception type.
// Seed: tests/fuzz/corpus/manifest/. Build and run: scripts/fuzz [seconds] manifest.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "elastrun/ckpt/errors.hpp"
#include "manifest.hpp"  // ckpt/src: the manifest format is private to ckpt

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace elastrun::ckpt;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const auto parsed = detail::parse_manifest(text);
    // What the tools do with an accepted manifest: dump it (inspect), size every tensor (ls).
    (void)parsed.json.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
    std::uint64_t total = 0;
    for (const auto& t : parsed.tensors) total += t.bytes();
    if (parsed.by_name.size() != parsed.tensors.size()) __builtin_trap();
    (void)total;
  } catch (const CheckpointError& e) {
    // restore's skip report carries the message (raw bytes from the file included) in JSON
    const nlohmann::json report = {{"error", e.what()}};
    (void)report.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  return 0;
}
