#pragma once
// libtorch adapter (target elastrun_ckpt_torch): at::Tensor <-> TensorView/TensorTarget.
// Contiguous CPU tensors are used in place (zero-copy); anything else goes through a contiguous
// CPU copy kept alive by the holder object.
#include <span>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "elastrun/ckpt/checkpoint.hpp"

namespace elastrun::ckpt::torch_adapter {

// Throws CheckpointError for dtypes a checkpoint cannot hold (complex, quantized, ...).
DType to_dtype(c10::ScalarType type);
c10::ScalarType to_scalar_type(DType dtype);
Shape shape_of(const at::Tensor& tensor);

// Views of tensors to save; keep the object alive until save()/AsyncSaver::save() returns.
class SaveViews {
 public:
  void add_replicated(std::string name, const at::Tensor& tensor);
  // `local` is this rank's slice at `offset` of a tensor of `global_shape`.
  void add_sharded(std::string name, const at::Tensor& local, Shape global_shape, Shape offset);
  std::span<const TensorView> views() const { return views_; }

 private:
  const at::Tensor& keep(const at::Tensor& tensor);
  std::vector<at::Tensor> keep_alive_;
  std::vector<TensorView> views_;
};

// Targets that restore into existing tensors (no new model allocation). Call finish() after a
// successful restore: it copies staged data into non-contiguous or non-CPU tensors.
class RestoreTargets {
 public:
  void add_whole(std::string name, at::Tensor& tensor);
  // `local` receives the box at `offset` (its own shape) of the checkpoint's tensor.
  void add_box(std::string name, at::Tensor& local, Shape offset);
  std::span<const TensorTarget> targets() const { return targets_; }
  void finish();

 private:
  struct Staged {
    at::Tensor destination;
    at::Tensor staging;
  };
  std::vector<Staged> staged_;
  std::vector<TensorTarget> targets_;
};

}  // namespace elastrun::ckpt::torch_adapter
