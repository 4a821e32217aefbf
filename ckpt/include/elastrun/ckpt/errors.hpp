#pragma once
#include <stdexcept>
#include <string>

namespace elastrun::ckpt {

// Any checkpoint failure (I/O, HDF5, bad arguments, failed vote).
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The data on disk is damaged, truncated or missing (hash mismatch, unreadable shard, ...).
// Restore treats this as "try the previous checkpoint".
class CorruptCheckpointError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

// The checkpoint does not fit what the caller asked for: no tensor of that name, another dtype,
// a box outside the tensor. Restore skips such a step (a damaged manifest looks exactly like
// this), but if no step fits at all it fails instead of starting afresh: then the model changed.
class CheckpointMismatchError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

}  // namespace elastrun::ckpt
