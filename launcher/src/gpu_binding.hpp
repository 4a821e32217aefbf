// Which GPUs this agent's workers use and how each worker finds its own. The set is the one Slurm
// allocated to the step on this node -- CUDA_VISIBLE_DEVICES as Slurm set it (global indices, or
// 0-based where the site constrains devices), else SLURM_STEP_GPUS, SLURM_JOB_GPUS or
// GPU_DEVICE_ORDINAL -- and only without any of these the /dev/nvidia<N> files. Worker i uses
// the i-th visible GPU (torchrun's convention: LOCAL_RANK indexes the visible list), or with
// --gpus-per-worker / --virtual-local-rank sees only its own. docs/launcher.md, "GPUs".
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace elastrun::launcher {

struct GpuSet {
  std::vector<std::string> visible;  // what a worker's CUDA enumerates, in order (indices, UUIDs, MIG ids)
  std::string source;                // where the set came from, for messages ("CUDA_VISIBLE_DEVICES", ...)
  bool export_visible = false;       // the workers need CUDA_VISIBLE_DEVICES set: the environment has none
  // Slurm's global indices of the same GPUs, in the same order, when Slurm names them
  // (SLURM_STEP_GPUS/SLURM_JOB_GPUS beside a 0-based CUDA_VISIBLE_DEVICES of a site that
  // constrains devices); empty: `visible` are the global ids themselves. For the GPUs' NUMA nodes.
  std::vector<std::string> slurm_ids = {};
  std::size_t size() const { return visible.size(); }
  // The id the driver knows GPU `index` of `visible` by (a global index or a UUID).
  const std::string& driver_id(std::size_t index) const {
    return slurm_ids.size() == visible.size() ? slurm_ids[index] : visible[index];
  }
};

using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// The GPU set from an environment (`env`) and the number of /dev/nvidia<N> files.
GpuSet detect_gpus(const EnvLookup& env, int nvidia_device_files);
// The same from this process's environment and /dev.
GpuSet detect_gpus();
int count_nvidia_device_files(const std::filesystem::path& dev = "/dev");

struct WorkerDevice {
  std::optional<std::string> cuda_visible_devices;  // set for this worker; nullopt: it inherits the agent's
  int device = 0;                                   // ELASTRUN_DEVICE: the index to pass to set_device
};

// Worker `local_rank`'s view of `gpus`. Plain: the whole set, device = local rank (the set is
// exported when the environment had none from Slurm's variables). With gpus_per_worker = N >= 1:
// CUDA_VISIBLE_DEVICES = its N GPUs (local*N .. local*N+N-1), device 0; --virtual-local-rank
// alone is N = 1 (with no GPU at all, CUDA_VISIBLE_DEVICES = the local rank, as torchrun). Throws
// std::runtime_error naming the set when it has too few GPUs.
WorkerDevice device_for_worker(const GpuSet& gpus, int local_rank, int gpus_per_worker, bool virtual_local_rank);

// The NUMA node of each NVIDIA GPU as the driver and sysfs say: <proc>/<PCI bus id>/information
// ("Device Minor: N", "GPU UUID: GPU-...") and <pci>/<PCI bus id>/numa_node (-1: unknown).
struct GpuNumaNode {
  int minor = -1;  // /dev/nvidia<minor>: Slurm's global index where gres.conf lists the files in order
  std::string uuid;
  int numa_node = -1;
};
std::vector<GpuNumaNode> read_gpu_numa_nodes(const std::filesystem::path& proc = "/proc/driver/nvidia/gpus",
                                             const std::filesystem::path& pci = "/sys/bus/pci/devices");
// The NUMA node of the GPU the driver knows by `id` (a UUID, or an index = its minor number);
// nullopt when unknown.
std::optional<int> numa_node_of_gpu(const std::string& id, const std::vector<GpuNumaNode>& gpus);

// Per-task mode (srun --torch-env, no agent): the device a task passes to set_device
// (ELASTRUN_DEVICE), from what Slurm gave the task. Its own share -- fewer GPUs in its
// CUDA_VISIBLE_DEVICES than SLURM_GPUS_ON_NODE (--gpus-per-task, --ntasks-per-gpu,
// --gpu-bind=map_gpu|single) -- is 0, its first; the node's whole set (--gpus-per-node), or no
// CUDA_VISIBLE_DEVICES at all (--gpu-bind=none: every GPU of the node), is indexed by
// LOCAL_RANK modulo its size, torchrun's convention. nullopt: the task has no GPUs.
std::optional<int> task_device(const std::optional<std::string>& cuda_visible_devices, std::optional<int> gpus_on_node,
                               int local_rank);

}  // namespace elastrun::launcher
