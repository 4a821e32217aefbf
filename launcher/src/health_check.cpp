#include "health_check.hpp"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "elastrun/util/parse.hpp"
#include "elastrun/util/random.hpp"
#include "elastrun/util/unique_fd.hpp"
#include "workers.hpp"

namespace elastrun::launcher {

namespace fs = std::filesystem;
using Millis = std::chrono::milliseconds;

namespace {
std::string mib(std::uint64_t bytes) { return fmt::format("{:.0f} MiB", static_cast<double>(bytes) / (1 << 20)); }

// Markers of the checkpoint directory check: pub/health/checkpoint-dir/<node> = the file's name.
constexpr std::string_view kMarkerKeys = "health/checkpoint-dir/";
}  // namespace

HealthVerdict judge_command(const std::string& command, const CommandOutput& out, Millis timeout) {
  const auto said = last_line(out.output);
  const auto tail = said.empty() ? std::string() : ": " + said;
  if (!out.started) return HealthVerdict::fail("command", fmt::format("'{}' could not be run{}", command, tail));
  if (out.timed_out)
    return HealthVerdict::fail("command", fmt::format("'{}' did not finish within {} s (--health-check-timeout){}",
                                                      command, timeout.count() / 1000, tail));
  if (out.signal != 0)
    return HealthVerdict::fail("command",
                               fmt::format("'{}' was killed by {}{}", command, signal_name(out.signal), tail));
  if (out.exit_code != 0)
    return HealthVerdict::fail("command", fmt::format("'{}' exited {}{}", command, out.exit_code, tail));
  return HealthVerdict::pass("command", fmt::format("'{}' exited 0", command));
}

HealthVerdict judge_gpus(const GpuSet& allocated, int device_files, std::optional<int> smi_gpus,
                         const std::string& smi_error) {
  const auto n = allocated.size();
  if (n == 0) return HealthVerdict::pass("gpus", "no GPUs allocated to this step");
  if (!smi_error.empty())
    return HealthVerdict::fail(
        "gpus", fmt::format("{} GPU(s) allocated ({}) but nvidia-smi -L failed: {}", n, allocated.source, smi_error));
  if (static_cast<std::size_t>(device_files) < n)
    return HealthVerdict::fail("gpus", fmt::format("{} GPU(s) allocated ({}) but this node has {} /dev/nvidia<N> "
                                                   "device file(s)",
                                                   n, allocated.source, device_files));
  if (smi_gpus && static_cast<std::size_t>(*smi_gpus) < n)
    return HealthVerdict::fail(
        "gpus", fmt::format("{} GPU(s) allocated ({}) but nvidia-smi -L lists {}", n, allocated.source, *smi_gpus));
  return HealthVerdict::pass(
      "gpus", fmt::format("{} GPU(s) allocated ({}), {} device file(s){}", n, allocated.source, device_files,
                          smi_gpus ? fmt::format(", nvidia-smi lists {}", *smi_gpus) : ""));
}

HealthVerdict judge_memory(std::optional<std::uint64_t> budget, std::optional<std::uint64_t> mem_available) {
  if (!budget) return HealthVerdict::pass("memory", "no memory tier (--memory-checkpoints)");
  if (!mem_available) return HealthVerdict::pass("memory", "MemAvailable unreadable (/proc/meminfo): not checked");
  if (*mem_available < *budget)
    return HealthVerdict::fail("memory", fmt::format("MemAvailable is {}, less than the memory tier's budget of {} "
                                                     "(--memory-checkpoints)",
                                                     mib(*mem_available), mib(*budget)));
  return HealthVerdict::pass("memory",
                             fmt::format("MemAvailable {} holds the budget of {}", mib(*mem_available), mib(*budget)));
}

HealthVerdict judge_shm(const std::optional<FsSpace>& shm) {
  if (!shm) return HealthVerdict::pass("shm", "no /dev/shm: not checked");
  const auto needed = std::min(kMinShmFreeBytes, shm->size / 2);
  if (shm->free < needed)
    return HealthVerdict::fail("shm", fmt::format("/dev/shm is full: {} free of {} (workers' DataLoaders and NCCL "
                                                  "need it; remove what earlier jobs left there)",
                                                  mib(shm->free), mib(shm->size)));
  return HealthVerdict::pass("shm", fmt::format("/dev/shm: {} free of {}", mib(shm->free), mib(shm->size)));
}

HealthVerdict judge_clock(const std::optional<rdzv::Rendezvous::ClockReading>& reading, const std::string& store_node,
                          Millis limit) {
  if (!reading) return HealthVerdict::pass("clock", "the store cannot say its time (etcd): not checked");
  const double midpoint = (static_cast<double>(reading->before_ms) + static_cast<double>(reading->after_ms)) / 2;
  const double offset = static_cast<double>(reading->store_ms) - midpoint;  // > 0: the store's clock is ahead
  const double uncertainty = std::abs(static_cast<double>(reading->after_ms - reading->before_ms)) / 2;
  const auto what = fmt::format("{:.3f} s {} the store's host {} (+-{:.0f} ms)", std::abs(offset) / 1000,
                                offset > 0 ? "behind" : "ahead of", store_node, uncertainty);
  if (std::abs(offset) - uncertainty > static_cast<double>(limit.count()))
    return HealthVerdict::fail(
        "clock", fmt::format("this node's clock is {}; more than {} ms off: fix its time sync (chrony, ntpd)", what,
                             limit.count()));
  return HealthVerdict::pass("clock", "this node's clock is " + what);
}

HealthVerdict judge_shared_dir(const std::string& dir, const std::vector<std::string>& visible,
                               const std::vector<std::string>& missing) {
  if (missing.empty())
    return HealthVerdict::pass("checkpoint-dir",
                               visible.empty()
                                   ? fmt::format("{} is writable (the first node to check it)", dir)
                                   : fmt::format("{} is writable and shared with {}", dir, fmt::join(visible, ", ")));
  if (visible.empty())
    return HealthVerdict::fail(
        "checkpoint-dir",
        fmt::format("{} is not the directory {} see(s): their marker files are not in it here (mount the shared "
                    "filesystem at the same path on every node)",
                    dir, fmt::join(missing, ", ")));
  // Some nodes' markers are here, others' are not: those nodes are the odd ones, not this one.
  return HealthVerdict::pass("checkpoint-dir",
                             fmt::format("{} is shared with {}; not with {} (their own checks say so)", dir,
                                         fmt::join(visible, ", "), fmt::join(missing, ", ")));
}

std::optional<std::uint64_t> mem_available_bytes(const fs::path& meminfo) {
  std::ifstream in(meminfo);
  for (std::string line; std::getline(in, line);) {
    if (!line.starts_with("MemAvailable:")) continue;
    std::istringstream fields(line.substr(13));
    std::uint64_t kib = 0;
    if (fields >> kib) return kib * 1024;
  }
  return std::nullopt;
}

std::optional<FsSpace> fs_space(const fs::path& path) {
  struct statvfs s {};
  if (::statvfs(path.c_str(), &s) != 0) return std::nullopt;
  return FsSpace{static_cast<std::uint64_t>(s.f_blocks) * s.f_frsize,
                 static_cast<std::uint64_t>(s.f_bavail) * s.f_frsize};
}

std::optional<int> nvidia_smi_gpus(std::string& error) {
  error.clear();
  const auto out = run_captured({"nvidia-smi", "-L"}, Millis(30'000));
  if (out.started && out.exit_code == 127 && out.output.find("cannot run it") != std::string::npos)
    return std::nullopt;  // not installed
  if (!out.succeeded()) {
    error = last_line(out.output);
    if (error.empty()) error = out.timed_out ? "no answer within 30 s" : fmt::format("exit {}", out.exit_code);
    return 0;
  }
  int n = 0;
  std::istringstream lines(out.output);
  for (std::string line; std::getline(lines, line);)
    if (line.starts_with("GPU ")) ++n;
  return n;
}

HealthVerdict check_checkpoint_dir(const std::string& dir, rdzv::Rendezvous& rdzv, const std::string& node,
                                   const std::string& run_id, fs::path& marker) {
  if (dir.empty()) return HealthVerdict::pass("checkpoint-dir", "no --checkpoint-dir");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return HealthVerdict::fail("checkpoint-dir", fmt::format("cannot create {}: {}", dir, ec.message()));
  if (marker.empty()) {
    // A hidden file: checkpoint readers look only at step-N directories.
    const auto name = fmt::format(".elastrun-health.{}.{}.{}", run_id, node, util::random_hex(6));
    const auto path = fs::path(dir) / name;
    {
      util::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
      if (!fd || ::write(fd.get(), name.data(), name.size()) != static_cast<ssize_t>(name.size()) ||
          ::fsync(fd.get()) != 0)
        return HealthVerdict::fail("checkpoint-dir",
                                   fmt::format("{} is not writable here: {}", dir, std::strerror(errno)));
    }
    marker = path;
  }
  std::vector<std::pair<std::string, std::string>> others;
  for (auto& [key, file] : rdzv.read_prefix(kMarkerKeys)) {
    auto who = key.substr(kMarkerKeys.size());
    if (who != node && !file.empty()) others.emplace_back(std::move(who), std::move(file));
  }
  rdzv.publish(fmt::format("{}{}", kMarkerKeys, node), marker.filename().string());
  std::vector<std::string> visible, missing;
  const auto deadline = std::chrono::steady_clock::now() + Millis(3000);  // a shared filesystem's caches
  for (const auto& [who, file] : others) {
    bool found = fs::exists(fs::path(dir) / file, ec);
    while (!found && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(Millis(200));
      found = fs::exists(fs::path(dir) / file, ec);
    }
    (found ? visible : missing).push_back(who);
  }
  return judge_shared_dir(dir, visible, missing);
}

void remove_checkpoint_dir_marker(const fs::path& marker, rdzv::Rendezvous* rdzv, const std::string& node) {
  if (marker.empty()) return;
  if (rdzv) {
    try {
      rdzv->publish(fmt::format("{}{}", kMarkerKeys, node), "");  // withdrawn first: nobody looks for it after
    } catch (const std::exception&) {
      // the store may be gone at the end of the job
    }
  }
  std::error_code ec;
  fs::remove(marker, ec);
}

std::vector<HealthVerdict> run_node_local_checks(const HealthContext& c) {
  std::vector<HealthVerdict> verdicts{judge_gpus(c.gpus, count_nvidia_device_files(), std::nullopt, "")};
  if (verdicts.back().ok) verdicts.push_back(judge_memory(c.memory_budget, mem_available_bytes()));
  if (verdicts.back().ok) verdicts.push_back(judge_shm(fs_space("/dev/shm")));
  return verdicts;
}

std::vector<HealthVerdict> run_health_checks(const HealthContext& c, fs::path& marker) {
  std::vector<HealthVerdict> verdicts;
  auto failed = [&] { return !verdicts.empty() && !verdicts.back().ok; };
  if (c.builtin) {
    std::string smi_error;
    const auto smi = c.gpus.size() > 0 ? nvidia_smi_gpus(smi_error) : std::nullopt;
    verdicts.push_back(judge_gpus(c.gpus, count_nvidia_device_files(), smi, smi_error));
    if (!failed()) verdicts.push_back(judge_memory(c.memory_budget, mem_available_bytes()));
    if (!failed()) verdicts.push_back(judge_shm(fs_space("/dev/shm")));
    if (!failed() && c.rdzv) {
      try {
        verdicts.push_back(judge_clock(c.rdzv->store_clock(), c.store_node));
      } catch (const std::exception& e) {
        verdicts.push_back(HealthVerdict::pass("clock", fmt::format("not checked: {}", e.what())));
      }
    }
    if (!failed() && c.rdzv) {
      try {
        verdicts.push_back(check_checkpoint_dir(c.checkpoint_dir, *c.rdzv, c.node, c.run_id, marker));
      } catch (const std::exception& e) {
        verdicts.push_back(HealthVerdict::pass("checkpoint-dir", fmt::format("not checked: {}", e.what())));
      }
    }
  }
  for (const auto& command : c.commands) {
    if (failed()) break;
    verdicts.push_back(
        judge_command(command, run_captured({"/bin/sh", "-c", command}, c.command_timeout), c.command_timeout));
  }
  return verdicts;
}

}  // namespace elastrun::launcher
