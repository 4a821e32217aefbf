#pragma once
// Tests that inject failures through ckpt's fault points (ckpt/src/internal.hpp).
#include <utility>

#include "internal.hpp"

namespace elastrun::ckpt::testing {

// Installs a fault hook for the lifetime of the object. The background remover calls hooks
// too: drained first, so no removal of another save runs this hook or outlives its captures.
class FaultHookGuard {
 public:
  explicit FaultHookGuard(detail::FaultHook hook) {
    detail::wait_for_background_removals();
    detail::set_fault_hook(std::move(hook));
  }
  ~FaultHookGuard() {
    detail::wait_for_background_removals();
    detail::set_fault_hook(nullptr);
  }
  FaultHookGuard(const FaultHookGuard&) = delete;
  FaultHookGuard& operator=(const FaultHookGuard&) = delete;
};

}  // namespace elastrun::ckpt::testing
