// train: the reference elastic trainer — a libtorch data-parallel trainer written for the
// elastrun worker contract whose result does not depend on failures or world sizes.
//
//   elastrun --nnodes=2:4 --nproc-per-node=2 --no-python build/bin/train --steps 200 --ckpt-dir ckpt/
//   build/bin/train --steps 50 --ckpt-dir ckpt/          # no agent, no Slurm: one process (world 1)
//
// What it shows (docs/trainer.md has the contract in full):
//  - the process group comes from the agent's environment alone (RANK, WORLD_SIZE,
//    MASTER_ADDR/PORT: a c10d TCPStore hosted by rank 0 and a Gloo process group over it);
//  - exactly-once data: a constant global batch B (--global-batch) whatever the world size;
//    step s consumes the global sample indices [s*B, (s+1)*B), rank r of W takes a contiguous
//    share of them (shares differ by at most one), and sample i is generated from (--seed, i)
//    alone by a counter-based hash. The loss and its gradients are sums over the rank's samples
//    divided by B, all-reduced with SUM, so every world size computes the same update (only
//    the float summation order differs);
//  - an optimizer with state (SGD with momentum, or Adam), checkpointed with the model, with
//    the step and the next sample index, every --ckpt-every steps by elastrun::ckpt::AsyncSaver
//    (training does not wait for the write); it resumes from the newest valid checkpoint
//    whatever the world size was;
//  - it polls the agent's control channel every step (elastrun/control.hpp): on
//    "checkpoint-and-stop" (Slurm's time-limit warning, preemption) every rank saves and exits
//    with the "checkpointed" code 85, and the agent requeues the job. SIGTERM without such a
//    request stops every rank after the current step with exit 143 (bounded by --term-grace);
//  - with --memory-every N under `elastrun --memory-checkpoints`, every N steps a snapshot of the
//    same state goes into the node agent's memory (elastrun/worker/memory.hpp): it outlives the
//    worker, so after a crash (or a node loss, where every surviving node holds the step) the ranks
//    resume from it -- at most N steps lost -- when it is newer than the newest file checkpoint;
//  - with $ELASTRUN_EVENTS_FILE it appends checkpoint_saved (tier file or memory) / resumed (source
//    file, memory-local or memory-partner) / step / train_done events.
// Log lines are "[rank N] ...". Exit codes: 0 done, 85 checkpointed and stopped, 143 SIGTERM,
// 1 error (and --fail-at-step), 2 bad flags.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <system_error>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "elastrun/ckpt/async_saver.hpp"
#include "elastrun/ckpt/c10d_store_comm.hpp"
#include "elastrun/ckpt/checkpoint.hpp"
#include "elastrun/ckpt/testing.hpp"
#include "elastrun/ckpt/torch_adapter.hpp"
#include "elastrun/control.hpp"
#include "elastrun/worker/events.hpp"
#include "elastrun/worker/memory.hpp"

namespace {

namespace control = elastrun::control;
using Clock = std::chrono::steady_clock;

constexpr int kFeatures = 16;
constexpr int kSigtermExitCode = 128 + SIGTERM;  // 143
// Under an agent, SIGTERM usually comes from Slurm (preemption, scancel, end of the time limit),
// which signals the agent and its workers together: the agent then asks for checkpoint-and-stop
// through the control file. Wait this long for that request before treating SIGTERM as "stop now".
constexpr auto kTermRequestWait = std::chrono::milliseconds(1000);

struct Args {
  std::uint64_t steps = 100;
  std::uint64_t ckpt_every = 10;
  std::uint64_t memory_every = 0;  // 0: no memory snapshots
  std::string ckpt_dir;
  int step_ms = 0;  // extra time per step, to make a short run last (demos, tests)
  int hidden = 32;
  std::optional<double> lr;  // default: 0.05 (sgd), 0.005 (adam)
  std::uint64_t global_batch = 256;
  std::uint64_t seed = 1;
  std::string optimizer = "sgd";
  double momentum = 0.9;
  std::string fail_at;  // "N[:RANK]"
  std::uint64_t fail_step = 0;
  int fail_rank = 0;
  int threads = 1;
  int keep_last = 3;
  bool allow_fresh_start = false;  // every checkpoint damaged: start at step 0 instead of failing
  double term_grace = 3.0;
};

std::string env_or(const char* name, std::string fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) throw std::runtime_error(fmt::format("{} is not set: run this under elastrun (or torchrun)", name));
  return std::stoi(v);
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// "[rank N] " unless the elastrun agent runs us (it prefixes every worker line itself).
std::string line_prefix() {
  if (std::getenv("ELASTRUN_GENERATION")) return "";
  return "[rank " + env_or("RANK", "0") + "] ";
}

// ---- SIGTERM: stop after the current step, bounded --------------------------------------------

volatile sig_atomic_t g_sigterm = 0;
void on_sigterm(int) { g_sigterm = 1; }
// Set while every rank saves for checkpoint-and-stop: the watchdog then leaves the process alone
// (the agent bounds that phase with --checkpoint-timeout).
std::atomic<bool> g_stop_saving{false};

// ---- data: sample i is a function of (seed, i) alone ------------------------------------------

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// A uniform double in (0, 1) for counter `k` of stream `key`.
double uniform01(std::uint64_t key, std::uint64_t k) {
  return (static_cast<double>(splitmix64(key + splitmix64(k)) >> 11) + 0.5) * 0x1p-53;
}

// Stream keys: one per (seed, purpose, index), never per rank.
std::uint64_t stream_key(std::uint64_t seed, std::uint64_t purpose, std::uint64_t index) {
  return splitmix64(splitmix64(splitmix64(seed) ^ purpose) + index);
}
constexpr std::uint64_t kSampleStream = 0x73616d706c65ULL;  // "sample"
constexpr std::uint64_t kInitStream = 0x696e6974ULL;        // "init"

// The regression task: y = x . w_true + 0.01 noise, x ~ N(0, I_16), w_true = linspace(-1, 1, 16).
// Samples [first, first + count) as float32 tensors x [count, 16], y [count, 1].
std::pair<torch::Tensor, torch::Tensor> make_samples(std::uint64_t seed, std::uint64_t first, std::int64_t count) {
  auto x = torch::empty({count, kFeatures}, torch::kFloat32);
  auto y = torch::empty({count, 1}, torch::kFloat32);
  float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (std::int64_t n = 0; n < count; ++n) {
    const std::uint64_t key = stream_key(seed, kSampleStream, first + static_cast<std::uint64_t>(n));
    double normals[kFeatures + 2];
    for (int j = 0; j < kFeatures + 2; j += 2) {  // Box-Muller: 2 uniforms -> 2 normals
      const double r = std::sqrt(-2.0 * std::log(uniform01(key, j)));
      const double phi = 2.0 * M_PI * uniform01(key, j + 1);
      normals[j] = r * std::cos(phi);
      normals[j + 1] = r * std::sin(phi);
    }
    double target = 0.01 * normals[kFeatures];
    for (int j = 0; j < kFeatures; ++j) {
      xp[n * kFeatures + j] = static_cast<float>(normals[j]);
      target += static_cast<double>(static_cast<float>(normals[j])) * (-1.0 + 2.0 * j / (kFeatures - 1));
    }
    yp[n] = static_cast<float>(target);
  }
  return {x, y};
}

// Rank r's share of B samples over W ranks: B/W each, one more for the first B%W ranks.
std::pair<std::uint64_t, std::uint64_t> share_of(std::uint64_t batch, int world, int rank) {
  const auto w = static_cast<std::uint64_t>(world), r = static_cast<std::uint64_t>(rank);
  const std::uint64_t base = batch / w, extra = batch % w;
  return {r * base + std::min(r, extra), base + (r < extra ? 1 : 0)};
}

// $ELASTRUN_NODE (set by the agent), else the host name.
std::string node_name() {
  std::string node = env_or("ELASTRUN_NODE", "");
  if (node.empty()) {
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) == 0) node = host;
  }
  return node;
}

// ---- the event log ($ELASTRUN_EVENTS_FILE) -----------------------------------------------------

// The worker contract's writer (elastrun/worker/events.hpp, schema v1): lines appended with
// O_APPEND, each with one write(2), so lines of several processes (the agent, every worker) never
// interleave. The node and run id come from the agent's environment.
class EventLog {
 public:
  // Called once the rank is known, before any thread writes.
  void open(const std::string& node, int rank) {
    const char* path = std::getenv("ELASTRUN_EVENTS_FILE");
    if (path == nullptr || *path == '\0') return;
    const char* run_id = std::getenv("TORCHELASTIC_RUN_ID");
    try {
      writer_ = elastrun::worker::EventWriter(path, node, run_id ? run_id : "", rank);
    } catch (const std::system_error& e) {
      fmt::print(stderr, "warning: cannot open ELASTRUN_EVENTS_FILE: {}\n", e.what());
    }
  }
  bool enabled() const { return writer_.enabled(); }
  void write(std::string_view event, int /*rank: the writer's*/, const nlohmann::ordered_json& fields) {
    if (!writer_.write(event, fields) && !warned_.exchange(true))
      fmt::print(stderr, "warning: writing ELASTRUN_EVENTS_FILE failed: {}\n", std::strerror(errno));
  }

 private:
  elastrun::worker::EventWriter writer_;
  std::atomic<bool> warned_{false};
};

// ---- the trainer ---------------------------------------------------------------------------------

class Trainer {
 public:
  explicit Trainer(Args args) : args_(std::move(args)) {
    const bool have_rank = std::getenv("RANK") && *std::getenv("RANK");
    const bool have_world = std::getenv("WORLD_SIZE") && *std::getenv("WORLD_SIZE");
    if (have_rank != have_world)
      throw std::runtime_error("RANK and WORLD_SIZE must be set together (or neither: one process, world 1)");
    if (have_rank) {
      rank_ = env_int("RANK");
      world_ = env_int("WORLD_SIZE");
      if (world_ < 1 || rank_ < 0 || rank_ >= world_)
        throw std::runtime_error(fmt::format("RANK {} / WORLD_SIZE {} is not a valid rank", rank_, world_));
    }
    events_.open(node_, rank_);
    if (world_ > 1) {
      const auto master = env_or("MASTER_ADDR", "127.0.0.1");
      const auto port = static_cast<std::uint16_t>(env_int("MASTER_PORT"));
      // Every attempt (restart or re-formed group) gets fresh keys in the store.
      const auto attempt = env_or("TORCHELASTIC_RESTART_COUNT", "0") + "." + env_or("ELASTRUN_GENERATION", "0");
      c10d::TCPStoreOptions so;
      so.port = port;
      so.isServer = rank_ == 0;
      so.numWorkers = static_cast<std::size_t>(world_);
      so.timeout = std::chrono::minutes(5);
      store_ = c10::make_intrusive<c10d::TCPStore>(master, so);
      auto pg_store = c10::make_intrusive<c10d::PrefixStore>("pg/" + attempt, store_);
      auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::minutes(5));
      const auto iface = env_or("GLOO_SOCKET_IFNAME", "");
      options->devices.push_back(iface.empty() ? c10d::ProcessGroupGloo::createDefaultDevice()
                                               : c10d::ProcessGroupGloo::createDeviceForInterface(iface));
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(pg_store, rank_, world_, options);
      comm_ = std::make_unique<elastrun::ckpt::C10dStoreCommunicator>(*store_, rank_, world_, "ckpt/" + attempt);
    } else {
      comm_ = std::make_unique<elastrun::ckpt::SingleProcessCommunicator>();
    }

    model_ = torch::nn::Sequential(torch::nn::Linear(kFeatures, args_.hidden), torch::nn::ReLU(),
                                   torch::nn::Linear(args_.hidden, 1));
    init_model();
    std::int64_t total = 0;
    for (const auto& p : model_->named_parameters()) {
      names_.push_back(p.key());
      params_.push_back(p.value());
      total += p.value().numel();
      const auto zeros = [&] { return torch::zeros_like(p.value()); };
      if (args_.optimizer == "sgd") {
        state_.push_back({{"momentum", zeros()}});
      } else {
        state_.push_back({{"exp_avg", zeros()}, {"exp_avg_sq", zeros()}});
      }
    }
    // One buffer for the all-reduce: every gradient, then the loss and the control flags.
    flat_ = torch::zeros({total + kFlags}, torch::kFloat32);
    std::int64_t offset = 0;
    for (const auto& p : params_) {
      grads_.push_back(flat_.narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
    tail_ = flat_.narrow(0, offset, kFlags);
    if (!args_.ckpt_dir.empty()) {
      elastrun::ckpt::SaveOptions options;
      options.keep_last = args_.keep_last;
      saver_ = std::make_unique<elastrun::ckpt::AsyncSaver>(args_.ckpt_dir, *comm_, options);
    }
    if (args_.memory_every > 0) {
      memory_.emplace();
      if (!memory_->enabled()) {
        if (rank_ == 0)
          log("--memory-every {}: the agent keeps no memory checkpoints (elastrun --memory-checkpoints)",
              args_.memory_every);
        memory_.reset();
      }
    }
  }

  int run() {
    std::uint64_t step = restore();
    double loss = resumed_loss_;
    while (step < args_.steps) {
      maybe_fail(step);
      loss = train_step(step);
      ++step;
      if (rank_ == 0 && (step % 10 == 0 || step == args_.steps))
        log("step {}/{} loss {:.5f} world {}", step, args_.steps, loss, world_);
      // the loss curve of a timeline (tools/elastrun-timeline): one small line per step
      if (rank_ == 0)
        events_.write("step", rank_,
                      {{"step", step},
                       {"loss", std::isnan(loss) ? nlohmann::json(nullptr) : nlohmann::json(loss)},
                       {"world_size", world_}});

      const bool periodic = args_.ckpt_every > 0 && step % args_.ckpt_every == 0;
      const bool last = step == args_.steps;
      if (agreed_.stop) {
        g_stop_saving = true;
        if (saver_) {
          save(step, loss, /*wait=*/true);
          log("checkpoint-and-stop: saved step {}; exiting {}", step, control::kCheckpointedExitCode);
        } else {
          log("checkpoint-and-stop at step {}: no --ckpt-dir, nothing saved; exiting {}", step,
              control::kCheckpointedExitCode);
        }
        return control::kCheckpointedExitCode;
      }
      if (agreed_.term) terminate(step);
      if (memory_ && step % args_.memory_every == 0 && !last) save_to_memory(step, loss);
      if (saver_ && (periodic || agreed_.checkpoint || last)) save(step, loss, /*wait=*/last);
    }
    if (saver_) finish_save();           // e.g. resumed at --steps: nothing new, but a save may be pending
    log("done: {} steps", args_.steps);  // every rank, as before: tests count the ranks that finished
    if (rank_ == 0) {
      log("final loss {}", std::isnan(loss) ? std::string("nan") : fmt::format("{:.9g}", loss));
      events_.write("train_done", rank_,
                    {{"step", step},
                     {"loss", std::isnan(loss) ? nlohmann::json(nullptr) : nlohmann::json(loss)},
                     {"world_size", world_}});
    }
    return 0;
  }

 private:
  static constexpr std::int64_t kFlags = 4;  // loss, #checkpoint requests, #stop requests, #SIGTERMs
  struct Agreed {
    bool checkpoint = false, stop = false, term = false;
  };

  // The elastrun agent already prefixes every worker line with "[rank N]".
  template <typename... T>
  void log(fmt::format_string<T...> f, T&&... a) {
    const auto line = fmt::format(f, std::forward<T>(a)...);
    std::lock_guard lock(log_mutex_);
    fmt::print("{}{}\n", prefix_, line);
    std::fflush(stdout);
  }

  // PyTorch's default Linear initialisation (uniform in ±1/sqrt(fan_in) for weight and bias),
  // drawn from (seed, parameter, element) so it needs no torch generator.
  void init_model() {
    torch::NoGradGuard no_grad;
    std::uint64_t index = 0;
    for (auto& p : model_->parameters()) {
      const auto fan_in = p.dim() == 2 ? p.size(1) : (index == 1 ? kFeatures : args_.hidden);
      const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
      const std::uint64_t key = stream_key(args_.seed, kInitStream, index++);
      auto values = p.contiguous();
      float* v = values.data_ptr<float>();
      for (std::int64_t e = 0; e < values.numel(); ++e)
        v[e] = static_cast<float>(bound * (2.0 * uniform01(key, static_cast<std::uint64_t>(e)) - 1.0));
      p.copy_(values);
    }
  }

  // --fail-at-step N[:RANK]: exit 1 at the start of step N (after N steps) on that rank, once per
  // job: the marker in the checkpoint directory survives restarts and requeues.
  void maybe_fail(std::uint64_t step) {
    if (args_.fail_at.empty() || step != args_.fail_step || rank_ != args_.fail_rank) return;
    std::filesystem::create_directories(args_.ckpt_dir);  // a failure before the first save
    const auto marker = std::filesystem::path(args_.ckpt_dir) /
                        fmt::format("train-fail-at-step-{}.rank-{}.done", args_.fail_step, args_.fail_rank);
    const int fd = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
      if (errno == EEXIST) return;  // failed once already in this job
      throw std::runtime_error(
          fmt::format("--fail-at-step: cannot create {}: {}", marker.string(), std::strerror(errno)));
    }
    ::fsync(fd);
    ::close(fd);
    const int dir = ::open(args_.ckpt_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir >= 0) {
      ::fsync(dir);
      ::close(dir);
    }
    log("--fail-at-step {}:{}: failing on purpose at step {} (exit 1; marker {})", args_.fail_step, args_.fail_rank,
        step, marker.string());
    std::fflush(stderr);
    std::_Exit(1);
  }

  // Tests only (the fault suite): with ELASTRUN_TRAIN_PARK_SAVE_AT_STEP=N the asynchronous save of
  // step N stops inside its commit on rank 0 (every shard written, the step not yet published)
  // and writes <ckpt-dir>/train-parked-save-N, so that a test can SIGKILL the workers exactly
  // while a checkpoint is being written, or cut the node off and then let the commit go on by
  // creating <ckpt-dir>/train-parked-save-N.release. Once per job, like --fail-at-step.
  void maybe_park_save(std::uint64_t step) {
    const char* at = std::getenv("ELASTRUN_TRAIN_PARK_SAVE_AT_STEP");
    if (!at || rank_ != 0 || std::to_string(step) != at) return;
    const auto parked = std::filesystem::path(args_.ckpt_dir) / fmt::format("train-parked-save-{}", step);
    if (std::filesystem::exists(parked)) return;  // parked once already in this job
    elastrun::ckpt::testing::set_fault_hook([parked](std::string_view point, int) {
      if (point != "commit.before_publish") return;
      std::ofstream(parked) << "parked\n";
      auto release = parked;
      release += ".release";
      while (!std::filesystem::exists(release)) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    });
    log("ELASTRUN_TRAIN_PARK_SAVE_AT_STEP={}: the save of step {} will stop inside its commit", step, step);
  }

  // Tests only (the fault suite): with ELASTRUN_TRAIN_PARK_MEMORY_AT=STEP@NODE local rank 0 on
  // node NODE stops inside its memory snapshot of STEP (written into the agent's segment, not yet
  // committed) and writes <ckpt-dir>/train-parked-memory-STEP, so that a test can cut the node off
  // while it is writing a memory checkpoint; <ckpt-dir>/train-parked-memory-STEP.release lets it
  // go on. Once per job.
  void maybe_park_memory_save(std::uint64_t step) {
    const std::string at = env_or("ELASTRUN_TRAIN_PARK_MEMORY_AT", "");
    if (at.empty() || at != fmt::format("{}@{}", step, node_) || args_.ckpt_dir.empty()) return;
    if (env_or("LOCAL_RANK", "0") != "0") return;
    const auto parked = std::filesystem::path(args_.ckpt_dir) / fmt::format("train-parked-memory-{}", step);
    if (std::filesystem::exists(parked)) return;  // parked once already in this job
    std::ofstream(parked) << "parked\n";
    log("ELASTRUN_TRAIN_PARK_MEMORY_AT={}: the memory snapshot of step {} stops before its commit", at, step);
    auto release = parked;
    release += ".release";
    while (!std::filesystem::exists(release)) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }

  // One step over the global samples [next_sample_, next_sample_ + B): this rank's share,
  // loss = sum of squared errors / B, gradients all-reduced with SUM together with the loss and
  // the control flags (one all-reduce per step; every rank takes the same decision).
  double train_step(std::uint64_t step) {
    const auto compute_start = Clock::now();  // this rank's compute: everything before the all-reduce
    const auto [offset, count] = share_of(args_.global_batch, world_, rank_);
    auto [x, y] = make_samples(args_.seed, next_sample_ + offset, static_cast<std::int64_t>(count));
    model_->zero_grad();
    auto loss = (model_->forward(x) - y).pow(2).sum() / static_cast<double>(args_.global_batch);
    loss.backward();
    {
      torch::NoGradGuard no_grad;
      for (std::size_t q = 0; q < params_.size(); ++q) {
        const auto& g = params_[q].grad();
        if (g.defined())
          grads_[q].copy_(g);
        else
          grads_[q].zero_();
      }
    }
    if (args_.step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(args_.step_ms));
    if (slow_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms_));
    const double compute_s = seconds_since(compute_start);

    const Agreed local = poll_control();
    auto tail = tail_.accessor<float, 1>();
    tail[0] = loss.item<float>();
    tail[1] = local.checkpoint ? 1.0f : 0.0f;
    tail[2] = local.stop ? 1.0f : 0.0f;
    tail[3] = local.term ? 1.0f : 0.0f;
    if (pg_) {
      std::vector<torch::Tensor> bufs{flat_};
      pg_->allreduce(bufs, c10d::AllreduceOptions{c10d::ReduceOp::SUM})->wait();
    }
    agreed_ = Agreed{tail[1] > 0.5f, tail[2] > 0.5f, tail[3] > 0.5f};
    const double global_loss = tail[0];
    optimizer_step(step + 1);
    next_sample_ += args_.global_batch;
    // elastrun --hang-timeout: this rank completed a step; --straggler-action: its compute time
    control::progress(static_cast<std::int64_t>(step + 1), compute_s);
    return global_loss;
  }

  // This rank's view of the requests: the control channel (and SIGUSR1/SIGUSR2, which
  // control::poll() merges in as checkpoint-and-stop), and SIGTERM.
  Agreed poll_control() {
    auto status = control::poll();
    Agreed a;
    a.term = g_sigterm != 0;
    if (a.term && !status.stop() && std::getenv(control::kControlFileEnv)) {
      const auto deadline = Clock::now() + kTermRequestWait;
      while (!status.stop() && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        status = control::poll();
      }
    }
    a.stop = status.stop();
    a.checkpoint = status.checkpoint() && status.sequence > seen_sequence_;
    if (status.sequence > seen_sequence_) seen_sequence_ = status.sequence;
    return a;
  }

  // update: the number of this update (1 for the first step).
  void optimizer_step(std::uint64_t update) {
    torch::NoGradGuard no_grad;
    const double lr = *args_.lr;
    const double t = static_cast<double>(update);
    for (std::size_t q = 0; q < params_.size(); ++q) {
      auto& p = params_[q];
      const auto& g = grads_[q];
      if (args_.optimizer == "sgd") {  // torch.optim.SGD(momentum=m, dampening=0, nesterov=False)
        auto& buf = state_[q][0].second;
        buf.mul_(args_.momentum).add_(g);
        p.add_(buf, -lr);
      } else {  // torch.optim.Adam(betas=(0.9, 0.999), eps=1e-8)
        constexpr double b1 = 0.9, b2 = 0.999, eps = 1e-8;
        auto& m = state_[q][0].second;
        auto& v = state_[q][1].second;
        m.mul_(b1).add_(g, 1 - b1);
        v.mul_(b2).addcmul_(g, g, 1 - b2);
        const double c1 = 1 - std::pow(b1, t), c2 = 1 - std::pow(b2, t);
        auto denom = (v.sqrt() / std::sqrt(c2)).add_(eps);
        p.addcdiv_(m, denom, -lr / c1);
      }
    }
  }

  nlohmann::json metadata(std::uint64_t step, double loss) const {
    return {{"step", step},
            {"next_sample", next_sample_},
            {"global_batch", args_.global_batch},
            {"seed", args_.seed},
            {"optimizer", args_.optimizer},
            {"lr", *args_.lr},
            {"momentum", args_.momentum},
            {"hidden", args_.hidden},
            {"loss", std::isnan(loss) ? nlohmann::json(nullptr) : nlohmann::json(loss)},
            {"world_size", world_}};
  }

  // Starts an asynchronous save of the model and the optimizer state (returns after the
  // snapshot); a helper thread waits for it to be durable, then logs it and writes the event.
  // The previous save must be done first (AsyncSaver runs one at a time): its error, if any, is
  // thrown here, on every rank at the same step. wait: also wait until this one is durable.
  void save(std::uint64_t step, double loss, bool wait) {
    const auto t0 = Clock::now();
    finish_save();
    maybe_park_save(step);
    elastrun::ckpt::torch_adapter::SaveViews views;
    for (std::size_t q = 0; q < params_.size(); ++q) {
      views.add_replicated("model/" + names_[q], params_[q]);
      for (const auto& [kind, tensor] : state_[q]) views.add_replicated("optim/" + names_[q] + "/" + kind, tensor);
    }
    saver_->save(step, views.views(), metadata(step, loss));
    const double blocked = seconds_since(t0);
    tracker_ = std::thread([this, step, t0, blocked] {
      try {
        const auto result = saver_->wait();
        const double durable = seconds_since(t0);
        if (rank_ == 0)
          log("checkpoint step {} -> {} (blocked {:.3f} s, durable after {:.3f} s)", step,
              result ? result->path.string() : std::string("?"), blocked, durable);
        if (result)
          for (const auto& w : result->warnings)
            if (rank_ == 0) log("checkpoint warning: {}", w);
        events_.write("checkpoint_saved", rank_,
                      {{"step", step},
                       {"tier", "file"},
                       {"bytes", result ? result->bytes_written : 0},
                       {"blocked_s", blocked},
                       {"durable_s", durable},
                       {"world_size", world_}});
      } catch (const std::exception& e) {
        log("checkpoint of step {} failed: {}", step, e.what());
        std::string what = e.what();
        if (what.size() > 1000) what.resize(1000);
        events_.write("checkpoint_failed", rank_, {{"step", step}, {"error", what}});
        tracker_error_ = std::current_exception();
      }
    });
    if (wait) finish_save();
  }

  // Waits for the save in flight (if any) to be durable; rethrows its error.
  void finish_save() {
    if (tracker_.joinable()) tracker_.join();
    if (tracker_error_) std::rethrow_exception(std::exchange(tracker_error_, nullptr));
  }

  // SIGTERM with no checkpoint-and-stop request: every rank stops after this step. The save in
  // flight, if any, gets part of the grace to become durable; nothing new is saved.
  [[noreturn]] void terminate(std::uint64_t step) {
    log("SIGTERM: stopping after step {} without a checkpoint; exiting {}", step, kSigtermExitCode);
    if (saver_) {
      const auto deadline = Clock::now() + std::chrono::duration<double>(args_.term_grace / 2);
      while (saver_->busy() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::fflush(stdout);
    std::fflush(stderr);
    // Not a normal return: the saver's and the process group's destructors may block on peers.
    std::_Exit(kSigtermExitCode);
  }

  // ---- the memory tier ---------------------------------------------------------------------
  // A snapshot: [8 bytes: header length][header JSON: the metadata and the tensors' names and
  // element counts][every tensor's float32 bytes, in the save order]. The state is replicated, so
  // any rank's snapshot of a step holds all of it.
  std::vector<torch::Tensor> state_tensors() const {
    std::vector<torch::Tensor> out;
    for (std::size_t q = 0; q < params_.size(); ++q) {
      out.push_back(params_[q]);
      for (const auto& [kind, tensor] : state_[q]) out.push_back(tensor);
    }
    return out;
  }

  static std::uint64_t fnv1a(const std::byte* data, std::size_t size) {
    std::uint64_t h = 0xcbf29ce484222325ULL;
    for (std::size_t i = 0; i < size; ++i) h = (h ^ static_cast<std::uint64_t>(data[i])) * 0x100000001b3ULL;
    return h;
  }

  // Never fatal: a snapshot that the agent refuses (its budget) leaves the file tier in charge.
  void save_to_memory(std::uint64_t step, double loss) {
    const auto t0 = Clock::now();
    const auto tensors = state_tensors();
    nlohmann::json header = metadata(step, loss);
    header["numel"] = nlohmann::json::array();
    std::size_t data_bytes = 0;
    for (const auto& t : tensors) {
      header["numel"].push_back(t.numel());
      data_bytes += static_cast<std::size_t>(t.numel()) * sizeof(float);
    }
    const std::string text = header.dump();
    const std::uint64_t header_size = text.size();
    const std::size_t total = sizeof header_size + text.size() + data_bytes;
    try {
      auto segment = memory_->allocate(step, rank_, total);
      std::byte* out = segment.data();
      std::memcpy(out, &header_size, sizeof header_size);
      std::memcpy(out + sizeof header_size, text.data(), text.size());
      std::size_t at = sizeof header_size + text.size();
      for (const auto& t : tensors) {
        const auto c = t.contiguous();
        const auto n = static_cast<std::size_t>(c.numel()) * sizeof(float);
        std::memcpy(out + at, c.data_ptr<float>(), n);
        at += n;
      }
      const auto checksum = fnv1a(out, total);
      maybe_park_memory_save(step);
      memory_->commit(std::move(segment), checksum, world_);
      if (rank_ == 0)
        events_.write("checkpoint_saved", rank_,
                      {{"step", step},
                       {"tier", "memory"},
                       {"bytes", total},
                       {"blocked_s", seconds_since(t0)},
                       {"durable_s", seconds_since(t0)},
                       {"world_size", world_}});
    } catch (const std::exception& e) {
      if (!memory_warned_) log("warning: memory snapshot of step {}: {}", step, e.what());
      memory_warned_ = true;
    }
  }

  // The newest snapshot this node's agent holds (of any rank: the state is replicated), or the one
  // of step `want`, checked (checksum, seed, layout): its step, metadata and a read-only mapping;
  // nullopt if none is usable.
  struct MemorySnapshot {
    std::uint64_t step = 0;
    nlohmann::json meta;
    elastrun::worker::MemorySegment segment;
    std::size_t data_offset = 0;
    std::string origin = "own";   // the agent's: own, fetched (from a peer), replica
    std::int64_t generation = 0;  // the rendezvous round that wrote it
  };
  std::optional<MemorySnapshot> memory_snapshot(std::optional<std::uint64_t> want = std::nullopt) {
    if (!memory_) return std::nullopt;
    try {
      const auto listing = memory_->list();
      // a replica (held for the partner node) counts only for a step asked for: the newest step
      // is the newest this node's ranks wrote or were given
      std::optional<std::pair<std::uint64_t, int>> best;
      std::string origin;
      std::int64_t generation = 0;
      for (const auto& s : listing.at("segments")) {
        const auto from = s.value("origin", std::string("own"));
        if (s.at("committed").get<bool>() && (!want || s.at("step").get<std::uint64_t>() == *want) &&
            (want || from != "replica") &&
            (!best || s.at("step").get<std::uint64_t>() > best->first ||
             (s.at("step").get<std::uint64_t>() == best->first && origin == "replica"))) {
          best = {s.at("step").get<std::uint64_t>(), s.at("rank").get<int>()};
          origin = from;
          generation = s.value("generation", std::int64_t{0});
        }
      }
      if (!best) return std::nullopt;
      auto segment = memory_->newest(best->second, best->first);
      if (!segment || segment->size() < sizeof(std::uint64_t)) return std::nullopt;
      if (fnv1a(segment->data(), segment->size()) != segment->checksum()) {
        // the next source: a peer agent's copy of it (the partner's)
        log("warning: the memory snapshot of step {} rank {} fails its checksum: asking a peer agent for its copy",
            best->first, best->second);
        segment = memory_->newest(best->second, best->first, /*refetch=*/true);
        if (!segment || fnv1a(segment->data(), segment->size()) != segment->checksum()) {
          log("warning: no good copy of the memory snapshot of step {}: not used", best->first);
          return std::nullopt;
        }
        origin = "fetched";
      }
      std::uint64_t header_size = 0;
      std::memcpy(&header_size, segment->data(), sizeof header_size);
      if (header_size > segment->size() - sizeof header_size) return std::nullopt;
      auto meta = nlohmann::json::parse(
          std::string(reinterpret_cast<const char*>(segment->data()) + sizeof header_size, header_size));
      std::size_t data_bytes = 0;
      const auto tensors = state_tensors();
      const auto& numel = meta.at("numel");
      if (numel.size() != tensors.size()) return std::nullopt;
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        if (numel[i].get<std::int64_t>() != tensors[i].numel()) return std::nullopt;
        data_bytes += static_cast<std::size_t>(tensors[i].numel()) * sizeof(float);
      }
      if (sizeof header_size + header_size + data_bytes != segment->size() ||
          meta.at("seed").get<std::uint64_t>() != args_.seed || meta.at("step").get<std::uint64_t>() != best->first)
        return std::nullopt;
      return MemorySnapshot{best->first, std::move(meta), std::move(*segment), sizeof header_size + header_size,
                            origin,      generation};
    } catch (const std::exception& e) {
      log("warning: reading the memory snapshot: {}", e.what());
      return std::nullopt;
    }
  }

  // Every rank takes the same decision: {MIN over ranks of the memory step (-1: none), MAX of the
  // newest file step (-1: none)}.
  std::pair<std::int64_t, std::int64_t> agree_on_steps(std::int64_t memory_step, std::int64_t file_step) {
    if (!pg_) return {memory_step, file_step};
    auto t = torch::tensor({memory_step, -file_step}, torch::kInt64);
    std::vector<torch::Tensor> bufs{t};
    pg_->allreduce(bufs, c10d::AllreduceOptions{c10d::ReduceOp::MIN})->wait();
    return {t[0].item<std::int64_t>(), -t[1].item<std::int64_t>()};
  }

  // Restores from the agent's memory when every rank holds the agreed step and it is not older
  // than the newest file checkpoint; returns the step, or nullopt (then the file tier decides).
  std::optional<std::uint64_t> restore_from_memory() {
    if (!memory_) return std::nullopt;
    auto snapshot = memory_snapshot();
    std::int64_t file_step = -1;
    if (!args_.ckpt_dir.empty())
      for (const auto& entry : elastrun::ckpt::list_steps(args_.ckpt_dir))
        file_step = std::max(file_step, static_cast<std::int64_t>(entry.step));
    const auto [memory_step, newest_file] =
        agree_on_steps(snapshot ? static_cast<std::int64_t>(snapshot->step) : -1, file_step);
    // every rank must hold that very step: a rank with a newer one fetches the agreed one instead
    if (memory_step < 0 || memory_step < newest_file) return std::nullopt;
    if (snapshot && static_cast<std::int64_t>(snapshot->step) != memory_step)
      snapshot = memory_snapshot(static_cast<std::uint64_t>(memory_step));
    std::int64_t have = snapshot ? 1 : 0;
    if (pg_) {
      auto t = torch::tensor({have}, torch::kInt64);
      std::vector<torch::Tensor> bufs{t};
      pg_->allreduce(bufs, c10d::AllreduceOptions{c10d::ReduceOp::MIN})->wait();
      have = t[0].item<std::int64_t>();
    }
    if (have == 0) {
      if (rank_ == 0) log("memory snapshot of step {} not on every rank: using the file tier", memory_step);
      return std::nullopt;
    }
    // one step written in two rendezvous rounds is two histories (a node that was cut off and came
    // back): never restored together
    if (pg_) {
      auto t = torch::tensor({snapshot->generation, -snapshot->generation}, torch::kInt64);
      std::vector<torch::Tensor> bufs{t};
      pg_->allreduce(bufs, c10d::AllreduceOptions{c10d::ReduceOp::MIN})->wait();
      if (t[0].item<std::int64_t>() != -t[1].item<std::int64_t>()) {
        if (rank_ == 0)
          log("the memory snapshots of step {} were written in different rendezvous rounds: using the file tier",
              memory_step);
        return std::nullopt;
      }
    }
    // where the pieces came from: any rank's from a peer agent makes the restore "memory-partner"
    std::int64_t from_partner = snapshot->origin == "own" ? 0 : 1;
    if (pg_) {
      auto t = torch::tensor({from_partner}, torch::kInt64);
      std::vector<torch::Tensor> bufs{t};
      pg_->allreduce(bufs, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
      from_partner = t[0].item<std::int64_t>();
    }
    log("restoring step {} from the agents' memory: rank {}'s snapshot, {}", snapshot->step, snapshot->segment.rank(),
        snapshot->origin == "own" ? "written on this node" : "copied from a peer agent");
    torch::NoGradGuard no_grad;
    std::size_t at = snapshot->data_offset;
    for (auto& t : state_tensors()) {
      const auto n = static_cast<std::size_t>(t.numel());
      auto source = torch::from_blob(snapshot->segment.data() + at, {t.numel()}, torch::kFloat32);
      t.copy_(source.view(t.sizes()));
      at += n * sizeof(float);
    }
    const auto& meta = snapshot->meta;
    const auto step = snapshot->step;
    next_sample_ = meta.at("next_sample").get<std::uint64_t>();
    if (meta.contains("loss") && meta.at("loss").is_number()) resumed_loss_ = meta.at("loss").get<double>();
    const int saved_world = meta.value("world_size", 0);
    if (rank_ == 0) {
      log("resumed from step {} in the agents' memory{} (saved by a world of {}, now {}; newest file checkpoint: {})",
          step, from_partner ? " (partner copies)" : "", saved_world, world_,
          newest_file < 0 ? std::string("none") : std::to_string(newest_file));
      write_resumed(step, from_partner ? "memory-partner" : "memory-local", saved_world);
    }
    return step;
  }

  // rank 0's "resumed" event; source: where the state came from (file, memory-local, memory-partner)
  void write_resumed(std::uint64_t step, std::string_view source, int saved_world) {
    events_.write("resumed", rank_,
                  {{"step", step},
                   {"source", source},
                   {"world_size", world_},
                   {"saved_world_size", saved_world},
                   {"next_sample", next_sample_}});
  }

  std::uint64_t restore() {
    if (auto step = restore_from_memory()) return *step;
    const auto step = restore_from_file();
    // Snapshots in the agents' memory newer than where training resumes belong to an abandoned
    // history: dropped before the first step (every rank's restore precedes the first step's
    // all-reduce, so no rank's new snapshot can be dropped by a slower rank's request).
    if (memory_) {
      try {
        if (const auto dropped = memory_->forget_after(step))
          log("dropped {} memory snapshot segment(s) of steps after {} (an abandoned history)", dropped, step);
      } catch (const std::exception& e) {
        log("warning: dropping memory snapshots after step {}: {}", step, e.what());
      }
    }
    return step;
  }

  std::uint64_t restore_from_file() {
    if (args_.ckpt_dir.empty()) return 0;
    elastrun::ckpt::torch_adapter::RestoreTargets targets;
    torch::NoGradGuard no_grad;
    for (std::size_t q = 0; q < params_.size(); ++q) {
      targets.add_whole("model/" + names_[q], params_[q]);
      for (auto& [kind, tensor] : state_[q]) targets.add_whole("optim/" + names_[q] + "/" + kind, tensor);
    }
    // A step whose metadata is not what this trainer writes is damaged: fall back to an older one.
    elastrun::ckpt::RestoreOptions options;
    options.check_metadata = [](const nlohmann::json& m) {
      (void)m.at("step").get<std::uint64_t>();
      if (m.contains("seed")) (void)m.at("seed").get<std::uint64_t>();
      if (m.contains("next_sample")) (void)m.at("next_sample").get<std::uint64_t>();
      if (m.contains("global_batch")) (void)m.at("global_batch").get<std::uint64_t>();
      if (m.contains("world_size")) (void)m.at("world_size").get<int>();
    };
    options.allow_fresh_start = args_.allow_fresh_start;
    auto restored = elastrun::ckpt::restore_latest(args_.ckpt_dir, targets.targets(), *comm_, options);
    if (!restored) {
      if (rank_ == 0) log("no checkpoint under {}: starting at step 0", args_.ckpt_dir);
      return 0;
    }
    targets.finish();
    for (const auto& why : restored->skipped)
      if (rank_ == 0) log("skipped a checkpoint: {}", why);
    const auto& meta = restored->metadata;
    const auto step = meta.at("step").get<std::uint64_t>();
    if (meta.contains("seed") && meta.at("seed").get<std::uint64_t>() != args_.seed)
      throw std::runtime_error(
          fmt::format("the checkpoint in {} was trained with --seed {}, not {}: pass --seed {} "
                      "or use another --ckpt-dir",
                      restored->path.string(), meta.at("seed").get<std::uint64_t>(), args_.seed,
                      meta.at("seed").get<std::uint64_t>()));
    next_sample_ = meta.value("next_sample", step * args_.global_batch);
    if (meta.contains("loss") && meta.at("loss").is_number()) resumed_loss_ = meta.at("loss").get<double>();
    if (rank_ == 0 && meta.value("global_batch", args_.global_batch) != args_.global_batch)
      log("warning: the checkpoint used --global-batch {}, this run {}: continuing at sample {}",
          meta.value("global_batch", std::uint64_t{0}), args_.global_batch, next_sample_);
    const int saved_world = meta.value("world_size", 0);
    if (rank_ == 0) {
      log("resumed from step {} (saved by a world of {}, now {})", step, saved_world, world_);
      write_resumed(step, "file", saved_world);
    }
    return step;
  }

  Args args_;
  int rank_ = 0, world_ = 1;
  std::string node_ = node_name();
  // Tests only (straggler detection): ELASTRUN_TRAIN_SLOW_NODE=NODE:MS makes every rank on NODE
  // compute MS longer each step (a slow node; the result does not change).
  int slow_ms_ = [this] {
    const std::string spec = env_or("ELASTRUN_TRAIN_SLOW_NODE", "");
    const auto colon = spec.rfind(':');
    if (colon == std::string::npos || spec.substr(0, colon) != node_) return 0;
    return std::max(0, std::atoi(spec.c_str() + colon + 1));
  }();
  c10::intrusive_ptr<c10d::TCPStore> store_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  std::unique_ptr<elastrun::ckpt::Communicator> comm_;
  torch::nn::Sequential model_{nullptr};
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> state_;  // optimizer state per parameter
  torch::Tensor flat_, tail_;
  std::vector<torch::Tensor> grads_;  // views into flat_
  std::uint64_t next_sample_ = 0;
  double resumed_loss_ = std::nan("");
  std::uint64_t seen_sequence_ = 0;
  Agreed agreed_;
  EventLog events_;
  std::mutex log_mutex_;
  const std::string prefix_ = line_prefix();
  std::unique_ptr<elastrun::ckpt::AsyncSaver> saver_;
  std::optional<elastrun::worker::MemoryTier> memory_;  // --memory-every under --memory-checkpoints
  bool memory_warned_ = false;
  std::thread tracker_;
  std::exception_ptr tracker_error_;
};

// After SIGTERM, if the main loop has not stopped within --term-grace (blocked in a collective
// with a dead peer, or in a save), exit 143 from here.
void start_sigterm_watchdog(double grace) {
  std::thread([grace, prefix = line_prefix()] {
    std::optional<Clock::time_point> since;
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (!g_sigterm) continue;
      if (!since) since = Clock::now();
      if (g_stop_saving || seconds_since(*since) < grace) continue;
      fmt::print(stderr, "{}SIGTERM: not stopped after {:.1f} s (blocked in a collective?); exiting {}\n", prefix,
                 grace, kSigtermExitCode);
      std::fflush(stdout);
      std::fflush(stderr);
      std::_Exit(kSigtermExitCode);
    }
  }).detach();
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  CLI::App app{"The reference elastic libtorch trainer for the elastrun worker contract (docs/trainer.md)"};
  app.add_option("--steps", args.steps, "train until this step")->check(CLI::PositiveNumber);
  app.add_option("--ckpt-dir", args.ckpt_dir,
                 "checkpoint directory (default: $ELASTRUN_CHECKPOINT_DIR; none: no checkpoints)");
  app.add_option("--ckpt-every", args.ckpt_every, "save every N steps (0: only at the end and when asked)");
  app.add_option("--memory-every", args.memory_every,
                 "also snapshot into the node agent's memory every N steps (elastrun --memory-checkpoints; 0: never)");
  app.add_option("--step-ms", args.step_ms, "sleep this long in each step")->check(CLI::NonNegativeNumber);
  app.add_option("--hidden", args.hidden, "hidden layer width")->check(CLI::PositiveNumber);
  app.add_option("--lr", args.lr, "learning rate (default 0.05 for sgd, 0.005 for adam)")->check(CLI::PositiveNumber);
  app.add_option("--global-batch", args.global_batch, "samples per step, split over the ranks whatever their number")
      ->check(CLI::PositiveNumber);
  app.add_option("--seed", args.seed, "seed of the data and of the initial model");
  app.add_option("--optimizer", args.optimizer, "sgd (with momentum) or adam")->check(CLI::IsMember({"sgd", "adam"}));
  app.add_option("--momentum", args.momentum, "SGD momentum")->check(CLI::Range(0.0, 1.0));
  app.add_option("--fail-at-step", args.fail_at,
                 "N[:RANK] (tests): exit 1 at the start of step N on RANK (default 0), once per job "
                 "(a marker in --ckpt-dir)");
  app.add_option("--threads", args.threads, "intra-op threads (0: libtorch's default)")->check(CLI::NonNegativeNumber);
  app.add_option("--keep-last", args.keep_last, "checkpoints to keep (0: all)")->check(CLI::NonNegativeNumber);
  app.add_flag("--allow-fresh-start", args.allow_fresh_start,
               "start at step 0 when every checkpoint is damaged (default: an error, never silently)");
  app.add_option("--term-grace", args.term_grace, "after SIGTERM, exit 143 within this many seconds")
      ->check(CLI::PositiveNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints --help (0) or the usage error
    return rc == 0 ? 0 : 2;
  }
  if (args.ckpt_dir.empty()) args.ckpt_dir = env_or(control::kCheckpointDirEnv, "");
  if (!args.lr) args.lr = args.optimizer == "adam" ? 0.005 : 0.05;
  if (!args.fail_at.empty()) {
    const auto colon = args.fail_at.find(':');
    try {
      std::size_t used = 0;
      const std::string n = args.fail_at.substr(0, colon);
      args.fail_step = std::stoull(n, &used);
      if (used != n.size()) throw std::invalid_argument(n);
      if (colon != std::string::npos) {
        const std::string r = args.fail_at.substr(colon + 1);
        args.fail_rank = std::stoi(r, &used);
        if (used != r.size() || args.fail_rank < 0) throw std::invalid_argument(r);
      }
    } catch (const std::exception&) {
      fmt::print(stderr, "--fail-at-step: '{}' is not N or N:RANK (non-negative integers)\n", args.fail_at);
      return 2;
    }
    if (args.ckpt_dir.empty()) {
      fmt::print(stderr, "--fail-at-step needs --ckpt-dir (its marker records that the failure happened)\n");
      return 2;
    }
  }
  if (args.threads > 0) {
    torch::set_num_threads(args.threads);
    try {
      at::set_num_interop_threads(args.threads);
    } catch (const std::exception&) {
    }
  }
  control::install_signal_handlers();  // SIGUSR1/SIGUSR2: checkpoint-and-stop requests
  struct sigaction sa {};
  sa.sa_handler = on_sigterm;  // SIGTERM: stop after this step (checkpoint only if asked)
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &sa, nullptr);
  start_sigterm_watchdog(args.term_grace);
  try {
    // Not destroyed on error (no stack unwinding through it): its destructors would wait for an
    // in-flight save, whose collective vote may never complete once a peer is gone.
    auto* trainer = new Trainer(args);
    const int rc = trainer->run();
    delete trainer;
    return rc;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}error: {}\n", line_prefix(), e.what());
    std::fflush(stderr);
    std::fflush(stdout);
    // Peers may be gone: do not wait in destructors (an in-flight save's collective vote).
    std::_Exit(1);
  }
}
