// Checkpoint bandwidth vs the storage limit (dd conv=fdatasync), measured in the same run.
// Prints figures and ratios; never asserts. Single process or `mpirun -np N`.
//   ckpt_bench [--dir DIR] [--mib-per-rank N] [--tensors K]
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "elastrun/ckpt/async_saver.hpp"
#include "elastrun/ckpt/checkpoint.hpp"
#include "elastrun/ckpt/mpi_comm.hpp"

namespace fs = std::filesystem;
using namespace elastrun::ckpt;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Runs dd on this rank; returns bytes/s parsed from dd's own summary (0 if unavailable).
double dd_write(const fs::path& file, std::uint64_t mib) {
  const std::string command = fmt::format(
      "dd if=/dev/zero of='{}' bs=1M count={} conv=fdatasync 2>&1", file.string(), mib);
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return 0;
  std::string output;
  char buffer[512];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) output += buffer;
  ::pclose(pipe);
  std::error_code ec;
  fs::remove(file, ec);
  // "... bytes (...) copied, 0.93 s, 1.1 GB/s"
  const auto copied = output.find("copied, ");
  if (copied == std::string::npos) return 0;
  const double secs = std::strtod(output.c_str() + copied + 8, nullptr);
  return secs > 0 ? static_cast<double>(mib << 20) / secs : 0;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  fs::path dir = "/work/tmp/ckpt-bench";
  std::uint64_t mib_per_rank = 256;
  int tensor_count = 8;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--dir") dir = argv[i + 1];
    else if (flag == "--mib-per-rank") mib_per_rank = std::stoull(argv[i + 1]);
    else if (flag == "--tensors") tensor_count = std::stoi(argv[i + 1]);
  }
  MpiCommunicator comm(MPI_COMM_WORLD);
  const int rank = comm.rank();
  const int world = comm.size();
  // Rank 0 names the run directory; everyone uses its name.
  const fs::path root =
      comm.allgather(rank == 0 ? (dir / fmt::format("run-{}", ::getpid())).string() : "").at(0);
  if (rank == 0) fs::create_directories(root);
  comm.barrier();

  // One sharded float32 tensor family: rank r owns rows [r*rows, (r+1)*rows) of each.
  const std::uint64_t bytes_per_tensor = (mib_per_rank << 20) / tensor_count;
  const std::uint64_t columns = 1024;
  const std::uint64_t rows = bytes_per_tensor / (columns * 4);
  std::vector<std::vector<float>> data(tensor_count);
  std::vector<TensorView> views;
  for (int t = 0; t < tensor_count; ++t) {
    data[t].assign(rows * columns, static_cast<float>(rank + t));  // touched once, up front
    views.push_back(TensorView::sharded(fmt::format("model/t{}", t), DType::float32,
                                        {rows * world, columns}, {rows * rank, 0}, {rows, columns},
                                        data[t].data()));
  }
  const double total_bytes = static_cast<double>(rows * columns * 4 * tensor_count * world);
  auto report = [&](const char* what, double secs) {
    double slowest = 0;
    MPI_Allreduce(&secs, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0) fmt::print("{:<36} {:8.3f} s {:8.2f} GB/s\n", what, slowest, total_bytes / slowest / 1e9);
    return total_bytes / slowest;
  };

  comm.barrier();
  auto start = Clock::now();
  const double dd_rate = dd_write(root / fmt::format("dd-{}", rank), mib_per_rank);
  const double dd_secs = seconds_since(start);
  const double dd_total = report("dd conv=fdatasync (all ranks)", dd_secs);
  (void)dd_rate;

  std::uint64_t step = 0;
  SaveOptions options;
  options.keep_last = 1;
  double save_rate = 0;
  for (int repeat = 0; repeat < 2; ++repeat) {
    comm.barrier();
    start = Clock::now();
    save_checkpoint(root, ++step, views, {}, comm, options);
    save_rate = report(repeat == 0 ? "save file-per-rank (first)" : "save file-per-rank (again)",
                       seconds_since(start));
  }

  SaveOptions shared = options;
  shared.layout = Layout::shared_file;
  comm.barrier();
  start = Clock::now();
  save_checkpoint(root, ++step, views, {}, comm, shared);
  const double shared_rate = report("save shared-file (MPI-IO)", seconds_since(start));

  std::vector<TensorTarget> targets;
  for (int t = 0; t < tensor_count; ++t) {
    targets.push_back(TensorTarget::box(fmt::format("model/t{}", t), DType::float32,
                                        {rows * rank, 0}, {rows, columns}, data[t].data()));
  }
  for (bool verify : {true, false}) {
    comm.barrier();
    start = Clock::now();
    restore_latest(root, targets, comm, RestoreOptions{verify, 1});
    report(verify ? "load (verify hashes)" : "load (no verify)", seconds_since(start));
  }

  {
    AsyncSaver saver(root, comm, options);
    saver.save(++step, views, {});  // warms the staging buffers (first touch is slow here)
    saver.wait();
    comm.barrier();
    start = Clock::now();
    saver.save(++step, views, {});
    const double blocked = seconds_since(start);
    saver.wait();
    const double total = seconds_since(start);
    report("async save: training blocked", blocked);
    report("async save: until durable", total);
  }
  if (rank == 0) {
    fmt::print("ratio save/dd: file-per-rank {:.2f}, shared-file {:.2f}  (world {}, {} MiB/rank)\n",
               save_rate / dd_total, shared_rate / dd_total, world, mib_per_rank);
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  MPI_Finalize();
  return 0;
}
