// Checkpoint bandwidth vs the storage limit (dd conv=fdatasync), peak extra memory during save
// (VmHWM delta vs the shard size) and async blocking time vs sync, measured in the same run.
// Prints figures and ratios against the goals; never asserts. Single process or `mpirun -np N`.
//   ckpt_bench [--dir DIR] [--mib-per-rank N] [--tensors K] [--reference FILE] [--repeats R]
//              [--json OUT]
// OUT: every run's raw figures as JSON (rank 0), for bench/run.py (scripts/bench).
// FILE: figures of the reference tools measured in the same run on the same data size
// (bench/ckpt_torch_compare.py output, "<measure>\t<seconds>\t<GB/s>" lines); the summary then
// puts our save and load bandwidth beside theirs.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "elastrun/ckpt/async_saver.hpp"
#include "elastrun/ckpt/checkpoint.hpp"
#include "elastrun/ckpt/mpi_comm.hpp"

namespace fs = std::filesystem;
using namespace elastrun::ckpt;
using Clock = std::chrono::steady_clock;

namespace {

// Peak-RSS tracking: clear_refs "5" resets VmHWM to the current RSS (Linux >= 4.0).
std::uint64_t status_kib(const char* field) {
  FILE* file = std::fopen("/proc/self/status", "r");
  if (file == nullptr) return 0;
  char line[256];
  std::uint64_t value = 0;
  const std::size_t length = std::strlen(field);
  while (std::fgets(line, sizeof line, file) != nullptr) {
    if (std::strncmp(line, field, length) == 0 && line[length] == ':') {
      value = std::strtoull(line + length + 1, nullptr, 10);
      break;
    }
  }
  std::fclose(file);
  return value;
}

bool reset_peak_rss() {
  FILE* file = std::fopen("/proc/self/clear_refs", "w");
  if (file == nullptr) return false;
  const bool ok = std::fputs("5", file) >= 0;
  return std::fclose(file) == 0 && ok;
}

// Bytes the process's peak RSS rose above `baseline_kib` since the last reset.
double peak_extra_bytes(std::uint64_t baseline_kib) {
  const std::uint64_t peak = status_kib("VmHWM");
  return peak > baseline_kib ? static_cast<double>(peak - baseline_kib) * 1024.0 : 0.0;
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Runs dd on this rank; returns bytes/s parsed from dd's own summary (0 if unavailable).
// With `seek_mib`, all ranks write disjoint regions of one shared file (`remove` only by the
// caller's choice): the raw limit for the shared-file layout, where the local filesystem
// serialises writers of one inode in a way it does not for one file per rank.
double dd_write(const fs::path& file, std::uint64_t mib, std::optional<std::uint64_t> seek_mib = {},
                bool remove = true) {
  const std::string command =
      seek_mib ? fmt::format("dd if=/dev/zero of='{}' bs=1M count={} seek={} conv=notrunc,fdatasync 2>&1",
                             file.string(), mib, *seek_mib)
               : fmt::format("dd if=/dev/zero of='{}' bs=1M count={} conv=fdatasync 2>&1", file.string(), mib);
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return 0;
  std::string output;
  char buffer[512];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) output += buffer;
  ::pclose(pipe);
  std::error_code ec;
  if (remove) fs::remove(file, ec);
  // "... bytes (...) copied, 0.93 s, 1.1 GB/s"
  const auto copied = output.find("copied, ");
  if (copied == std::string::npos) return 0;
  const double secs = std::strtod(output.c_str() + copied + 8, nullptr);
  return secs > 0 ? static_cast<double>(mib << 20) / secs : 0;
}

}  // namespace

// "<measure>\t<seconds>\t<GB/s>" lines (comments start with #) -> measure -> bytes/s.
static std::vector<std::pair<std::string, double>> read_references(const fs::path& file) {
  std::vector<std::pair<std::string, double>> references;
  if (file.empty()) return references;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    const auto first = line.find('\t');
    const auto second = line.find('\t', first == std::string::npos ? first : first + 1);
    if (line.empty() || line[0] == '#' || second == std::string::npos) continue;
    const double gbs = std::strtod(line.c_str() + second + 1, nullptr);
    if (gbs > 0) references.emplace_back(line.substr(0, first), gbs * 1e9);
  }
  return references;
}

int main(int argc, char** argv) {
  // Ranks waiting in a collective yield the CPU instead of spinning: with more ranks than cores
  // (4 ranks on 2 cores here) spinning ranks would otherwise slow the ones still working and the
  // figures would measure the spinning. An explicit setting by the user wins.
  ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", 0);
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  fs::path dir = "/work/tmp/ckpt-bench";
  std::uint64_t mib_per_rank = 256;
  int tensor_count = 8;
  fs::path reference_file;
  fs::path json_file;
  int repeats = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--json")
      json_file = argv[i + 1];
    else if (flag == "--repeats")
      repeats = std::max(1, std::stoi(argv[i + 1]));
    else if (flag == "--dir")
      dir = argv[i + 1];
    else if (flag == "--mib-per-rank")
      mib_per_rank = std::stoull(argv[i + 1]);
    else if (flag == "--tensors")
      tensor_count = std::stoi(argv[i + 1]);
    else if (flag == "--reference")
      reference_file = argv[i + 1];
  }
  MpiCommunicator comm(MPI_COMM_WORLD);
  const int rank = comm.rank();
  const int world = comm.size();
  // Rank 0 names the run directory; everyone uses its name.
  const fs::path root = comm.allgather(rank == 0 ? (dir / fmt::format("run-{}", ::getpid())).string() : "").at(0);
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
    views.push_back(TensorView::sharded(fmt::format("model/t{}", t), DType::float32, {rows * world, columns},
                                        {rows * rank, 0}, {rows, columns}, data[t].data()));
  }
  const double total_bytes = static_cast<double>(rows * columns * 4 * tensor_count * world);
  auto report = [&](const char* what, double secs) {
    double slowest = 0;
    MPI_Allreduce(&secs, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0) fmt::print("{:<36} {:8.3f} s {:8.2f} GB/s\n", what, slowest, total_bytes / slowest / 1e9);
    return total_bytes / slowest;
  };

  const double shard_bytes = static_cast<double>(rows * columns * 4 * tensor_count);
  auto max_over_ranks = [&](double value) {
    double worst = 0;
    MPI_Allreduce(&value, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return worst;
  };
  const bool peak_ok = reset_peak_rss();

  // The shared disk's speed drifts (other jobs): each save is paired with a dd run right before
  // it, and the summary uses the median of the per-pair ratios.
  auto start = Clock::now();
  auto run_dd = [&](const char* label) {
    comm.barrier();
    start = Clock::now();
    (void)dd_write(root / fmt::format("dd-{}", rank), mib_per_rank);
    return report(label, seconds_since(start));
  };
  auto run_shared_dd = [&](const char* label) {
    const fs::path file = root / "dd-shared";
    comm.barrier();
    start = Clock::now();
    (void)dd_write(file, mib_per_rank, rank * mib_per_rank, /*remove=*/false);
    // removed inside the timing, like the per-rank dd files (unlink costs here: ext4 discards)
    comm.barrier();
    std::error_code ec;
    if (rank == 0) fs::remove(file, ec);
    return report(label, seconds_since(start));
  };
  auto median = [](std::vector<double> values) {
    std::sort(values.begin(), values.end());
    return values.empty() ? 0.0 : values[values.size() / 2];
  };

  std::uint64_t step = 0;
  SaveOptions options;
  options.keep_last = 1;
  options.alignment = 1 << 20;  // stripe-sized alignment, as on a parallel FS
  std::vector<double> save_ratios, dd_rates, save_times;
  double save_extra = 0;
  // An untimed first save: the kernel's first access to fresh user memory costs a hypervisor fault
  // per page on paravirtualised VMs (this machine: ~4 us per 4 KiB page). A training job pays it at
  // its first checkpoint only; the figures are of the saves after it, for both layouts alike (the
  // shared-file saves below would otherwise get warm memory from the file-per-rank ones).
  save_checkpoint(root, ++step, views, {}, comm, options);
  for (int repeat = 0; repeat < repeats; ++repeat) {
    const double dd_rate = run_dd("dd conv=fdatasync (all ranks)");
    comm.barrier();
    reset_peak_rss();
    const std::uint64_t baseline = status_kib("VmRSS");
    start = Clock::now();
    save_checkpoint(root, ++step, views, {}, comm, options);
    const double secs = seconds_since(start);
    save_extra = std::max(save_extra, max_over_ranks(peak_extra_bytes(baseline)));
    const double rate = report("save file-per-rank", secs);
    dd_rates.push_back(dd_rate);
    save_ratios.push_back(rate / dd_rate);
    save_times.push_back(total_bytes / rate);
  }
  const double dd_total = median(dd_rates);
  const double save_secs = median(save_times);

  SaveOptions shared = options;
  shared.layout = Layout::shared_file;
  // Paired like the file-per-rank saves, against both raw references: dd into one file per rank
  // (as above) and dd into disjoint regions of one shared file.
  std::vector<double> shared_ratios, shared_file_ratios;
  double shared_extra = 0;
  std::uint64_t baseline = 0;
  std::vector<double> shared_times;
  for (int repeat = 0; repeat < repeats; ++repeat) {
    const double dd_rate = run_dd("dd conv=fdatasync (all ranks)");
    const double shared_dd_rate = run_shared_dd("dd into one shared file");
    comm.barrier();
    reset_peak_rss();
    baseline = status_kib("VmRSS");
    start = Clock::now();
    save_checkpoint(root, ++step, views, {}, comm, shared);
    const double shared_secs = seconds_since(start);
    shared_extra = std::max(shared_extra, max_over_ranks(peak_extra_bytes(baseline)));
    const double shared_rate = report("save shared-file (MPI-IO)", shared_secs);
    shared_ratios.push_back(shared_rate / dd_rate);
    shared_times.push_back(total_bytes / shared_rate);
    shared_file_ratios.push_back(shared_rate / shared_dd_rate);
  }

  std::vector<TensorTarget> targets;
  for (int t = 0; t < tensor_count; ++t) {
    targets.push_back(TensorTarget::box(fmt::format("model/t{}", t), DType::float32, {rows * rank, 0}, {rows, columns},
                                        data[t].data()));
  }
  double load_rate[2] = {0, 0};
  std::vector<double> load_times[2];
  for (int repeat = 0; repeat < repeats; ++repeat) {
    for (bool verify : {true, false}) {
      comm.barrier();
      start = Clock::now();
      const auto restored = restore_latest(root, targets, comm, [&] {
        RestoreOptions o;
        o.verify = verify;
        o.max_attempts = 1;
        return o;
      }());
      if (!restored && rank == 0) fmt::print("load FAILED: the newest step did not restore\n");
      load_rate[verify ? 0 : 1] = report(verify ? "load (verify hashes)" : "load (no verify)", seconds_since(start));
      load_times[verify ? 0 : 1].push_back(total_bytes / load_rate[verify ? 0 : 1]);
    }
  }
  // Resharded load onto one rank fewer (4 -> 3): the first world-1 ranks restore every tensor
  // split by rows into world-1 parts, through a communicator of their own.
  std::vector<double> reshard_times;
  if (world > 1) {
    MPI_Comm fewer = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, rank < world - 1 ? 0 : MPI_UNDEFINED, rank, &fewer);
    for (int repeat = 0; repeat < repeats; ++repeat) {
      double secs = 0;
      if (fewer != MPI_COMM_NULL) {
        MpiCommunicator sub(fewer);
        const std::uint64_t all_rows = rows * world;
        const std::uint64_t begin = all_rows * rank / (world - 1);
        const std::uint64_t end = all_rows * (rank + 1) / (world - 1);
        std::vector<std::vector<float>> buffers(tensor_count, std::vector<float>((end - begin) * columns));
        std::vector<TensorTarget> resharded;
        for (int t = 0; t < tensor_count; ++t) {
          resharded.push_back(TensorTarget::box(fmt::format("model/t{}", t), DType::float32, {begin, 0},
                                                {end - begin, columns}, buffers[t].data()));
        }
        sub.barrier();
        start = Clock::now();
        const auto restored = restore_latest(root, resharded, sub, [] {
          RestoreOptions o;
          o.max_attempts = 1;
          return o;
        }());
        secs = seconds_since(start);
        if (!restored && rank == 0) fmt::print("resharded load FAILED\n");
      }
      const double rate = report(fmt::format("load resharded {} -> {} (verify)", world, world - 1).c_str(), secs);
      reshard_times.push_back(total_bytes / rate);
    }
    if (fewer != MPI_COMM_NULL) MPI_Comm_free(&fewer);
  }

  // After each async save() returns, training overwrites the whole state (an optimizer step
  // touching every parameter) while the writer runs: what that costs is part of the picture,
  // against the same overwrite with no save in flight.
  auto overwrite_state = [&](float value) {
    const auto begin = Clock::now();
    for (auto& tensor : data) std::fill(tensor.begin(), tensor.end(), value);
    return seconds_since(begin);
  };
  struct AsyncFigures {
    double blocked = 0, total = 0, overwrite = 0, idle_overwrite = 0;
    std::vector<double> blocked_runs, total_runs;
    double snapshot_bytes = 0;  // max over ranks and saves of SaveResult::snapshot_bytes
  };
  // One warm-up save (first touch of staging memory is slow here), then three timed saves (the
  // disk's speed drifts): medians of the slowest rank's figures.
  auto run_async = [&](const SaveOptions& async_options, const char* label) {
    AsyncSaver saver(root, comm, async_options);
    saver.save(++step, views, {});
    saver.wait();
    std::vector<double> blocked_runs, total_runs, write_runs, idle_runs;
    double snapshot_bytes = 0;
    for (int repeat = 0; repeat < repeats; ++repeat) {
      comm.barrier();
      idle_runs.push_back(max_over_ranks(overwrite_state(static_cast<float>(repeat))));
      comm.barrier();
      start = Clock::now();
      saver.save(++step, views, {});
      const double blocked_local = seconds_since(start);
      const double write_local = overwrite_state(static_cast<float>(rank + repeat));
      const auto result = saver.wait();
      const double total_local = seconds_since(start);
      if (result) snapshot_bytes = std::max(snapshot_bytes, static_cast<double>(result->snapshot_bytes));
      blocked_runs.push_back(max_over_ranks(blocked_local));
      total_runs.push_back(max_over_ranks(total_local));
      write_runs.push_back(max_over_ranks(write_local));
      report(fmt::format("{}: training blocked", label).c_str(), blocked_local);
      report(fmt::format("{}: until durable", label).c_str(), total_local);
      report("  state overwrite while it writes", write_local);
    }
    return AsyncFigures{median(blocked_runs),
                        median(total_runs),
                        median(write_runs),
                        median(idle_runs),
                        blocked_runs,
                        total_runs,
                        max_over_ranks(snapshot_bytes)};
  };
  comm.barrier();
  reset_peak_rss();
  baseline = status_kib("VmRSS");  // before the saver allocates its staging arena
  const AsyncFigures copied = run_async(options, "async save");
  const double async_extra = max_over_ranks(peak_extra_bytes(baseline));
  // Copy-on-write snapshot: training blocks for fork() only; the price moves to training's first
  // write of each page while the child writes (the kernel copies the page).
  SaveOptions forked = options;
  forked.async_snapshot = AsyncSnapshot::fork;
  const AsyncFigures forks = run_async(forked, "async save (fork)");
  const double blocked = copied.blocked;
  const double async_total = copied.total;
  const double copy_write = copied.overwrite;
  const double fork_blocked = forks.blocked;
  const double fork_total = forks.total;
  const double cow_write = forks.overwrite;
  const double plain_write = std::min(copied.idle_overwrite, forks.idle_overwrite);
  // Floor for the async blocking time: one memcpy of this rank's shard into warm memory of the
  // same size (as the staging buffers are), median of three.
  double copy_secs = 0;
  std::vector<double> memcpy_runs;
  {
    std::vector<std::vector<float>> scratch(tensor_count, std::vector<float>(rows * columns, 0.0F));
    std::vector<double> copies;
    for (int repeat = 0; repeat < std::max(3, repeats); ++repeat) {
      comm.barrier();
      start = Clock::now();
      for (int t = 0; t < tensor_count; ++t) {
        std::memcpy(scratch[t].data(), data[t].data(), rows * columns * sizeof(float));
      }
      copies.push_back(max_over_ranks(seconds_since(start)));
      report("memcpy of the shard (blocking floor)", copies.back());
    }
    copy_secs = median(copies);
    memcpy_runs = copies;
  }
  if (rank == 0) {
    const double mib = 1024.0 * 1024.0;
    fmt::print(
        "\n-- summary (world {}, {} MiB/rank, shard {:.0f} MiB/rank; dd median {:.2f} GB/s, "
        "sync save median {:.3f} s) --\n",
        world, mib_per_rank, shard_bytes / mib, dd_total / 1e9, save_secs);
    auto line = [](std::string_view what, double value, std::string_view goal, bool met) {
      fmt::print("{:<44} {:>8.2f}   goal {:<10} {}\n", what, value, goal, met ? "met" : "NOT met");
    };
    const double fpr = median(save_ratios);
    const double sf = median(shared_ratios);
    line("save/dd bandwidth, file-per-rank (x, median)", fpr, ">= 0.90", fpr >= 0.9);
    line("save/dd bandwidth, shared-file (x, median)", sf, ">= 0.90", sf >= 0.9);
    const double sfs = median(shared_file_ratios);
    line("save/shared-file dd, shared-file (x, median)", sfs, ">= 0.90", sfs >= 0.9);
    fmt::print("{:<44} {:>8.2f}   (reference)\n", "load/dd bandwidth, verified (x)", load_rate[0] / dd_total);
    fmt::print("{:<44} {:>8.2f}   (reference)\n", "load/dd bandwidth, no verify (x)", load_rate[1] / dd_total);
    line("async blocked / sync save time", blocked / save_secs, "<= 0.10", blocked / save_secs <= 0.1);
    fmt::print("{:<44} {:>8.2f}   (async until durable / sync save)\n", "async total / sync save time",
               async_total / save_secs);
    fmt::print("{:<44} {:>8.2f}   (snapshot time / plain memcpy of the shard)\n", "async blocked / memcpy floor",
               blocked / copy_secs);
    line("async (fork) blocked / sync save time", fork_blocked / save_secs, "<= 0.10", fork_blocked / save_secs <= 0.1);
    fmt::print("{:<44} {:>8.2f}   (async until durable / sync save)\n", "async (fork) total / sync save time",
               fork_total / save_secs);
    fmt::print("{:<44} {:>8.2f}   ({:.3f} vs {:.3f} s idle)\n", "async (copy) state overwrite, during / idle",
               copy_write / plain_write, copy_write, plain_write);
    fmt::print("{:<44} {:>8.2f}   ({:.3f} vs {:.3f} s idle: copy-on-write faults)\n",
               "async (fork) state overwrite, during / idle", cow_write / plain_write, cow_write, plain_write);
    fmt::print("{:<44} {:>8.3f}   (blocked + overwrite during the save, s)\n", "training cost, copy snapshot",
               blocked + copy_write);
    fmt::print("{:<44} {:>8.3f}   (blocked + overwrite during the save, s)\n", "training cost, fork snapshot",
               fork_blocked + cow_write);
    if (const auto references = read_references(reference_file); !references.empty()) {
      const double save_rate = total_bytes / save_secs;
      for (const auto& [name, rate] : references) {
        const bool is_load = name.find("load") != std::string::npos;
        const double ours = is_load ? load_rate[0] : save_rate;
        fmt::print("{:<44} {:>8.2f}   ({:.2f} vs {:.2f} GB/s; ours: {})\n",
                   fmt::format("{} / {}", is_load ? "load" : "save", name), ours / rate, ours / 1e9, rate / 1e9,
                   is_load ? "verified load" : "file-per-rank save, median");
      }
    }
    if (peak_ok) {
      line("peak extra RSS / shard, sync file-per-rank", save_extra / shard_bytes, "<= 1.10",
           save_extra / shard_bytes <= 1.1);
      line("peak extra RSS / shard, sync shared-file", shared_extra / shard_bytes, "<= 1.10",
           shared_extra / shard_bytes <= 1.1);
      line("peak extra RSS / shard, async (w/ staging)", async_extra / shard_bytes, "<= 1.10",
           async_extra / shard_bytes <= 1.1);
      const double fork_extra = forks.snapshot_bytes / shard_bytes;
      line("peak extra memory / shard, async (fork)", fork_extra, "<= 1.10", fork_extra <= 1.1);
      fmt::print("{:<44} {:>8.1f} / {:.1f} / {:.1f} MiB (max over ranks)\n", "peak extra RSS sync / shared / async",
                 save_extra / mib, shared_extra / mib, async_extra / mib);
    } else {
      fmt::print("peak extra RSS: not measured (/proc/self/clear_refs not writable)\n");
      fmt::print("{:<44} {:>8.2f}   (the writer process's peak private memory)\n",
                 "peak extra memory / shard, async (fork)", forks.snapshot_bytes / shard_bytes);
    }
    if (!json_file.empty()) {
      // Raw figures of this run: times in seconds (the slowest rank's), sizes in bytes.
      const nlohmann::json out = {
          {"world", world},
          {"mib_per_rank", mib_per_rank},
          {"tensors", tensor_count},
          {"total_bytes", total_bytes},
          {"shard_bytes", shard_bytes},
          {"save_file_per_rank_s", save_times},
          {"save_shared_file_s", shared_times},
          {"dd_paired_Bps", dd_rates},
          {"load_verified_s", load_times[0]},
          {"load_no_verify_s", load_times[1]},
          {"load_resharded_s", reshard_times},
          {"async_copy_blocked_s", copied.blocked_runs},
          {"async_copy_durable_s", copied.total_runs},
          {"async_fork_blocked_s", forks.blocked_runs},
          {"async_fork_durable_s", forks.total_runs},
          {"memcpy_shard_s", memcpy_runs},
          {"peak_extra_sync_bytes", peak_ok ? nlohmann::json(save_extra) : nlohmann::json()},
          {"peak_extra_shared_bytes", peak_ok ? nlohmann::json(shared_extra) : nlohmann::json()},
          {"peak_extra_async_bytes", peak_ok ? nlohmann::json(async_extra) : nlohmann::json()},
          {"fork_snapshot_bytes", forks.snapshot_bytes},
      };
      std::ofstream(json_file) << out.dump(2) << "\n";
    }
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  MPI_Finalize();
  return 0;
}
