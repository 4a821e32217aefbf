// Metrics where HPC sites already look: a file per node and job for Prometheus node_exporter's
// textfile collector (`--metrics-dir DIR` / ELASTRUN_METRICS_DIR; docs/launcher.md, "Metrics").
// Prometheus text format 0.0.4, no sample timestamps (the collector skips a file that has them),
// the same HELP/TYPE lines in every file, written atomically (temporary file + rename).
//
// What it says is a function of the node's event log (the agent's lines and the workers'
// appended ones: rounds, losses, restarts, steps, checkpoints), tailed by a thread of the node
// runtime: the metrics never disagree with the events, and no other part has to report to them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

namespace elastrun::launcher {

inline constexpr const char* kMetricsDirEnv = "ELASTRUN_METRICS_DIR";

// What the node's event log has said so far (pure: fed one event at a time).
struct MetricsState {
  std::string state;  // the agent's newest state
  std::int64_t generation = 0, restarts = 0, node_losses = 0;
  int world_size = 0;
  std::optional<std::int64_t> step;
  double step_time = 0;                // when the newest step was written
  std::optional<double> step_seconds;  // between the last two steps
  double progress_time = 0;            // the newest step or checkpoint
  struct Checkpoint {
    std::int64_t step = 0;
    double time = 0, blocked_s = 0, durable_s = 0;
  };
  std::map<std::string, Checkpoint> checkpoints;  // by tier: file, memory
  std::map<std::string, double> stragglers;       // group rank 0's straggler events: member -> ratio
  std::int64_t health_check_failures = 0;         // this node's failed --health-check runs

  void apply(const nlohmann::json& event);
};

struct MetricsLabels {
  std::string job_id, node, run_id;  // `job_id`, not `job`: Prometheus gives `job` to the scrape target
};

// The file's text at `now` (Unix seconds). Pure.
std::string render_metrics(const MetricsState& state, const MetricsLabels& labels, double now);

// The file's name for a run and node: elastrun-<run id>-<node>.prom (characters outside
// [A-Za-z0-9_.-] as '_'; the run id holds the job id, and two runs in one allocation differ).
std::string metrics_file_name(const std::string& run_id, const std::string& node);

// Removes the running writer's file at once: async-signal-safe, for the agent's _exit paths
// (signals.cpp), where no destructor runs.
void remove_metrics_file_now() noexcept;

// The thread that tails `events_path` and rewrites `dir/metrics_file_name(...)` every `interval`
// (and at once when asked); the file is removed when it stops. Failures are one warning each.
class MetricsWriter {
 public:
  MetricsWriter(std::string dir, std::string events_path, MetricsLabels labels, std::chrono::milliseconds interval);
  ~MetricsWriter();  // stops the thread, removes the file
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  const std::string& path() const { return path_; }
  // Removes another node's file of this job from the same directory (a lost member's: its agent
  // cannot, and a shared directory would keep reporting it).
  void remove_node(const std::string& node) const;

 private:
  void run();
  void refresh();
  void write_file();

  std::string dir_, events_path_, path_;
  MetricsLabels labels_;
  std::chrono::milliseconds interval_;
  MetricsState state_;
  std::uintmax_t offset_ = 0;
  std::string partial_;
  bool warned_ = false;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace elastrun::launcher
