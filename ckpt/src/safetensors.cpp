#include "elastrun/ckpt/safetensors.hpp"

#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "internal.hpp"

namespace elastrun::ckpt {

std::string_view safetensors_dtype(DType dtype) {
  switch (dtype) {
    case DType::float16: return "F16";
    case DType::bfloat16: return "BF16";
    case DType::float32: return "F32";
    case DType::float64: return "F64";
    case DType::int8: return "I8";
    case DType::int16: return "I16";
    case DType::int32: return "I32";
    case DType::int64: return "I64";
    case DType::uint8: return "U8";
    case DType::boolean: return "BOOL";
  }
  throw CheckpointError("unknown dtype");
}

void export_safetensors(Checkpoint& checkpoint, const std::filesystem::path& output) {
  nlohmann::json header = nlohmann::json::object();
  // safetensors metadata values must be strings.
  header["__metadata__"] = {{"format", "elastrun-ckpt export"},
                            {"step", std::to_string(checkpoint.step())},
                            {"world_size", std::to_string(checkpoint.world_size())},
                            {"user_metadata", checkpoint.metadata().dump()}};
  std::uint64_t position = 0;
  for (const auto& t : checkpoint.tensors()) {
    header[t.name] = {
        {"dtype", safetensors_dtype(t.dtype)}, {"shape", t.shape}, {"data_offsets", {position, position + t.bytes()}}};
    position += t.bytes();
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned

  const std::filesystem::path temporary = output.string() + ".tmp-" + detail::generation_token();
  try {
    std::ofstream stream(temporary, std::ios::binary | std::ios::trunc);
    if (!stream) throw CheckpointError("cannot create " + temporary.string());
    std::uint64_t length = header_text.size();
    unsigned char length_bytes[8];
    for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<unsigned char>(length >> (8 * i));
    stream.write(reinterpret_cast<const char*>(length_bytes), 8);
    stream.write(header_text.data(), static_cast<std::streamsize>(header_text.size()));
    std::vector<std::byte> buffer;
    for (const auto& t : checkpoint.tensors()) {
      buffer.resize(t.bytes());
      checkpoint.read(TensorTarget::whole(t.name, t.dtype, t.shape, buffer.data()));
      stream.write(reinterpret_cast<const char*>(buffer.data()), static_cast<std::streamsize>(buffer.size()));
    }
    stream.close();
    if (!stream) throw CheckpointError("write to " + temporary.string() + " failed (disk full?)");
    detail::fsync_path(temporary, false);
    detail::rename_path(temporary, output);
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(temporary, ec);
    throw;
  }
}

}  // namespace elastrun::ckpt
