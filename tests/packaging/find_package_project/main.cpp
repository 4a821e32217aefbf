// Saves a small checkpoint with elastrun::ckpt, restores and verifies it; exit 0 if all is well.
// Usage: save_and_load CHECKPOINT_DIR
#include <cstdio>
#include <vector>

#include <elastrun/ckpt/checkpoint.hpp>
#include <elastrun/control.hpp>
#include <elastrun/worker/events.hpp>
#include <elastrun/worker/memory.hpp>

using namespace elastrun::ckpt;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR\n", argv[0]);
    return 2;
  }
  const std::filesystem::path root = argv[1];
  std::vector<float> weights(64 * 16);
  for (std::size_t i = 0; i < weights.size(); ++i) weights[i] = 0.5f * static_cast<float>(i);
  std::vector<std::int64_t> counter = {42};

  SingleProcessCommunicator comm;
  const std::vector<TensorView> views = {
      TensorView::sharded("model/w", DType::float32, {64, 16}, {0, 0}, {64, 16}, weights.data()),
      TensorView::replicated("optim/step", DType::int64, {1}, counter.data())};
  for (std::uint64_t step : {10, 20}) {
    const SaveResult saved = save_checkpoint(root, step, views, {{"epoch", 3}}, comm, {.keep_last = 1});
    if (!saved.warnings.empty()) {
      std::fprintf(stderr, "save warning: %s\n", saved.warnings.front().c_str());
      return 1;
    }
  }

  std::vector<float> w2(weights.size(), -1.0f);
  std::vector<std::int64_t> c2 = {0};
  const std::vector<TensorTarget> targets = {TensorTarget::whole("model/w", DType::float32, {64, 16}, w2.data()),
                                             TensorTarget::whole("optim/step", DType::int64, {1}, c2.data())};
  const auto restored = restore_latest(root, targets, comm);
  if (!restored || restored->step != 20 || restored->metadata.value("epoch", 0) != 3) {
    std::fprintf(stderr, "restore_latest did not return step 20 with its metadata\n");
    return 1;
  }
  if (w2 != weights || c2 != counter) {
    std::fprintf(stderr, "restored tensors differ from the saved ones\n");
    return 1;
  }
  Checkpoint checkpoint(restored->path);
  if (const auto problems = checkpoint.verify_all(); !problems.empty()) {
    std::fprintf(stderr, "verify: %s\n", problems.front().c_str());
    return 1;
  }
  if (list_steps(root).size() != 1) {  // keep_last = 1 retired step 10
    std::fprintf(stderr, "expected one step after retention\n");
    return 1;
  }
  // elastrun::control: the header-only channel compiles and links here too.
  static_assert(elastrun::control::kCheckpointedExitCode == 85);
  if (elastrun::control::poll().stop()) return elastrun::control::kCheckpointedExitCode;
  // elastrun::worker: the event writer (schema v1) from the installed headers.
  auto events = elastrun::worker::EventWriter::from_environment(0);
  // elastrun::worker: the node endpoint's client and the memory tier (off without the agent).
  if (elastrun::worker::MemoryTier().enabled()) return 3;
  if (!events.write(elastrun::contract::event::kTrainDone, {{"step", 1}})) return 1;
  std::printf("ok: step %llu in %s\n", static_cast<unsigned long long>(restored->step), restored->path.c_str());
  return 0;
}
