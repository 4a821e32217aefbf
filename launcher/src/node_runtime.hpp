// The node runtime: what lives on a node for the whole job, across attempts and rounds, owned by
// the node's agent and driven by its per-attempt state machine (agent.hpp) through this narrow
// interface:
//   - the reaper (reaper.hpp): the agent's children, each exit handed to the part that owns it;
//   - the watchdog (watchdog.hpp): forked before the first workers, ends them if the agent dies;
//   - the process backend (process_backend.hpp): how workers are started (exec today; the
//     preloader next, which must outlive attempts -- hence here, not in an attempt);
//   - the event log (events.hpp): one per node, the job's whole history;
//   - the node endpoint (node_endpoint.hpp): answers on its own thread with the status the state
//     machine publishes here, also while it waits in a rendezvous, and serves the memory
//     checkpoint tier's segments (memory_segments.hpp; --memory-checkpoints), which outlive
//     every attempt; the preloader attaches here next.
// docs/architecture.md draws it.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "events.hpp"
#include "memory_peers.hpp"
#include "memory_segments.hpp"
#include "metrics.hpp"
#include "node_endpoint.hpp"
#include "process_backend.hpp"
#include "reaper.hpp"
#include "watchdog.hpp"

namespace elastrun::launcher {

class NodeRuntime {
 public:
  // What the state machine publishes for the endpoint's status query.
  struct Status {
    std::string state;
    std::int64_t generation = 0, restart_count = 0;
    int world_size = 0, group_rank = -1, group_world_size = 0, attempt = -1;
    std::vector<pid_t> worker_pids;
    std::string process_backend;  // its name, once workers were started
  };
  // Who this runtime is, in the status reply.
  struct Identity {
    std::string node, run_id, job_dir;
  };

  explicit NodeRuntime(std::chrono::milliseconds stop_grace) : stop_grace_(stop_grace) {}
  ~NodeRuntime();  // the endpoint first, then the backend, the watchdog (its workers ended), the log
  NodeRuntime(const NodeRuntime&) = delete;
  NodeRuntime& operator=(const NodeRuntime&) = delete;

  // ---- the event log (off until opened) ----
  // Throws std::system_error naming the path (EventLog).
  void open_event_log(const std::string& path, const std::string& node, const std::string& run_id);
  EventLog& events() { return events_; }

  // ---- metrics (--metrics-dir; off until started): a thread tailing the event log ----
  void start_metrics(const std::string& dir, MetricsLabels labels);
  bool metrics_on() const { return metrics_ != nullptr; }
  // A lost member's file in the same directory (group rank 0 of the next round).
  void forget_metrics_of(const std::string& node) {
    if (metrics_) metrics_->remove_node(node);
  }

  // ---- the endpoint ----
  // Serves the default address (default_node_address) for the rest of the job. Not vital: when
  // it cannot be had, one warning and the job goes on without it.
  void serve_endpoint(Identity identity);
  std::string endpoint_address() const { return endpoint_ ? endpoint_->address() : std::string(); }
  template <class Update>
  void update_status(Update&& update) {
    std::lock_guard lock(status_mutex_);
    update(status_);
  }
  nlohmann::json status_reply() const;   // what "status" answers (the endpoint's thread)
  nlohmann::json memory_status() const;  // its "memory_checkpoints" (null when off)

  // ---- the memory checkpoint tier (off until enabled: its requests are refused) ----
  void enable_memory_checkpoints(std::uint64_t budget_bytes);
  MemorySegments* memory() { return memory_.get(); }
  // Partner copies between agents (memory_peers.hpp), after enable_memory_checkpoints. Throws
  // std::system_error when it cannot listen on bind_address.
  void enable_memory_peers(PeerCredentials credentials, const std::string& bind_address);
  MemoryPeers* memory_peers() { return memory_peers_.get(); }

  // ---- fenced checkpoint commits (commit_fence: refused until set) ----
  // Answers "may this node's round commit WHAT?": the token to go ahead, or throws why not.
  // Called on the endpoint's thread.
  using CommitFenceCheck = std::function<std::string(const std::string& what)>;
  void set_commit_fence(CommitFenceCheck check) {
    std::lock_guard lock(status_mutex_);
    commit_fence_ = std::move(check);
  }

  // ---- processes ----
  // --preload: Python workers of `config.python` are forked by a preloader (before the first
  // process_backend() call).
  void enable_preload(PreloadConfig config) { preload_ = std::move(config); }
  Reaper& reaper() { return reaper_; }
  // The backend that starts workers; forks the watchdog on first use (before the first workers).
  ProcessBackend& process_backend();
  // "ELASTRUN_AGENT_TAG=...": for every worker's environment (forks the watchdog if needed).
  const std::string& agent_tag();

 private:
  worker::NodeReply answer(const nlohmann::json& request);
  MemorySegments& memory_or_refuse();

  std::chrono::milliseconds stop_grace_;
  Reaper reaper_;
  EventLog events_;
  std::unique_ptr<MetricsWriter> metrics_;  // reads the event log's file: after it
  std::optional<Watchdog> watchdog_;
  std::optional<PreloadConfig> preload_;
  std::unique_ptr<ProcessBackend> backend_;
  std::unique_ptr<MemorySegments> memory_;     // before the endpoint that serves it
  std::unique_ptr<MemoryPeers> memory_peers_;  // after the segments it copies, before the endpoint
  Identity identity_;
  mutable std::mutex status_mutex_;
  Status status_;
  CommitFenceCheck commit_fence_;           // under status_mutex_
  std::unique_ptr<NodeEndpoint> endpoint_;  // last: stopped first, before what it reads
};

}  // namespace elastrun::launcher
