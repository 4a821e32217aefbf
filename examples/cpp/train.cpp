// train: a libtorch data-parallel trainer written for the elastrun worker contract.
//
//   elastrun --nnodes=2:4 --nproc-per-node=2 --no-python build/bin/train --steps 200 --ckpt-dir ckpt/
//
// What it shows:
//  - the process group comes from the agent's environment alone (RANK, WORLD_SIZE,
//    MASTER_ADDR/PORT: a c10d TCPStore hosted by rank 0 and a Gloo process group over it);
//  - gradients are averaged with all-reduce (plain data parallelism: the model is replicated);
//  - it resumes from the newest valid checkpoint under --ckpt-dir whatever the world size was
//    (elastrun's HDF5 checkpoints, elastrun::ckpt), so a re-formed, smaller or larger group
//    carries on where the last one stopped;
//  - it polls the agent's control channel every step (elastrun/control.hpp): on
//    "checkpoint-and-stop" (Slurm's time-limit warning, preemption) every rank saves and exits
//    with the "checkpointed" code 85, and the agent requeues the job.
// Log lines are "[rank N] ...". Exit codes: 0 done, 85 checkpointed and stopped, 1 error.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>

#include "elastrun/ckpt/c10d_store_comm.hpp"
#include "elastrun/ckpt/checkpoint.hpp"
#include "elastrun/ckpt/torch_adapter.hpp"
#include "elastrun/control.hpp"

namespace {

struct Args {
  std::uint64_t steps = 100;
  std::uint64_t ckpt_every = 10;
  std::string ckpt_dir;
  int step_ms = 0;  // extra time per step, to make a short run last (demos, tests)
  int hidden = 32;
  double lr = 0.05;
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

// The regression task: y = x . w_true + noise, with a fixed w_true; each rank draws its own
// samples, deterministically from (step, rank).
torch::Tensor true_weights() {
  return torch::linspace(-1.0, 1.0, 16).unsqueeze(1);
}

class Trainer {
 public:
  Trainer(Args args) : args_(std::move(args)) {
    rank_ = env_int("RANK");
    world_ = env_int("WORLD_SIZE");
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
    comm_.emplace(*store_, rank_, world_, "ckpt/" + attempt);

    torch::manual_seed(0);  // the same initial model on every rank
    model_ = torch::nn::Sequential(torch::nn::Linear(16, args_.hidden), torch::nn::ReLU(),
                                   torch::nn::Linear(args_.hidden, 1));
    optimizer_.emplace(model_->parameters(), torch::optim::SGDOptions(args_.lr));
  }

  int run() {
    std::uint64_t step = restore();
    elastrun::control::Status seen;
    while (step < args_.steps) {
      const double loss = train_step(step);
      ++step;
      if (rank_ == 0 && (step % 10 == 0 || step == args_.steps))
        log("step {}/{} loss {:.5f} world {}", step, args_.steps, loss, world_);
      if (args_.step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(args_.step_ms));

      // Every rank must take the same decision at the same step: agree on the strongest request.
      auto status = elastrun::control::poll();
      auto request = torch::tensor({static_cast<int>(status.sequence > seen.sequence ? status.request
                                                                                     : elastrun::control::Request::None)});
      seen = status;
      std::vector<torch::Tensor> bufs{request};
      pg_->allreduce(bufs, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
      const auto agreed = static_cast<elastrun::control::Request>(request.item<int>());
      const bool periodic = args_.ckpt_every > 0 && step % args_.ckpt_every == 0;
      if (!args_.ckpt_dir.empty() && (periodic || agreed != elastrun::control::Request::None || step == args_.steps))
        save(step, loss);
      if (agreed == elastrun::control::Request::CheckpointAndStop) {
        log("checkpoint-and-stop: saved step {}; exiting {}", step, elastrun::control::kCheckpointedExitCode);
        return elastrun::control::kCheckpointedExitCode;
      }
    }
    log("done: {} steps", args_.steps);
    return 0;
  }

 private:
  // The elastrun agent already prefixes every worker line with "[rank N]".
  template <typename... T>
  void log(fmt::format_string<T...> f, T&&... a) {
    if (std::getenv("ELASTRUN_GENERATION")) fmt::print("{}\n", fmt::format(f, std::forward<T>(a)...));
    else fmt::print("[rank {}] {}\n", rank_, fmt::format(f, std::forward<T>(a)...));
    std::fflush(stdout);
  }

  double train_step(std::uint64_t step) {
    auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(step) * 1009 + static_cast<std::uint64_t>(rank_));
    auto x = torch::randn({64, 16}, gen);
    auto y = x.matmul(true_weights()) + 0.01 * torch::randn({64, 1}, gen);
    optimizer_->zero_grad();
    auto loss = torch::mse_loss(model_->forward(x), y);
    loss.backward();
    // Average gradients over the group (what DistributedDataParallel does, unbucketed).
    for (auto& p : model_->parameters()) {
      std::vector<torch::Tensor> grads{p.grad()};
      pg_->allreduce(grads)->wait();
      p.grad().div_(world_);
    }
    optimizer_->step();
    return loss.item<double>();
  }

  void save(std::uint64_t step, double loss) {
    elastrun::ckpt::torch_adapter::SaveViews views;
    for (const auto& p : model_->named_parameters()) views.add_replicated("model/" + p.key(), p.value());
    nlohmann::json meta{{"step", step}, {"loss", loss}, {"world_size", world_}};
    elastrun::ckpt::SaveOptions options;
    options.keep_last = 3;
    auto result = elastrun::ckpt::save_checkpoint(args_.ckpt_dir, step, views.views(), meta, *comm_, options);
    if (rank_ == 0) log("checkpoint step {} -> {}", step, result.path.string());
  }

  std::uint64_t restore() {
    if (args_.ckpt_dir.empty()) return 0;
    elastrun::ckpt::torch_adapter::RestoreTargets targets;
    torch::NoGradGuard no_grad;
    auto params = model_->named_parameters();
    for (auto& p : params) targets.add_whole("model/" + p.key(), p.value());
    auto restored = elastrun::ckpt::restore_latest(args_.ckpt_dir, targets.targets(), *comm_);
    if (!restored) {
      if (rank_ == 0) log("no checkpoint under {}: starting at step 0", args_.ckpt_dir);
      return 0;
    }
    targets.finish();
    for (const auto& why : restored->skipped) if (rank_ == 0) log("skipped a checkpoint: {}", why);
    const auto step = restored->metadata.at("step").get<std::uint64_t>();
    if (rank_ == 0)
      log("resumed from step {} (saved by a world of {}, now {})", step,
          restored->metadata.value("world_size", 0), world_);
    return step;
  }

  Args args_;
  int rank_ = 0, world_ = 1;
  c10::intrusive_ptr<c10d::TCPStore> store_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  std::optional<elastrun::ckpt::C10dStoreCommunicator> comm_;
  torch::nn::Sequential model_{nullptr};
  std::optional<torch::optim::SGD> optimizer_;
};

}  // namespace

int main(int argc, char** argv) {
  Args args;
  CLI::App app{"A libtorch data-parallel trainer for the elastrun worker contract"};
  app.add_option("--steps", args.steps, "train until this step")->check(CLI::PositiveNumber);
  app.add_option("--ckpt-dir", args.ckpt_dir, "checkpoint directory (default: $ELASTRUN_CHECKPOINT_DIR; none: no checkpoints)");
  app.add_option("--ckpt-every", args.ckpt_every, "save every N steps (0: only at the end and when asked)");
  app.add_option("--step-ms", args.step_ms, "sleep this long after each step")->check(CLI::NonNegativeNumber);
  app.add_option("--hidden", args.hidden, "hidden layer width")->check(CLI::PositiveNumber);
  app.add_option("--lr", args.lr, "learning rate")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (args.ckpt_dir.empty()) args.ckpt_dir = env_or(elastrun::control::kCheckpointDirEnv, "");
  elastrun::control::install_signal_handlers();
  const auto rank = env_or("RANK", "?");
  try {
    Trainer trainer(args);
    return trainer.run();
  } catch (const std::exception& e) {
    fmt::print(stderr, "[rank {}] error: {}\n", rank, e.what());
    return 1;
  }
}
