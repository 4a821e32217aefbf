// The same round trip through elastrun::ckpt_torch with at::Tensors.
// Usage: torch_save_and_load CHECKPOINT_DIR
#include <cstdio>

#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/zeros.h>

#include <elastrun/ckpt/torch_adapter.hpp>

using namespace elastrun::ckpt;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT_DIR\n", argv[0]);
    return 2;
  }
  SingleProcessCommunicator comm;
  const at::Tensor weights = at::arange(64 * 16, at::kFloat).reshape({64, 16});
  torch_adapter::SaveViews views;
  views.add_replicated("model/w", weights);
  for (std::uint64_t step : {10, 20}) save_checkpoint(argv[1], step, views.views(), {}, comm, {.keep_last = 1});

  at::Tensor restored = at::zeros({64, 16}, at::kFloat);
  torch_adapter::RestoreTargets targets;
  targets.add_whole("model/w", restored);
  const auto result = restore_latest(argv[1], targets.targets(), comm);
  if (!result || result->step != 20) {
    std::fprintf(stderr, "restore_latest did not return step 20\n");
    return 1;
  }
  targets.finish();
  if (!at::equal(restored, weights)) {
    std::fprintf(stderr, "restored tensor differs from the saved one\n");
    return 1;
  }
  std::printf("ok: torch step %llu\n", static_cast<unsigned long long>(result->step));
  return 0;
}
