// The agent stopping for a checkpoint: CHECKPOINT_STOP (a time-limit or preemption signal, a
// worker's exit 85, or another node's request), the checkpoint before a scale-up, and how the
// agents agree on who requeues the job. docs/launcher.md, "Signals, checkpoint and requeue".
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "agent.hpp"
#include "elastrun/slurm/api.hpp"
#include "job_outcome.hpp"
#include "requeue.hpp"

namespace elastrun::launcher {

namespace fs = std::filesystem;
using elastrun::control::kCheckpointedExitCode;
using rdzv::Change;

namespace {

// Workers killed by a signal: how long to wait for the agent's own copy of Slurm's signal.
constexpr Millis kSlurmSignalSettle{300};
// How often a multi-node agent looks for another agent's checkpoint-and-stop request.
constexpr Millis kStopRequestPoll{1000};
// Beyond --checkpoint-timeout: how long agents wait for each other after checkpointing.
constexpr Millis kCheckpointBarrierSlack{30'000};

FailureClass class_of_stop_signal(int sig) { return sig == SIGTERM ? FailureClass::Preempt : FailureClass::TimeLimit; }
std::string_view why_of_stop_signal(int sig) {
  return sig == SIGTERM ? "preemption or cancellation" : "time limit warning";
}

}  // namespace

StopRequest Agent::stop_for_signal(int sig, std::string_view detail) {
  return {class_of_stop_signal(sig), sig,
          fmt::format("{} ({}{}{})", signal_name(sig), why_of_stop_signal(sig), detail.empty() ? "" : "; ", detail)};
}

// True if every exit in `exits` is a death by SIGUSR1/SIGUSR2/SIGTERM and the agent itself
// receives such a signal within kSlurmSignalSettle (then the stop is Slurm's, not a failure).
// Returns the stop it is.
std::optional<StopRequest> Agent::killed_by_slurm_stop_signal(const std::vector<WorkerExit>& exits) {
  for (const auto& e : exits)
    if (!is_checkpoint_signal(e.signal)) return std::nullopt;
  const auto deadline = Clock::now() + kSlurmSignalSettle;
  int sig = 0;
  while ((sig = signals_.checkpoint_signal()) == 0 && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (sig == 0) return std::nullopt;
  return stop_for_signal(sig, fmt::format("it also killed {} worker(s) without a handler", exits.size()));
}

// Another agent's checkpoint-and-stop request (published in the store), looked for once per
// kStopRequestPoll: a node whose agent got no signal (or whose worker asked) stops with the rest.
std::optional<StopRequest> Agent::stop_requested_elsewhere() {
  if (rdzv_->current().group_world_size <= 1) return std::nullopt;
  const auto now = Clock::now();
  if (now < next_stop_poll_) return std::nullopt;
  next_stop_poll_ = now + kStopRequestPoll;
  std::optional<std::string> request;
  try {
    request = rdzv_->read("stop-request");
  } catch (const std::exception&) {
    return std::nullopt;  // the store is changing hands; the membership change will tell
  }
  if (!request) return std::nullopt;
  auto j = nlohmann::json::parse(*request, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return std::nullopt;
  return StopRequest{
      failure_class_from_string(j.value("class", std::string())).value_or(FailureClass::TimeLimit),
      j.value("signal", 0),
      fmt::format("requested by node {} ({})", j.value("node", std::string("?")), j.value("reason", std::string("?")))};
}

// CHECKPOINT_STOP: ask the local workers to checkpoint and stop (control channel; the signal
// too with --forward-signals), wait up to --checkpoint-timeout, meet the other agents, and on
// group rank 0 requeue the job. Exits, or goes to SUCCEEDED when the workers finished instead.
Transition Agent::checkpoint_stop(states::CheckpointStop entered) {
  const StopRequest& why = entered.why;
  std::vector<WorkerExit> exits = std::move(entered.exits);
  signals_.set_checkpoint_stopping(true);
  if (ask_workers_to_checkpoint(why) || group_->all_exited()) await_checkpoint(exits);
  for (auto& e : stop_workers(o_.stop_grace)) exits.push_back(std::move(e));
  const auto tally = tally_checkpoint(exits, o_.nproc_per_node);
  const int local = o_.nproc_per_node;
  events().emit(contract::event::kCheckpointOutcome, {{"kind", "stop"},
                                                      {"checkpointed", tally.checkpointed},
                                                      {"finished", tally.finished},
                                                      {"local_workers", local},
                                                      {"complete", tally.complete}});
  if (tally.all_finished) {
    spdlog::info("every local worker finished (exit 0) instead of checkpointing: the job succeeded");
    signals_.set_checkpoint_stopping(false);
    return states::Succeeded{};
  }
  spdlog::info("{} of {} local worker(s) checkpointed (exit {}), {} finished (exit 0)", tally.checkpointed, local,
               kCheckpointedExitCode, tally.finished);
  // group rank 0 requeues only when every node is done: a requeue kills the job's steps
  meet_after_checkpoint();
  const int rc = tally.complete ? kCheckpointedExitCode : why.signal ? 128 + why.signal : 1;
  if (rdzv_->current().group_rank == 0) {
    write_outcome(tally.complete ? JobOutcome::Checkpointed : JobOutcome::Failed, rc);
    request_requeue(why.cls, {}, why.signal);
    try {
      rdzv_->close(close_reason(JobOutcome::Checkpointed, to_string(why.cls)));
    } catch (const std::exception& e) {
      spdlog::warn("warning: closing the rendezvous: {}", e.what());
    }
  }
  spdlog::info("{}; exiting {}", tally.complete ? "checkpointed and stopped" : "stopped without a complete checkpoint",
               rc);
  return exit_with(rc);
}

// CHECKPOINT_STOP's request: the state and its event, the other agents (a stop request in the
// store), the local workers (the control channel; the signal with --forward-signals). False when
// the workers cannot be asked (they never polled the channel, or it cannot be written): they are
// then stopped without a checkpoint.
bool Agent::ask_workers_to_checkpoint(const StopRequest& why) {
  const bool channel_read = fs::exists(control_path_ + elastrun::control::kSeenSuffix);
  log_state("CHECKPOINT_STOP", fmt::format("class {}: {}", to_string(why.cls), why.reason));
  events().emit(contract::event::kCheckpointRequest, {{"kind", "stop"},
                                                      {"class", to_string(why.cls)},
                                                      {"reason", why.reason},
                                                      {"signal", why.signal ? signal_name(why.signal) : ""}});
  try {
    nlohmann::json request = {{"class", std::string(to_string(why.cls))},
                              {"node", plan_.me.node_name},
                              {"reason", why.reason},
                              {"signal", why.signal}};
    rdzv_->publish("stop-request", request.dump(), /*only_if_absent=*/true);
  } catch (const std::exception& e) {
    spdlog::warn("warning: publishing the stop request to the other agents: {}", e.what());
  }
  bool written = true;
  try {
    write_control(elastrun::control::Request::CheckpointAndStop);
  } catch (const std::exception& e) {
    spdlog::error("error: {}; the workers cannot be asked to checkpoint", e.what());
    written = false;
  }
  if (o_.forward_signals && why.signal) {
    spdlog::info("forwarding {} to the workers (--forward-signals)", signal_name(why.signal));
    group_->signal_all(why.signal);
  }
  if ((channel_read && written) || o_.forward_signals) return true;
  if (!group_->all_exited())
    spdlog::info(
        "the workers never polled {} (elastrun/control.hpp, elastrun_control.py): stopping them without "
        "a checkpoint (grace {} ms)",
        control_path_, o_.stop_grace.count());
  return false;
}

// Until every local worker exited, a stop signal, or --checkpoint-timeout; adds their exits.
void Agent::await_checkpoint(std::vector<WorkerExit>& exits) {
  spdlog::info("wrote checkpoint-and-stop to {}; waiting up to {} s for the workers to exit {}", control_path_,
               o_.checkpoint_timeout.count() / 1000, kCheckpointedExitCode);
  const auto deadline = Clock::now() + o_.checkpoint_timeout;
  while (true) {
    for (auto& e : collect_exits()) exits.push_back(std::move(e));
    if (group_->all_exited()) return;
    if (int sig = signals_.stop_signal()) {
      spdlog::info("received {} while waiting for the checkpoint: stopping the workers now", signal_name(sig));
      return;
    }
    if (Clock::now() >= deadline) {
      spdlog::warn("warning: the workers did not all exit within --checkpoint-timeout={} s: stopping them",
                   o_.checkpoint_timeout.count() / 1000);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// After the local checkpoint: every node of a multi-node round reports it done (bounded), so that
// group rank 0's requeue does not kill steps that are still saving.
void Agent::meet_after_checkpoint() {
  if (rdzv_->current().group_world_size <= 1) return;
  bool everyone = false;
  try {
    everyone = rdzv_->barrier("checkpoint-stop", o_.checkpoint_timeout + kCheckpointBarrierSlack);
  } catch (const std::exception& e) {
    spdlog::warn("warning: checkpoint barrier: {}", e.what());
  }
  if (!everyone) spdlog::warn("warning: not every node reported its checkpoint done in time");
}

// A node waits to join and every member is alive: the re-forming is planned, so workers that read
// the control channel checkpoint and stop first (exit 85), and the larger round resumes from now
// rather than from the last periodic checkpoint. Every agent of the round sees the same waiting
// node and asks its own workers, so a collective save finds all ranks. Any other change meanwhile
// (a member lost: a collective would hang; a new round; a close) stops the workers at once.
// Returns the change to act on.
Change Agent::checkpoint_before_scale_up() {
  if (!fs::exists(control_path_ + elastrun::control::kSeenSuffix)) {
    spdlog::info("scale-up: the workers never polled {}: re-forming without a checkpoint", control_path_);
    return Change::MemberWaiting;
  }
  try {
    write_control(elastrun::control::Request::CheckpointAndStop);
  } catch (const std::exception& e) {
    spdlog::warn("warning: {}; re-forming without a checkpoint", e.what());
    return Change::MemberWaiting;
  }
  spdlog::info("scale-up: asked the workers to checkpoint and stop before re-forming (up to {} s)",
               o_.checkpoint_timeout.count() / 1000);
  events().emit(contract::event::kCheckpointRequest, {{"kind", "scale_up"}, {"reason", "a node waits to join"}});
  const auto deadline = Clock::now() + o_.checkpoint_timeout;
  int checkpointed = 0;
  while (true) {
    // a failure is not counted against --max-restarts: the round is being re-formed anyway
    for (const auto& e : collect_exits(/*record_failures=*/false)) {
      if (classify(e) == ExitKind::Checkpointed) ++checkpointed;
      if (classify(e) == ExitKind::Failed)
        spdlog::warn(
            "warning: worker {} {} during the scale-up checkpoint", e.global_rank,
            e.signal ? fmt::format("died of {}", signal_name(e.signal)) : fmt::format("exited {}", e.exit_code));
    }
    if (group_->all_exited()) {
      spdlog::info("scale-up: {} of {} local worker(s) checkpointed", checkpointed, o_.nproc_per_node);
      events().emit(contract::event::kCheckpointOutcome, {{"kind", "scale_up"},
                                                          {"checkpointed", checkpointed},
                                                          {"local_workers", o_.nproc_per_node},
                                                          {"complete", checkpointed == o_.nproc_per_node}});
      break;
    }
    if (signals_.stop_signal() || signals_.checkpoint_signal())
      return Change::MemberWaiting;  // the next state handles it
    if (Clock::now() >= deadline) {
      spdlog::warn("warning: the workers did not all checkpoint within --checkpoint-timeout={} s: stopping them",
                   o_.checkpoint_timeout.count() / 1000);
      return Change::MemberWaiting;
    }
    if (const Change c = wait_for_change(Millis(50)); c != Change::None && c != Change::MemberWaiting) {
      spdlog::info("scale-up: {} during the checkpoint: stopping the workers now", to_string(c));
      return c;
    }
  }
  // Wait for the other nodes' workers too: the first agent to re-form would otherwise start the
  // next round and make the others stop workers that are still saving.
  const auto& round = rdzv_->current();
  if (round.group_world_size <= 1) return Change::MemberWaiting;
  try {
    const auto key = fmt::format("scale-up-checkpoint/{}", round.generation);
    auto done = rdzv_->add_to_counter(key, 1);
    for (; done < round.group_world_size; done = rdzv_->add_to_counter(key, 0)) {
      if (Clock::now() >= deadline) {
        spdlog::warn(
            "warning: {} of {} node(s) finished the scale-up checkpoint within --checkpoint-timeout; re-forming", done,
            round.group_world_size);
        break;
      }
      if (const Change c = wait_for_change(Millis(50)); c != Change::None && c != Change::MemberWaiting) {
        // a node that saw everyone done first starts the next round (Reform): not an interruption
        if (rdzv_->add_to_counter(key, 0) >= round.group_world_size) {
          spdlog::info("scale-up: every node checkpointed; re-forming");
        } else {
          spdlog::info("scale-up: {} while waiting for the other nodes' checkpoint", to_string(c));
        }
        return c;
      }
    }
    if (done >= round.group_world_size) spdlog::info("scale-up: every node checkpointed; re-forming");
  } catch (const std::exception& e) {
    spdlog::warn("warning: waiting for the other nodes' scale-up checkpoint: {}", e.what());
  }
  return Change::MemberWaiting;
}

// Once per agent: the signal thread (a stop signal while group rank 0 re-forms) and the main
// thread (the round it was re-forming failed or closed meanwhile) may both get here.
bool Agent::request_requeue(FailureClass cls, const std::vector<std::string>& requested_exclude, int signal) {
  // the nodes that failed their health checks stay out of the requeued job too
  std::vector<std::string> exclude = requested_exclude;
  for (auto& node : unhealthy_nodes())
    if (std::find(exclude.begin(), exclude.end(), node) == exclude.end()) exclude.push_back(std::move(node));
  std::lock_guard lock(requeue_mutex_);
  if (requeue_attempted_) {
    spdlog::info("requeue ({}): already requested by this agent", to_string(cls));
    return requeued_;
  }
  requeue_attempted_ = true;
  bool requeued = false;
  try {
    requeued = requeue_job(env_.slurm ? &*env_.slurm : nullptr, o_, cls, exclude, signal);
  } catch (const std::exception& e) {  // e.g. a damaged ledger: the job is not requeued
    spdlog::error("error: requeueing the job: {}", e.what());
  }
  requeued_ = requeued;
  events().emit(contract::event::kRequeue, {{"class", to_string(cls)},
                                            {"signal", signal ? signal_name(signal) : ""},
                                            {"exclude", exclude},
                                            {"requeued", requeued}});
  return requeued;
}

// Group rank 0, after the job failed for good: requeue when the agent that gave up asked for it
// (class app: --max-restarts used up) and the class budget allows.
void Agent::requeue_failed_job() {
  if (!env_.slurm || rdzv_->current().group_world_size == 0 || rdzv_->current().group_rank != 0) return;
  std::optional<std::string> request;
  try {
    request = rdzv_->read("requeue-request");
  } catch (const std::exception& e) {
    spdlog::warn("warning: reading the requeue request: {}", e.what());
    return;
  }
  if (!request) return;
  signals_.set_checkpoint_stopping(true);  // Slurm's SIGTERM after our requeue must not cut the exclusion short
  refresh_unhealthy_nodes();               // a node may have failed its health check since the last round
  request_requeue(FailureClass::App, {}, 0);
}

// The survivors of a node loss could not form a round of --nnodes MIN: one of them (the first
// to claim it in the store) requeues the job, excluding the members Slurm reports down.
void Agent::requeue_after_node_loss() {
  if (!env_.slurm) return;
  std::vector<std::string> lost;
  for (const auto& m : rdzv_->current().members())
    if (m.node_name != plan_.me.node_name && slurm::node_is_down(m.node_name).value_or(false))
      lost.push_back(m.node_name);
  bool mine = false;
  try {
    mine = rdzv_->publish("requeue-claim", plan_.me.node_name, /*only_if_absent=*/true);
  } catch (const std::exception& e) {
    spdlog::warn("warning: claiming the requeue: {}", e.what());
  }
  if (!mine) {
    spdlog::info("another survivor handles the requeue");
    return;
  }
  signals_.set_checkpoint_stopping(true);
  refresh_unhealthy_nodes();  // e.g. the member that failed its health check after a failure: excluded too
  request_requeue(FailureClass::Node, lost, 0);
}

// Group rank 0 of the last round, as the agent's very last act: when the node running the batch
// script dies, a --no-kill job goes on running on its other nodes (slurmctld excises the node
// but keeps the job), and the training may well finish there. Nothing is then left to end the
// job: it would hold its nodes, RUNNING, until the time limit. End it with the agents' verdict,
// as the batch script's exit would have (slurm_complete_job; verified on Slurm 22.05: the job
// ends COMPLETED, or FAILED for a non-zero code, and its remaining steps with it).
// slurmctld excises a dead node only after SlurmdTimeout: when the batch host's agent was lost
// during the run (a member of an earlier round, not of the last) and the node is still in the job, wait (bounded) for
// slurmctld's ruling.
void Agent::end_job_if_batch_script_lost(const std::vector<std::string>& last_round_members) {
  if (!env_.slurm || env_.slurm->job_id.empty() || requeued_) return;
  const auto& job_id = env_.slurm->job_id;
  auto job = load_slurm_job(job_id);
  if (!job || job->batch_host.empty() || job->cancelled) return;
  if (!job->batch_host_left) {
    // lost = a member of an earlier round missing from the last (however its loss was seen)
    const auto& last = last_round_members;
    if (!ever_members_.contains(job->batch_host) || std::find(last.begin(), last.end(), job->batch_host) != last.end())
      return;
    const auto patience = slurmd_timeout().value_or(std::chrono::seconds(300)) * 3 / 2 + std::chrono::seconds(10);
    spdlog::info(
        "the agent on {}, the node running job {}'s batch script, was lost: waiting up to {} s for Slurm to rule on "
        "the node (1.5 x SlurmdTimeout + 10 s)",
        job->batch_host, job_id, patience.count());
    const auto deadline = Clock::now() + patience;
    while (job && !job->batch_host_left && !job->cancelled && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::seconds(2));
      if (auto again = load_slurm_job(job_id)) job = again;
    }
    if (!job || job->cancelled) return;
    if (!job->batch_host_left) {
      spdlog::info("{} is still part of job {}: its batch script is taken to be alive", job->batch_host, job_id);
      return;
    }
  }
  spdlog::warn(
      "the batch script of job {} died with its node {}; the training ended here with exit code {}: ending the job "
      "with that code",
      job_id, job->batch_host, rc_);
  const auto r = complete_slurm_job(job_id, rc_);
  events().emit(contract::event::kJobCompleted,
                {{"batch_host", job->batch_host}, {"exit_code", rc_}, {"ok", r.ok}, {"error", r.error}});
  if (!r.ok)
    spdlog::error("error: slurm_complete_job({}): {}; the job stays until its time limit (scancel it)", job_id,
                  r.error);
  spdlog::default_logger()->flush();
}

}  // namespace elastrun::launcher
