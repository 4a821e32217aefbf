// Stragglers (--straggler-action): a node whose workers compute slower than the others' drags
// the whole job, and in synchronous training every rank's step takes as long as the slowest's, so
// step times cannot find it. Compute times can: each worker reports its compute time before the
// step's collectives with progress(step, compute_s) (the worker contract's compute record).
//
// Every agent turns its workers' records into windows of W steps (ComputeWindows: the mean
// compute per step of each rank over its last W steps) and publishes its slowest rank's mean to
// the store, one key per node, overwritten each window. Group rank 0 scores whenever every member
// has published a newer window (StragglerScore): each node's mean / the median node's. A node
// above --straggler-threshold for --straggler-windows scored windows in a row is named once: the
// `straggler` event, a log line, the report at the end; with --straggler-action=exclude it is
// treated as failed (it leaves, the others re-form, every requeue excludes it).
// docs/launcher.md, "Stragglers".
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace elastrun::launcher {

struct StragglerConfig {
  double threshold = 1.5;  // a node's compute / the median's
  int window_steps = 20;   // W
  int windows = 3;         // K: scored windows in a row above the threshold
};

// One rank's windows, from its progress records as the agent polls them (every monitor tick).
class ComputeWindows {
 public:
  explicit ComputeWindows(int window_steps) : window_steps_(window_steps) {}
  struct Window {
    long index = 0;           // its last step / W
    double compute_ms = 0.0;  // mean compute per step over the window
  };
  // The window that ends with this reading, if one does (at least W steps since the last one).
  std::optional<Window> observe(long step, long compute_us);

 private:
  int window_steps_;
  std::optional<std::pair<long, long>> start_;  // (step, compute_us) where the current window began
};

// A node's value for the scorer: its slowest rank's latest window.
struct NodeCompute {
  std::string node;
  int rank = 0;
  long index = 0;
  double compute_ms = 0.0;
};
// "index rank compute_ms" in the store and back.
std::string to_store_value(const NodeCompute& c);
std::optional<NodeCompute> node_compute_from(const std::string& node, const std::string& value);

// Group rank 0's scorer.
class StragglerScore {
 public:
  explicit StragglerScore(StragglerConfig config) : config_(config) {}
  struct Named {
    std::string node;
    int rank = 0;
    double ratio = 0.0;       // its compute / the median's, in the window that named it
    double compute_ms = 0.0;  // its mean compute per step then
    double median_ms = 0.0;
    int windows = 0;  // scored windows in a row above the threshold
  };
  // The members' latest values: scored when every member has one newer than the last scored
  // window (nodes absent or behind: not yet). Returns the nodes this window names (each once).
  std::vector<Named> score(const std::vector<NodeCompute>& latest, const std::vector<std::string>& members);
  // Each node's ratio in the last scored window.
  const std::map<std::string, double>& ratios() const { return ratios_; }
  long scored_windows() const { return scored_; }

 private:
  StragglerConfig config_;
  long last_index_ = -1;
  long scored_ = 0;
  std::map<std::string, int> above_;  // consecutive scored windows above the threshold
  std::set<std::string> named_;
  std::map<std::string, double> ratios_;
};

}  // namespace elastrun::launcher
