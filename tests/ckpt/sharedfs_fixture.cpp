// Checkpoints on a shared filesystem, across nodes: the ranks of one Slurm step (srun --mpi=pmix,
// one rank per node) save, and the ranks of another step, on other nodes and at another world
// size, restore through their own mounts (tests/ckpt/test_ckpt_sharedfs.sh drives it).
//
//   sharedfs_fixture save ROOT FIRST LAST LAYOUT [--keep-last K] [--crash-before-publish]
//       world 4: saves steps FIRST..LAST (step s holds the model of seed s). After each commit the
//       last rank -- on another node than rank 0, which committed -- must at once see `latest`
//       name the new step and read every shard of it with verified hashes.
//       --crash-before-publish: rank 0 SIGKILLs itself at the commit point of step LAST (every
//       shard written and voted, the step not yet renamed into place).
//   sharedfs_fixture restore ROOT STEP
//       any world size: restores the newest loadable step, which must be STEP, into column
//       slices of every tensor (a sharding none of the savers had) and compares them bit-exactly.
// LAYOUT: file_per_rank | shared_file (collective MPI-IO into one data.h5).
// Every line of output is prefixed "[rank N] <node>:"; exit status 0 only if everything held.
#include <mpi.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "elastrun/ckpt/checkpoint.hpp"
#include "elastrun/ckpt/mpi_comm.hpp"
#include "elastrun/ckpt/testing.hpp"
#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;
namespace ck = elastrun::ckpt;
using ck::testing::GlobalTensor;

std::string g_prefix;

void say(const std::string& line) { std::cout << g_prefix << line << std::endl; }

[[noreturn]] void die(const std::string& line) {
  std::cerr << g_prefix << "error: " << line << std::endl;
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

// The world-4 model of the unit tests (every dtype and awkward shape) plus tensors large enough
// to make multi-MiB files: a row-sharded 4 MiB matrix and a replicated 1 MiB vector.
std::vector<GlobalTensor> model_of_step(std::uint64_t step) {
  auto model = ck::testing::world4_model(step * 100);
  model.push_back({"big/w",
                   ck::DType::float32,
                   {1024, 1024},
                   ck::Placement::sharded,
                   ck::testing::make_tensor(step * 100 + 50, ck::DType::float32, {1024, 1024})});
  model.push_back({"big/replica",
                   ck::DType::float64,
                   {128, 1024},
                   ck::Placement::replicated,
                   ck::testing::make_tensor(step * 100 + 51, ck::DType::float64, {128, 1024})});
  return model;
}

std::pair<ck::Shape, ck::Shape> slice_of(const GlobalTensor& t, int rank) {
  if (t.name == "big/w") {
    const auto [r0, rn] = ck::testing::split(1024, 4, rank);
    return {{r0, 0}, {rn, 1024}};
  }
  return ck::testing::world4_slice(t, rank);
}

std::string latest_target(const fs::path& root) {
  std::error_code ec;
  const fs::path target = fs::read_symlink(root / "latest", ec);
  return ec ? "(" + ec.message() + ")" : target.string();
}

int save(ck::Communicator& comm, const fs::path& root, std::uint64_t first, std::uint64_t last, ck::Layout layout,
         int keep_last, bool crash) {
  if (comm.size() != 4) die(fmt::format("save needs a world of 4 ranks, got {}", comm.size()));
  if (crash && comm.rank() == 0) {
    ck::testing::set_fault_hook([last](std::string_view point, int rank) {
      (void)rank;
      if (point == "commit.before_publish") {
        std::cout << g_prefix << "SIGKILL at the commit point of step " << last << std::endl;
        ::raise(SIGKILL);
      }
    });
  }
  ck::SaveOptions options;
  options.layout = layout;
  options.keep_last = keep_last;
  options.alignment = layout == ck::Layout::shared_file ? 65536 : 0;
  for (std::uint64_t step = first; step <= last; ++step) {
    const auto model = model_of_step(step);
    std::vector<std::vector<std::byte>> slices;
    slices.reserve(model.size());
    std::vector<ck::TensorView> views;
    for (const auto& t : model) {
      if (t.placement == ck::Placement::replicated) {
        views.push_back(ck::TensorView::replicated(t.name, t.dtype, t.shape, t.bytes.data()));
        continue;
      }
      auto [offset, extent] = slice_of(t, comm.rank());
      slices.push_back(ck::testing::extract_box(t.bytes, t.shape, offset, extent, ck::dtype_size(t.dtype)));
      views.push_back(ck::TensorView::sharded(t.name, t.dtype, t.shape, offset, extent, slices.back().data()));
    }
    const auto result = ck::save_checkpoint(root, step, views, {{"step", step}}, comm, options);
    say(fmt::format("saved step {} ({} bytes of tensors from this rank)", step, result.bytes_written));
    if (comm.rank() == comm.size() - 1) {
      // Right after the collective save returned: rank 0 (another node) committed it.
      const std::string want = ck::step_directory(root, step).filename().string();
      const std::string got = latest_target(root);
      if (got != want)
        die(fmt::format("right after the commit of step {}, latest -> '{}', expected '{}'", step, got, want));
      ck::Checkpoint checkpoint(root / "latest");
      const auto problems = checkpoint.verify_all();
      if (!problems.empty()) die(fmt::format("latest (step {}) does not verify here: {}", step, problems.front()));
      if (checkpoint.step() != step) die(fmt::format("latest holds step {}, expected {}", checkpoint.step(), step));
      say(fmt::format("sees latest -> {} at once, every shard verified", got));
    }
  }
  return 0;
}

int restore(ck::Communicator& comm, const fs::path& root, std::uint64_t want_step) {
  const auto model = model_of_step(want_step);
  std::vector<std::vector<std::byte>> buffers, expected;
  std::vector<ck::TensorTarget> targets;
  buffers.reserve(model.size());
  expected.reserve(model.size());
  for (const auto& t : model) {
    ck::Shape offset(t.shape.size(), 0), extent = t.shape;
    if (!t.shape.empty()) {
      const auto [b, n] = ck::testing::split(t.shape.back(), comm.size(), comm.rank());
      offset.back() = b;
      extent.back() = n;
    }
    expected.push_back(ck::testing::extract_box(t.bytes, t.shape, offset, extent, ck::dtype_size(t.dtype)));
    buffers.emplace_back(expected.back().size(), std::byte{0xcd});
    targets.push_back(ck::TensorTarget::box(t.name, t.dtype, offset, extent, buffers.back().data()));
  }
  const auto restored = ck::restore_latest(root, targets, comm);
  if (!restored) die("no loadable checkpoint under " + root.string());
  for (const auto& why : restored->skipped) say("skipped: " + why);
  if (restored->step != want_step) die(fmt::format("restored step {}, expected {}", restored->step, want_step));
  std::uint64_t bytes = 0;
  for (std::size_t i = 0; i < model.size(); ++i) {
    if (buffers[i] != expected[i])
      die(fmt::format("tensor {} of step {} differs from what was saved", model[i].name, want_step));
    bytes += buffers[i].size();
  }
  say(fmt::format("restored step {} at world {}: {} tensors, {} bytes, bit-exact", want_step, comm.size(), model.size(),
                  bytes));
  return 0;
}

int run(int argc, char** argv, ck::Communicator& comm) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() >= 5 && args[0] == "save") {
    const auto layout = args[4] == "shared_file" ? ck::Layout::shared_file : ck::Layout::file_per_rank;
    if (args[4] != "shared_file" && args[4] != "file_per_rank") die("LAYOUT must be file_per_rank or shared_file");
    int keep_last = 0;
    bool crash = false;
    for (std::size_t i = 5; i < args.size(); ++i) {
      if (args[i] == "--keep-last" && i + 1 < args.size()) {
        keep_last = std::stoi(args[++i]);
      } else if (args[i] == "--crash-before-publish") {
        crash = true;
      } else {
        die("unknown argument '" + args[i] + "'");
      }
    }
    return save(comm, args[1], std::stoull(args[2]), std::stoull(args[3]), layout, keep_last, crash);
  }
  if (args.size() == 3 && args[0] == "restore") return restore(comm, args[1], std::stoull(args[2]));
  die("usage: sharedfs_fixture save ROOT FIRST LAST LAYOUT [--keep-last K] [--crash-before-publish] | restore ROOT "
      "STEP");
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 1;
  {
    ck::MpiCommunicator comm(MPI_COMM_WORLD);
    char host[256] = "?";
    const char* node = std::getenv("SLURMD_NODENAME");
    if (node == nullptr && ::gethostname(host, sizeof host - 1) == 0) node = host;
    g_prefix = fmt::format("[rank {}] {}: ", comm.rank(), node != nullptr ? node : "?");
    try {
      rc = run(argc, argv, comm);
    } catch (const std::exception& e) {
      die(e.what());
    }
  }
  MPI_Finalize();
  return rc;
}
