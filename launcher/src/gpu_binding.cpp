#include "gpu_binding.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <stdexcept>

#include "elastrun/util/parse.hpp"

namespace elastrun::launcher {

namespace {

// "0,1", "GPU-8a1e..,GPU-77c0.." -> entries; Slurm writes "NoDevFiles" when the GRES has no device
// files (then it names no device CUDA can use).
std::optional<std::vector<std::string>> device_list(const std::optional<std::string>& value) {
  if (!value) return std::nullopt;
  std::vector<std::string> devices;
  if (*value == "NoDevFiles") return devices;
  for (auto d : util::split_list(*value))
    if (!d.empty()) devices.emplace_back(d);
  return devices;
}

}  // namespace

GpuSet detect_gpus(const EnvLookup& env, int nvidia_device_files) {
  // CUDA_VISIBLE_DEVICES is what CUDA will enumerate, whoever set it (Slurm for the step, or the
  // user); Slurm's own lists are global indices, right for CUDA where devices are not constrained
  // (where they are, Slurm sets CUDA_VISIBLE_DEVICES, 0-based, and it comes first).
  if (auto devices = device_list(env("CUDA_VISIBLE_DEVICES"))) {
    GpuSet set{std::move(*devices), "CUDA_VISIBLE_DEVICES", false};
    for (const char* name : {"SLURM_STEP_GPUS", "SLURM_JOB_GPUS"})
      if (auto global = device_list(env(name)); global && global->size() == set.size() && !global->empty()) {
        set.slurm_ids = std::move(*global);
        break;
      }
    return set;
  }
  for (const char* name : {"SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "GPU_DEVICE_ORDINAL"})
    if (auto devices = device_list(env(name))) return {std::move(*devices), name, true};
  GpuSet all{{}, "/dev/nvidia*", false};
  for (int i = 0; i < nvidia_device_files; ++i) all.visible.push_back(std::to_string(i));
  return all;
}

int count_nvidia_device_files(const std::filesystem::path& dev) {
  int n = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dev, ec)) {
    const auto name = entry.path().filename().string();
    if (name.size() > 6 && name.starts_with("nvidia") &&
        std::all_of(name.begin() + 6, name.end(), [](char c) { return c >= '0' && c <= '9'; }))
      ++n;
  }
  return n;
}

GpuSet detect_gpus() {
  return detect_gpus(
      [](const std::string& name) -> std::optional<std::string> {
        const char* value = std::getenv(name.c_str());
        return value ? std::optional<std::string>(value) : std::nullopt;
      },
      count_nvidia_device_files());
}

WorkerDevice device_for_worker(const GpuSet& gpus, int local_rank, int gpus_per_worker, bool virtual_local_rank) {
  const int per_worker = gpus_per_worker >= 1 ? gpus_per_worker : (virtual_local_rank ? 1 : 0);
  if (per_worker == 0) {
    WorkerDevice plain{std::nullopt, local_rank};
    if (gpus.export_visible) plain.cuda_visible_devices = fmt::format("{}", fmt::join(gpus.visible, ","));
    return plain;
  }
  if (gpus.visible.empty() && gpus_per_worker < 1)  // no GPU here: torchrun's narrowing, by local rank
    return {std::to_string(local_rank), 0};
  const auto first = static_cast<std::size_t>(local_rank) * static_cast<std::size_t>(per_worker);
  if (first + static_cast<std::size_t>(per_worker) > gpus.size())
    throw std::runtime_error(fmt::format(
        "local rank {} needs GPU(s) {}..{} of this node's {} ({}={}): give fewer workers or GPUs per worker",
        local_rank, first, first + static_cast<std::size_t>(per_worker) - 1, gpus.size(), gpus.source,
        fmt::join(gpus.visible, ",")));
  const auto begin = gpus.visible.begin() + static_cast<std::ptrdiff_t>(first);
  return {fmt::format("{}", fmt::join(begin, begin + per_worker, ",")), 0};
}

std::vector<GpuNumaNode> read_gpu_numa_nodes(const std::filesystem::path& proc, const std::filesystem::path& pci) {
  std::vector<GpuNumaNode> gpus;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(proc, ec)) {
    GpuNumaNode gpu;
    std::ifstream info(entry.path() / "information");
    for (std::string line; std::getline(info, line);) {
      const auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      auto value = std::string_view(line).substr(colon + 1);
      while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
      const auto key = std::string_view(line).substr(0, colon);
      if (key == "Device Minor") gpu.minor = util::parse_integer<int>(value).value_or(-1);
      if (key == "GPU UUID") gpu.uuid = std::string(value);
    }
    std::ifstream node(pci / entry.path().filename() / "numa_node");
    std::string text;
    if (node >> text) gpu.numa_node = util::parse_integer<int>(text).value_or(-1);
    if (gpu.minor >= 0 || !gpu.uuid.empty()) gpus.push_back(std::move(gpu));
  }
  return gpus;
}

std::optional<int> numa_node_of_gpu(const std::string& id, const std::vector<GpuNumaNode>& gpus) {
  const auto index = util::parse_integer<int>(id);
  for (const auto& g : gpus)
    if ((index && g.minor == *index) || (!index && !g.uuid.empty() && g.uuid == id))
      return g.numa_node >= 0 ? std::optional(g.numa_node) : std::nullopt;
  return std::nullopt;
}

std::optional<int> task_device(const std::optional<std::string>& cuda_visible_devices, std::optional<int> gpus_on_node,
                               int local_rank) {
  std::size_t visible = 0;
  if (cuda_visible_devices)
    for (const auto& id : util::split_list(*cuda_visible_devices))
      if (!id.empty()) ++visible;
  if (visible == 0) {  // Slurm set none: the task sees every GPU of the node
    if (!gpus_on_node || *gpus_on_node <= 0) return std::nullopt;
    return local_rank % *gpus_on_node;
  }
  if (gpus_on_node && static_cast<std::size_t>(*gpus_on_node) > visible) return 0;  // its own share
  return local_rank % static_cast<int>(visible);
}

}  // namespace elastrun::launcher
