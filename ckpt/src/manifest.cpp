// Manifest validation (see manifest.hpp).
#include "manifest.hpp"

#include <set>

#include <fmt/format.h>

#include "elastrun/ckpt/errors.hpp"
#include "internal.hpp"

namespace elastrun::ckpt::detail {

using nlohmann::json;

namespace {

constexpr std::size_t kMaxRank = 32;  // H5S_MAX_RANK
constexpr std::uint64_t kMaxTensorBytes = 1ULL << 62;

[[noreturn]] void bad(const std::string& what) { throw CheckpointError(what); }

const json& field(const json& object, const char* key, std::string_view context) {
  if (!object.is_object() || !object.contains(key)) bad(fmt::format("{}: missing '{}'", context, key));
  return object[key];
}

std::uint64_t u64_field(const json& object, const char* key, std::string_view context) {
  const json& value = field(object, key, context);
  if (!value.is_number_unsigned()) {
    bad(fmt::format("{}: '{}' is {}, not a non-negative integer", context, key, value.dump()));
  }
  return value.get<std::uint64_t>();
}

std::string string_field(const json& object, const char* key, std::string_view context) {
  const json& value = field(object, key, context);
  if (!value.is_string()) bad(fmt::format("{}: '{}' is not a string", context, key));
  return value.get<std::string>();
}

Shape shape_value(const json& value, const char* key, std::string_view context) {
  if (!value.is_array() || value.size() > kMaxRank) {
    bad(fmt::format("{}: '{}' is not an array of at most {} extents", context, key, kMaxRank));
  }
  Shape shape;
  for (const auto& v : value) {
    if (!v.is_number_unsigned()) {
      bad(fmt::format("{}: '{}' holds {}, not a non-negative integer", context, key, v.dump()));
    }
    shape.push_back(v.get<std::uint64_t>());
  }
  return shape;
}

Shape shape_field(const json& object, const char* key, std::string_view context) {
  return shape_value(field(object, key, context), key, context);
}

bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

TensorInfo parse_tensor(const json& t, int world, const std::set<std::string>& files) {
  TensorInfo info;
  info.name = string_field(t, "name", "tensor entry");
  if (auto reason = invalid_name_reason(info.name); !reason.empty()) {
    bad(fmt::format("tensor '{}': invalid name ({})", info.name, reason));
  }
  const std::string context = fmt::format("tensor '{}'", info.name);
  const std::string dtype = string_field(t, "dtype", context);
  try {
    info.dtype = dtype_from_name(dtype);
  } catch (const std::exception&) {
    bad(fmt::format("{}: unknown dtype '{}'", context, dtype));
  }
  info.shape = shape_field(t, "shape", context);
  const auto count = checked_element_count(info.shape);
  const auto bytes = count ? checked_mul(*count, dtype_size(info.dtype)) : std::nullopt;
  if (!bytes || *bytes > kMaxTensorBytes) {
    bad(fmt::format("{}: shape {} is too large", context, shape_string(info.shape)));
  }
  const std::string placement = string_field(t, "placement", context);
  if (placement != "sharded" && placement != "replicated") {
    bad(fmt::format("{}: unknown placement '{}'", context, placement));
  }
  info.placement = placement == "sharded" ? Placement::sharded : Placement::replicated;
  const json& shards = field(t, "shards", context);
  if (!shards.is_array()) bad(context + ": 'shards' is not an array");
  const std::size_t ndim = info.shape.size();
  std::uint64_t covered = 0;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const json& s = shards[i];
    const std::string where = fmt::format("{} shard {}", context, i);
    ShardInfo shard;
    shard.file = string_field(s, "file", where);
    if (!files.contains(shard.file)) {
      bad(fmt::format("{}: file '{}' is not one of the checkpoint's files", where, shard.file));
    }
    const std::uint64_t rank = u64_field(s, "rank", where);
    if (rank >= static_cast<std::uint64_t>(world)) {
      bad(fmt::format("{}: rank {} outside world size {}", where, rank, world));
    }
    shard.rank = static_cast<int>(rank);
    shard.offset = shape_field(s, "offset", where);
    shard.extent = shape_field(s, "extent", where);
    shard.in_file_offset = s.contains("in_file_offset") ? shape_field(s, "in_file_offset", where) : Shape(ndim, 0);
    shard.xxh3 = u64_field(s, "xxh3", where);
    if (shard.offset.size() != ndim || shard.extent.size() != ndim || shard.in_file_offset.size() != ndim) {
      bad(fmt::format("{} (file {}): offset/extent/in_file_offset need {} dimensions", where, shard.file, ndim));
    }
    for (std::size_t d = 0; d < ndim; ++d) {
      const auto end = checked_add(shard.offset[d], shard.extent[d]);
      if (!end || *end > info.shape[d] || !checked_add(shard.in_file_offset[d], shard.extent[d])) {
        bad(fmt::format("{} (file {}): offset {} + extent {} is outside shape {}", where, shard.file,
                        shape_string(shard.offset), shape_string(shard.extent), shape_string(info.shape)));
      }
    }
    const auto next = checked_add(covered, element_count(shard.extent));
    if (!next || *next > *count) {
      bad(fmt::format("{}: shards hold more elements than shape {}", context, shape_string(info.shape)));
    }
    covered = *next;
    info.shards.push_back(std::move(shard));
  }
  if (covered != *count) {
    bad(fmt::format("{}: shards cover {} of {} elements", context, covered, *count));
  }
  return info;
}

}  // namespace

ParsedManifest parse_manifest(std::string_view text) {
  ParsedManifest out;
  try {
    out.json = json::parse(text, [](int depth, json::parse_event_t, json&) {
      if (depth > kMaxManifestDepth) bad(fmt::format("manifest nested deeper than {} levels", kMaxManifestDepth));
      return true;
    });
  } catch (const json::exception& e) {
    bad(fmt::format("manifest is not valid JSON ({})", e.what()));
  }
  const json& m = out.json;
  if (!m.is_object()) bad("manifest is not a JSON object");
  if (string_field(m, "format", "manifest") != kFormatName) bad("not an elastrun checkpoint");
  const std::uint64_t version = u64_field(m, "format_version", "manifest");
  if (version > static_cast<std::uint64_t>(kFormatVersion)) {
    bad(fmt::format("format version {} is newer than this reader ({}); upgrade elastrun", version, kFormatVersion));
  }
  (void)u64_field(m, "step", "manifest");
  const std::uint64_t world = u64_field(m, "world_size", "manifest");
  if (world < 1 || world > 1U << 30) bad(fmt::format("manifest: world_size {} is invalid", world));
  const std::string layout = string_field(m, "layout", "manifest");
  if (layout != "file-per-rank" && layout != "shared-file") bad(fmt::format("manifest: unknown layout '{}'", layout));
  (void)field(m, "metadata", "manifest");
  std::set<std::string> files;
  const json& file_list = field(m, "files", "manifest");
  if (!file_list.is_array()) bad("manifest: 'files' is not an array");
  for (const auto& f : file_list) {
    const std::string name = string_field(f, "name", "manifest file entry");
    if (!plain_file_name(name)) bad(fmt::format("manifest: file name '{}' is not a plain file name", name));
    (void)u64_field(f, "bytes", "manifest file " + name);
    files.insert(name);
  }
  const json& tensor_list = field(m, "tensors", "manifest");
  if (!tensor_list.is_array()) bad("manifest: 'tensors' is not an array");
  for (const auto& t : tensor_list) {
    TensorInfo info = parse_tensor(t, static_cast<int>(world), files);
    if (!out.by_name.emplace(info.name, out.tensors.size()).second)
      bad(fmt::format("tensor '{}' is listed twice", info.name));
    out.tensors.push_back(std::move(info));
  }
  return out;
}

}  // namespace elastrun::ckpt::detail
