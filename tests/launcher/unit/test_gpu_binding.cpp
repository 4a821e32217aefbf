// The step's GPUs and each worker's device (gpu_binding.hpp), from environments recorded under
// Slurm 22.05: without device constraints (global indices, the testbed's case), with
// ConstrainDevices (0-based CUDA_VISIBLE_DEVICES), a batch script's SLURM_JOB_GPUS only, UUIDs.
#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "gpu_binding.hpp"
#include "temp_dir.hpp"

namespace elastrun::launcher {
namespace {

EnvLookup recorded(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    const auto it = vars.find(name);
    return it == vars.end() ? std::nullopt : std::optional(it->second);
  };
}

using Devices = std::vector<std::string>;

TEST(GpuBinding, SlurmsStepListWithoutDeviceConstraintsHasGlobalIndices) {
  // srun --gpus-per-node=2 on a 4-GPU node whose GPUs 0 and 1 another step holds
  const auto gpus = detect_gpus(recorded({{"CUDA_VISIBLE_DEVICES", "2,3"},
                                          {"SLURM_STEP_GPUS", "2,3"},
                                          {"SLURM_JOB_GPUS", "0,1,2,3"},
                                          {"GPU_DEVICE_ORDINAL", "2,3"}}),
                                4);
  EXPECT_EQ(gpus.visible, (Devices{"2", "3"}));
  EXPECT_EQ(gpus.source, "CUDA_VISIBLE_DEVICES");
  EXPECT_FALSE(gpus.export_visible) << "the workers inherit it";
  const auto w1 = device_for_worker(gpus, 1, 0, false);
  EXPECT_FALSE(w1.cuda_visible_devices);
  EXPECT_EQ(w1.device, 1) << "torchrun's convention: LOCAL_RANK indexes the visible list";
}

TEST(GpuBinding, WithConstrainedDevicesCudaVisibleDevicesIsZeroBasedAndWins) {
  const auto gpus = detect_gpus(recorded({{"CUDA_VISIBLE_DEVICES", "0,1"}, {"SLURM_STEP_GPUS", "2,3"}}), 2);
  EXPECT_EQ(gpus.visible, (Devices{"0", "1"}));
  EXPECT_EQ(device_for_worker(gpus, 1, 1, false).cuda_visible_devices, "1");
}

TEST(GpuBinding, SlurmsListsWithoutCudaVisibleDevicesAreExportedToTheWorkers) {
  const auto gpus = detect_gpus(recorded({{"SLURM_JOB_GPUS", "1,3"}}), 4);
  EXPECT_EQ(gpus.visible, (Devices{"1", "3"}));
  EXPECT_EQ(gpus.source, "SLURM_JOB_GPUS");
  const auto w0 = device_for_worker(gpus, 0, 0, false);
  EXPECT_EQ(w0.cuda_visible_devices, "1,3") << "else the worker's CUDA sees all four";
  EXPECT_EQ(w0.device, 0);
  EXPECT_EQ(detect_gpus(recorded({{"SLURM_STEP_GPUS", "0"}, {"SLURM_JOB_GPUS", "0,1"}}), 2).visible, Devices{"0"});
  EXPECT_EQ(detect_gpus(recorded({{"GPU_DEVICE_ORDINAL", "0,1"}}), 0).source, "GPU_DEVICE_ORDINAL");
}

TEST(GpuBinding, OnlyWithoutSlurmsWordTheDeviceFilesCount) {
  const auto gpus = detect_gpus(recorded({}), 4);
  EXPECT_EQ(gpus.visible, (Devices{"0", "1", "2", "3"}));
  EXPECT_EQ(gpus.source, "/dev/nvidia*");
  EXPECT_FALSE(device_for_worker(gpus, 3, 0, false).cuda_visible_devices);
  EXPECT_EQ(detect_gpus(recorded({{"CUDA_VISIBLE_DEVICES", "NoDevFiles"}}), 4).size(), 0U)
      << "a GRES without device files names no GPU";
  EXPECT_EQ(detect_gpus(recorded({{"CUDA_VISIBLE_DEVICES", ""}}), 4).size(), 0U) << "hidden on purpose";
}

TEST(GpuBinding, GpusPerWorkerNarrowsToEachWorkersOwnAndTooFewIsAnError) {
  const auto gpus = detect_gpus(recorded({{"CUDA_VISIBLE_DEVICES", "GPU-aa,GPU-bb,GPU-cc,GPU-dd"}}), 4);
  const auto w1 = device_for_worker(gpus, 1, 2, false);
  EXPECT_EQ(w1.cuda_visible_devices, "GPU-cc,GPU-dd");
  EXPECT_EQ(w1.device, 0);
  EXPECT_EQ(device_for_worker(gpus, 3, 0, true).cuda_visible_devices, "GPU-dd") << "--virtual-local-rank: one each";
  try {
    device_for_worker(gpus, 2, 2, false);
    ADD_FAILURE() << "a worker got GPUs the node does not have";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("local rank 2 needs GPU(s) 4..5 of this node's 4 (CUDA_VISIBLE_DEVICES="),
              std::string::npos)
        << e.what();
  }
}

TEST(GpuBinding, VirtualLocalRankWithoutGpusNarrowsByLocalRankAsTorchrun) {
  const auto none = detect_gpus(recorded({}), 0);
  EXPECT_EQ(device_for_worker(none, 1, 0, true).cuda_visible_devices, "1");
  EXPECT_THROW(device_for_worker(none, 0, 1, false), std::runtime_error);
}

TEST(GpuBinding, DeviceFilesAreTheNumberedOnes) {
  test_support::TempDir dev;
  for (const char* name : {"nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-caps", "tty0"})
    std::ofstream(dev.path() / name) << "";
  EXPECT_EQ(count_nvidia_device_files(dev.path()), 2);
}

// Per-task mode (srun --torch-env): each row is what Slurm 22.05 gave a task on the testbed
// (4 GPUs per node, no ConstrainDevices: global indices), or on a site that constrains devices
// (0-based indices), and the device the task must pass to set_device.
TEST(GpuBinding, PerTaskModeEachSlurmOptionGivesTheTaskItsOwnGpu) {
  struct Row {
    const char* option;
    std::optional<std::string> cvd;
    std::optional<int> gpus_on_node;
    int local_rank;
    std::optional<int> device;
  };
  const std::vector<Row> rows{
      {"--gpus-per-task=1", "2", 4, 2, 0},
      {"--gpus-per-task=1, ConstrainDevices", "0", 4, 2, 0},
      {"--gpus-per-node=4", "0,1,2,3", 4, 2, 2},
      {"--gpus-per-node=4, 8 tasks", "0,1,2,3", 4, 6, 2},
      {"--ntasks-per-gpu=2", "1", 2, 3, 0},
      {"--gpus-per-task=2", "2,3", 4, 1, 0},
      {"--gpu-bind=map_gpu:3,2,1,0", "0", 4, 3, 0},
      {"--gpu-bind=none (no CUDA_VISIBLE_DEVICES)", std::nullopt, 4, 3, 3},
      {"one task, --gpus-per-node=1", "0", 1, 0, 0},
      {"no GPUs", std::nullopt, std::nullopt, 1, std::nullopt},
      {"no GPUs, an empty CUDA_VISIBLE_DEVICES", "", std::nullopt, 1, std::nullopt},
  };
  for (const auto& r : rows) EXPECT_EQ(task_device(r.cvd, r.gpus_on_node, r.local_rank), r.device) << r.option;
}

}  // namespace
}  // namespace elastrun::launcher
