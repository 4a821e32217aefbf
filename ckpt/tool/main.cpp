// elastrun-ckpt: list, inspect, verify and export checkpoints.
#include <algorithm>
#include <iostream>
#include <set>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "elastrun/ckpt/checkpoint.hpp"
#include "elastrun/ckpt/safetensors.hpp"

namespace fs = std::filesystem;
using namespace elastrun::ckpt;

namespace {

std::string human_bytes(std::uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return unit == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.1f} {}", value, units[unit]);
}

std::uint64_t directory_bytes(const fs::path& dir) {
  std::uint64_t total = 0;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    std::error_code entry_ec;
    if (it->is_regular_file(entry_ec)) {
      const auto size = it->file_size(entry_ec);
      if (!entry_ec) total += size;
    }
  }
  return total;
}

// Accepts a step directory, or a checkpoint root (uses its `latest`).
fs::path resolve_step(const fs::path& given) {
  std::error_code ec;
  if (!fs::exists(given, ec)) throw CheckpointError(given.string() + ": no such file or directory");
  if (!fs::is_directory(given, ec)) throw CheckpointError(given.string() + ": not a directory");
  if (!fs::exists(given / "index.h5", ec) && fs::exists(given / "latest", ec)) {
    return given / "latest";
  }
  if (!fs::exists(given / "index.h5", ec)) {
    throw CheckpointError(given.string() + ": not a checkpoint step (no index.h5); pass a step-N "
                                           "directory or a checkpoint directory with 'latest'");
  }
  return given;
}

int command_ls(const fs::path& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    throw CheckpointError(root.string() + ": not a checkpoint directory (does not exist or is "
                                          "not a directory)");
  }
  std::string latest;
  if (fs::is_symlink(root / "latest", ec)) latest = fs::read_symlink(root / "latest", ec).string();
  fmt::print("{:<16} {:>10} {:>6}  {}\n", "STEP", "SIZE", "WORLD", "STATUS");
  // Every step gets a line: a damaged one is shown as INVALID with the reason, never aborts.
  std::set<fs::path> listed;
  for (const auto& entry : list_steps(root)) {
    listed.insert(entry.path);
    std::string status = "ok";
    std::string world = "?";
    try {
      Checkpoint checkpoint(entry.path);
      world = std::to_string(checkpoint.world_size());
      checkpoint.check_files();
    } catch (const std::exception& e) {
      status = std::string("INVALID: ") + e.what();
    }
    std::replace(status.begin(), status.end(), '\n', ' ');
    const std::string name = entry.path.filename().string();
    if (name != elastrun::ckpt::step_directory("", entry.step).string()) {
      status += fmt::format(" (recovered copy {})", name);
    }
    fmt::print("{:<16} {:>10} {:>6}  {}{}\n", entry.step, human_bytes(directory_bytes(entry.path)),
               world, status, name == latest ? " (latest)" : "");
  }
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (listed.contains(entry.path())) continue;
    if (name.rfind("step-", 0) == 0 && name.find('.') != std::string::npos) {
      // Retired steps are renamed to step-N.deleting-<gen> and removed by the saving process in
      // the background; anything else with a suffix is left over from an interrupted save.
      const bool retired = name.find(".deleting-") != std::string::npos;
      fmt::print("{:<16} {:>10} {:>6}  {}\n", name, human_bytes(directory_bytes(entry.path())), "-",
                 retired ? "retired (being deleted, ignored; else removed by the next save)"
                         : "partial (interrupted save, ignored; removed by the next save)");
    }
  }
  return 0;
}

int command_inspect(const fs::path& given, bool show_shards) {
  Checkpoint checkpoint(resolve_step(given));
  fmt::print("path:       {}\nstep:       {}\nworld size: {}\nlayout:     {}\ntensors:    {} "
             "({})\nmetadata:   {}\n",
             checkpoint.path().string(), checkpoint.step(), checkpoint.world_size(),
             checkpoint.layout(), checkpoint.tensors().size(),
             human_bytes(checkpoint.total_bytes()), checkpoint.metadata().dump());
  fmt::print("{:<40} {:<9} {:<18} {:<10} {:>6} {:>10}\n", "NAME", "DTYPE", "SHAPE", "PLACEMENT",
             "SHARDS", "SIZE");
  for (const auto& t : checkpoint.tensors()) {
    fmt::print("{:<40} {:<9} {:<18} {:<10} {:>6} {:>10}\n", t.name, dtype_name(t.dtype),
               fmt::format("[{}]", fmt::join(t.shape, ",")),
               t.placement == Placement::sharded ? "sharded" : "replicated", t.shards.size(),
               human_bytes(t.bytes()));
    if (show_shards) {
      for (const auto& s : t.shards) {
        fmt::print("    rank {:>5} {} offset [{}] extent [{}] xxh3 {:016x}\n", s.rank, s.file,
                   fmt::join(s.offset, ","), fmt::join(s.extent, ","), s.xxh3);
      }
    }
  }
  return 0;
}

int command_verify(const fs::path& given) {
  Checkpoint checkpoint(resolve_step(given));
  const auto problems = checkpoint.verify_all();
  for (const auto& problem : problems) std::cerr << "elastrun-ckpt: " << problem << "\n";
  if (!problems.empty()) {
    fmt::print(stderr, "elastrun-ckpt: {}: {} problem(s); this checkpoint must not be used\n",
               checkpoint.path().string(), problems.size());
    return 1;
  }
  std::size_t shards = 0;
  for (const auto& t : checkpoint.tensors()) shards += t.shards.size();
  fmt::print("{}: ok ({} tensors, {} shard datasets, {} verified with xxh3_64)\n",
             checkpoint.path().string(), checkpoint.tensors().size(), shards,
             human_bytes(checkpoint.total_bytes()));
  return 0;
}

int command_export(const fs::path& given, const fs::path& output) {
  Checkpoint checkpoint(resolve_step(given));
  export_safetensors(checkpoint, output);
  fmt::print("wrote {} ({} tensors, {})\n", output.string(), checkpoint.tensors().size(),
             human_bytes(checkpoint.total_bytes()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Inspect, verify and export elastrun HDF5 checkpoints", "elastrun-ckpt"};
  app.require_subcommand(1);
  fs::path path;
  fs::path output;
  bool show_shards = false;
  auto* ls = app.add_subcommand("ls", "List the steps of a checkpoint directory");
  ls->add_option("DIR", path, "Checkpoint directory (holds step-*/ and latest)")->required();
  auto* inspect = app.add_subcommand("inspect", "Show tensors, shapes, dtypes and shards");
  inspect->add_option("STEP", path, "Step directory, or a checkpoint directory for latest")
      ->required();
  inspect->add_flag("--shards", show_shards, "List every shard of every tensor");
  auto* verify = app.add_subcommand("verify", "Check every shard's content hash (exit 1 if bad)");
  verify->add_option("STEP", path, "Step directory, or a checkpoint directory for latest")
      ->required();
  auto* export_cmd = app.add_subcommand("export", "Write the checkpoint as one safetensors file");
  export_cmd->add_option("STEP", path, "Step directory, or a checkpoint directory for latest")
      ->required();
  export_cmd->add_option("--to", output, "Output .safetensors file")->required();
  CLI11_PARSE(app, argc, argv);
  try {
    if (*ls) return command_ls(path);
    if (*inspect) return command_inspect(path, show_shards);
    if (*verify) return command_verify(path);
    if (*export_cmd) return command_export(path, output);
  } catch (const std::exception& e) {
    std::cerr << "elastrun-ckpt: " << e.what() << "\n";
    return 1;
  }
  return 2;
}
