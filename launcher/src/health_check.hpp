// --health-check: a node checked before it joins (docs/launcher.md, "Health checks").
//
// The agent runs the checks at its first join and after each failure of its own workers -- not
// before every round, so that a re-form stays fast. A node that fails one does not join: the
// agent says why in one line and in a `health_check` event, records it for the job-wide failure
// summary, marks the node for exclusion on requeue, and leaves (exit 87); the job goes on with
// the other nodes if they are at least --nnodes MIN.
//
// Two kinds: a site's command (`--health-check=CMD`, run with /bin/sh -c, passes when it exits
// 0, the way Slurm's HealthCheckProgram and NVIDIA's NVRx checks are used) and `builtin`:
//   gpus            the GPUs Slurm allocated are there (/dev/nvidia*, nvidia-smi -L where installed)
//   memory          MemAvailable holds the memory tier's budget (--memory-checkpoints)
//   shm             /dev/shm is not full
//   checkpoint-dir  --checkpoint-dir is writable, and it is the directory the other nodes see
//   clock           this node's clock is within 1 s of the store host's
// Each judgement is a pure function of what was read (unit-tested with canned inputs); the
// readers and run_health_checks() do the I/O.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "elastrun/rdzv/rendezvous.hpp"
#include "gpu_binding.hpp"
#include "subprocess.hpp"

namespace elastrun::launcher {

struct HealthVerdict {
  bool ok = true;
  std::string check;  // "command", "gpus", "memory", "shm", "checkpoint-dir", "clock"
  std::string what;   // one line: why it failed, or what was found when it passed
  static HealthVerdict pass(std::string check, std::string what) { return {true, std::move(check), std::move(what)}; }
  static HealthVerdict fail(std::string check, std::string what) { return {false, std::move(check), std::move(what)}; }
};

inline constexpr std::chrono::milliseconds kMaxClockOffset{1000};
inline constexpr std::uint64_t kMinShmFreeBytes = 64ull << 20;

// ---- the judgements (pure) ----
HealthVerdict judge_command(const std::string& command, const CommandOutput& out, std::chrono::milliseconds timeout);
// `device_files`: /dev/nvidia<N> files on the node; `smi_gpus`: GPUs nvidia-smi -L listed
// (nullopt: not installed), `smi_error`: what it said when it failed ("" if it did not).
HealthVerdict judge_gpus(const GpuSet& allocated, int device_files, std::optional<int> smi_gpus,
                         const std::string& smi_error);
HealthVerdict judge_memory(std::optional<std::uint64_t> budget, std::optional<std::uint64_t> mem_available);
struct FsSpace {
  std::uint64_t size = 0, free = 0;
};
// Full: less than min(64 MiB, half its size) free.
HealthVerdict judge_shm(const std::optional<FsSpace>& shm);
// nullopt reading: the store cannot say its time (etcd) -- passes, saying so.
HealthVerdict judge_clock(const std::optional<rdzv::Rendezvous::ClockReading>& reading, const std::string& store_node,
                          std::chrono::milliseconds limit = kMaxClockOffset);
// The checkpoint directory as this node sees it: `visible` = the other nodes whose marker files
// (published in the store) it finds there, `missing` = those it does not.
HealthVerdict judge_shared_dir(const std::string& dir, const std::vector<std::string>& visible,
                               const std::vector<std::string>& missing);

// ---- the readers ----
std::optional<std::uint64_t> mem_available_bytes(const std::filesystem::path& meminfo = "/proc/meminfo");
std::optional<FsSpace> fs_space(const std::filesystem::path& path);
// nvidia-smi -L: the number of GPUs it lists; nullopt when it is not installed. `error` gets its
// last line when it fails.
std::optional<int> nvidia_smi_gpus(std::string& error);

// The checkpoint directory (created if missing, as the trainer would): writable here, and the
// same directory every node sees. Each node leaves a marker file in it, named in the store
// (pub/health/checkpoint-dir/<node>), and looks for the markers of the nodes that checked
// before it; `marker` receives the path of this node's marker (remove it at the end of the job).
HealthVerdict check_checkpoint_dir(const std::string& dir, rdzv::Rendezvous& rdzv, const std::string& node,
                                   const std::string& run_id, std::filesystem::path& marker);
// This node's marker withdrawn from the store (an empty value) and removed from the directory.
void remove_checkpoint_dir_marker(const std::filesystem::path& marker, rdzv::Rendezvous* rdzv, const std::string& node);

struct HealthContext {
  std::vector<std::string> commands;  // --health-check=CMD, each
  bool builtin = false;               // --health-check=builtin
  std::chrono::milliseconds command_timeout{60'000};
  GpuSet gpus;
  std::optional<std::uint64_t> memory_budget;
  std::string checkpoint_dir;
  std::string node, run_id, store_node;
  rdzv::Rendezvous* rdzv = nullptr;  // the store checks need it (null: skipped)
};
// The builtin checks that need neither the store nor a helper process (gpus by device files,
// memory, shm), for the repeated checks while workers run; stops at the first failure.
std::vector<HealthVerdict> run_node_local_checks(const HealthContext& c);

// Runs every check in order (builtin first) and stops at the first that fails; returns the
// verdicts so far (the last one failed, or all passed). `marker`: as check_checkpoint_dir.
std::vector<HealthVerdict> run_health_checks(const HealthContext& c, std::filesystem::path& marker);

}  // namespace elastrun::launcher
