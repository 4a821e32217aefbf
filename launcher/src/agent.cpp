#include "agent.hpp"

// The state machine: Agent::run() and one method per state (agent.hpp). Set-up is in
// agent_setup.cpp, stopping for a checkpoint in agent_stop.cpp.
#include <signal.h>
#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "collective_env.hpp"
#include "gpu_binding.hpp"
#include "health_check.hpp"
#include "elastrun/rdzv/net.hpp"
#include "job_outcome.hpp"
#include "restart_policy.hpp"
#include "worker_env.hpp"

extern char** environ;

namespace elastrun::launcher {

namespace fs = std::filesystem;
using namespace elastrun::rdzv;

static_assert(elastrun::control::kCheckpointedExitCode == 85, "WorkerExit::checkpointed() tests for 85");

namespace {

// How long an agent that lost the restart claim waits for the claimer's decision.
constexpr Millis kClaimerPatience{10'000};

}  // namespace

namespace {
template <class... Handlers>
struct Overloaded : Handlers... {
  using Handlers::operator()...;
};
}  // namespace

std::string_view state_name(const Transition& t) {
  return std::visit(
      Overloaded{
          [](const states::Rendezvous&) { return "RENDEZVOUS"; },
          [](const states::StartWorkers&) { return "START_WORKERS"; }, [](const states::Monitor&) { return "MONITOR"; },
          [](const states::Succeeded&) { return "SUCCEEDED"; }, [](const states::Failed&) { return "FAILED"; },
          [](const states::MembershipChanged&) { return "MEMBERSHIP_CHANGED"; },
          [](const states::CheckpointStop&) { return "CHECKPOINT_STOP"; }, [](const states::Exit&) { return "EXIT"; }},
      t);
}

// ---- the loop --------------------------------------------------------------------------------

int Agent::run() {
  resolve_command();  // a missing program is a usage error, before any rendezvous
  bootstrap();
  if (o_.log_dir.empty()) {
    tmp_.emplace();
    attempt_base_ = tmp_->path();
  } else {
    // a directory per node when several nodes may share the log dir (a shared filesystem: their
    // attempt directories would be the same files; torchrun adds a random suffix per agent)
    attempt_base_ = log_dir_per_node_ || max_nodes_ > 1 ? fs::path(o_.log_dir) / plan_.me.node_name / plan_.run_id
                                                        : fs::path(o_.log_dir) / plan_.run_id;
  }
  for (const auto& key : o_.ignored_rdzv_conf) spdlog::info("--rdzv-conf {}: accepted, no effect here", key);
  for (const auto& key : o_.unknown_rdzv_conf)
    spdlog::warn(
        "warning: --rdzv-conf {}: unknown key, ignored (known: join_timeout, last_call_timeout, "
        "heartbeat_timeout, is_host, and torchrun's timeout, keep_alive_interval, keep_alive_max_attempt, "
        "read_timeout, close_timeout, store_type, use_libuv, ...)",
        key);
  for (const auto& note : o_.notes) spdlog::info("{}", note);
  if (const char* on = std::getenv("TORCHELASTIC_ENABLE_FILE_TIMER"); on && std::string_view(on) == "1") {
    // torch's FileTimerServer protocol: the FIFO named by TORCHELASTIC_TIMER_FILE, else one of ours
    const char* named = std::getenv(std::string(contract::env::kTimerFile).c_str());
    file_timer_.emplace(named && *named ? fs::path(named)
                                        : attempt_base_ / fmt::format("watchdog_timer_{}", plan_.me.pid));
    spdlog::info("serving torch FileTimer requests on {} (TORCHELASTIC_ENABLE_FILE_TIMER=1)",
                 file_timer_->path().string());
  }
  if (!o_.numa_binding.empty()) {
    numa_nodes_ = read_numa_nodes();
    if (numa_nodes_.size() < 2)
      spdlog::info("--numa-binding={}: this machine has {} NUMA node(s); nothing to bind", o_.numa_binding,
                   numa_nodes_.size());
    else
      spdlog::info("--numa-binding={}: local ranks spread over {} NUMA nodes, each worker on its node's CPUs{}",
                   o_.numa_binding, numa_nodes_.size(),
                   o_.numa_binding == "node" ? "" : " (no accelerator topology here: bound as 'node')");
  }
  {
    // the address peers reach this node at: the one the stores listen on, else the node's own
    const auto address =
        plan_.bind_address != "0.0.0.0" ? std::optional(plan_.bind_address) : rdzv::ipv4_address(plan_.me.address);
    gpus_ = detect_gpus();
    if (gpus_.size() > 0) {
      const bool own = o_.gpus_per_worker >= 1 || o_.virtual_local_rank;
      spdlog::info("GPUs for the workers: {} (from {}); {}", fmt::join(gpus_.visible, ","), gpus_.source,
                   own ? "each worker sees only its own (ELASTRUN_DEVICE=0)"
                       : "worker i uses the i-th (LOCAL_RANK = ELASTRUN_DEVICE)");
      if (!own && static_cast<std::size_t>(o_.nproc_per_node) > gpus_.size())
        spdlog::warn("warning: {} workers on {} GPU(s): workers {}.. share GPUs (NCCL refuses two ranks on one GPU)",
                     o_.nproc_per_node, gpus_.size(), gpus_.size());
    }
    if (!o_.numa_binding.empty() && gpus_.size() > 0) {
      gpu_cpus_ = cpus_near_gpus(gpus_, read_gpu_numa_nodes());
      for (std::size_t i = 0; i < gpu_cpus_.size(); ++i)
        if (!gpu_cpus_[i].empty())
          spdlog::info("--numa-binding: a worker on GPU {} runs on CPUs {} (its NUMA node)", gpus_.visible[i],
                       fmt::join(gpu_cpus_[i], ","));
    }
    const char* per_task = std::getenv("SLURM_CPUS_PER_TASK");
    cpus_ = cpus_for_workers(cpu_count(), per_task ? std::optional<std::string>(per_task) : std::nullopt);
    if (o_.nproc_per_node > 1 && !std::getenv("OMP_NUM_THREADS"))
      spdlog::info("workers' OMP_NUM_THREADS: {} ({} CPU(s) here for {} workers; set it to choose)",
                   omp_threads_per_worker(cpus_, o_.nproc_per_node), cpus_, o_.nproc_per_node);
    const auto nic = choose_socket_interface(address.value_or(""), network_interfaces());
    socket_ifname_ = nic.ifname;
    if (nic.warning)
      spdlog::warn("{}", nic.note);
    else if (!nic.note.empty())
      spdlog::info("{}", nic.note);
  }
  signals_.set_rendezvous_requeuer([this](int sig) {
    request_requeue(sig == SIGTERM ? FailureClass::Preempt : FailureClass::TimeLimit, {}, sig);
    spdlog::default_logger()->flush();
  });

  Transition next = states::Rendezvous{};
  while (!std::holds_alternative<states::Exit>(next)) {
    next = std::visit(Overloaded{[this](states::Rendezvous) { return rendezvous(); },
                                 [this](states::StartWorkers) { return start_workers(); },
                                 [this](states::Monitor) { return monitor(); },
                                 [this](states::Failed& s) { return failed(std::move(s)); },
                                 [this](states::MembershipChanged& s) { return membership_changed(s); },
                                 [this](states::Succeeded) { return succeeded(); },
                                 [this](states::CheckpointStop& s) { return checkpoint_stop(std::move(s)); },
                                 [](states::Exit& s) -> Transition { return s; }},
                      next);
  }
  rc_ = std::get<states::Exit>(next).code;
  if (group_) stop_workers(o_.stop_grace);  // every state stops its workers before Exit; never orphan
  events().emit(contract::event::kExit, {{"code", rc_}});
  const auto& last = rdzv_->current();
  const bool led_last_round = last.group_world_size > 0 && last.group_rank == 0;
  if (led_last_round) report_node_verdicts();
  remove_checkpoint_dir_marker(health_marker_, rdzv_.get(), plan_.me.node_name);
  std::vector<std::string> last_members;
  if (led_last_round)
    for (const auto& m : last.members()) last_members.push_back(m.node_name);
  linger_for_peers();
  // the signal thread may be requeueing (it exits the process when done): not under our feet
  std::lock_guard requeue_done(requeue_mutex_);
  if (led_last_round) end_job_if_batch_script_lost(last_members);
  return rc_;
}

// RENDEZVOUS: join the next round (the first, or a re-formed one after a failure or a change).
Transition Agent::rendezvous() {
  if (int sig = signals_.stop_signal()) {
    spdlog::info("stopped by {}; exiting {}", signal_name(sig), 128 + sig);
    return exit_with(128 + sig);
  }
  if (auto excluded = leave_if_excluded()) return exit_with(*excluded);
  if (auto unhealthy = check_node_health()) return exit_with(*unhealthy);
  log_state("RENDEZVOUS", fmt::format("run '{}' nodes {}:{}", plan_.run_id, min_nodes_, max_nodes_));
  set_fence(std::nullopt);  // between rounds nothing commits
  const auto t0 = Clock::now();
  try {
    const RoundResult* round = nullptr;
    std::vector<std::string> last_members;
    {
      const auto& last = rdzv_->current();
      if (runtime_.metrics_on())  // parsing a roster costs at scale: only for what needs it
        for (const auto& m : last.members()) last_members.push_back(m.node_name);
      AgentSignals::RendezvousRequeue requeuer(signals_, last.group_world_size > 0 && last.group_rank == 0);
      round = &rdzv_->next_round();
    }
    const auto& r = *round;
    const auto formation_ms = std::chrono::duration_cast<Millis>(Clock::now() - t0).count();
    restart_count_ = rdzv_->add_to_counter("restarts", 0);
    set_fence(rdzv_->commit_fence(env_.slurm ? static_cast<std::uint64_t>(env_.slurm->restart_count) : 0));
    for (const auto& m : r.members()) ever_members_.insert(m.node_name);
    refresh_unhealthy_nodes();
    memory_peers_round(r);
    if (r.group_rank == 0)  // a lost member's metrics file: its agent cannot remove it
      for (const auto& node : last_members)
        if (std::none_of(r.members().begin(), r.members().end(), [&](const auto& m) { return m.node_name == node; }))
          runtime_.forget_metrics_of(node);
    runtime_.update_status([&](NodeRuntime::Status& s) {
      s.generation = static_cast<std::int64_t>(r.generation);
      s.world_size = r.world_size;
      s.group_rank = r.group_rank;
      s.group_world_size = r.group_world_size;
      s.restart_count = restart_count_;
    });
    if (events().enabled()) {
      nlohmann::json members = nlohmann::json::array();
      for (const auto& m : r.members()) members.push_back(m.node_name);
      events().emit(contract::event::kRound, {{"generation", r.generation},
                                              {"world_size", r.world_size},
                                              {"group_rank", r.group_rank},
                                              {"group_world_size", r.group_world_size},
                                              {"members", members},
                                              {"formation_ms", formation_ms},
                                              {"master", fmt::format("{}:{}", r.master_addr, r.master_port)},
                                              {"restart_count", restart_count_}});
    }
    log_state("RENDEZVOUS",
              fmt::format("round {} formed in {} ms: group rank {} of {}, ranks {}..{} of {}, master {}:{}",
                          r.generation, formation_ms, r.group_rank, r.group_world_size, r.rank_offset,
                          r.rank_offset + o_.nproc_per_node - 1, r.world_size, r.master_addr, r.master_port));
    return states::StartWorkers{};
  } catch (const RendezvousClosed& e) {
    const auto outcome = outcome_of_close(e.reason());
    if (rdzv_->current().group_world_size > 0 && outcome != JobOutcome::Succeeded) {
      print_summary();  // group rank 0 of the last round: the job-wide one
      requeue_failed_job();
    }
    if (rdzv_->current().group_world_size > 0 && rdzv_->current().group_rank == 0)
      write_outcome(outcome, exit_code_of(outcome));
    return exit_with(closed_exit(e));
  } catch (const NoQuorum& e) {
    // cut off from a majority for --partition-timeout: never a round of our own (no split brain)
    spdlog::error("error: {}; exiting {}", e.what(), contract::kPartitionedExitCode);
    print_summary();
    return exit_with(contract::kPartitionedExitCode);
  } catch (const RendezvousError& e) {
    if (rdzv_->current().group_world_size == 0) throw;  // no round ever formed
    // fewer nodes than --nnodes MIN came back after a loss: class "node"
    spdlog::error("error: {}", e.what());
    print_summary();
    requeue_after_node_loss();
    if (rdzv_->current().group_rank == 0) write_outcome(JobOutcome::Failed, 1);
    return exit_with(1);
  }
}

// START_WORKERS: this attempt's control channel and worker environment, then the processes.
Transition Agent::start_workers() {
  const fs::path attempt_dir = attempt_base_ / fmt::format("attempt_{}", attempt_);
  open_control_channel(attempt_dir);
  const AttemptContext attempt{
      .options = o_,
      .round = rdzv_->current(),
      .run_id = plan_.run_id,
      .node_name = plan_.me.node_name,
      .control_file = control_path_,
      .events_file = events().path(),
      .restart_count = restart_count_,
      .attempt_dir = attempt_dir,
      .program_path = command_path_,
      .argv = command_argv_,
      .agent_tag = runtime_.agent_tag(),  // forks the watchdog once, before the first workers
      .argv_program_end = command_argv_program_end_,
      .numa_nodes = numa_nodes_,
      .timer_file = file_timer_ ? file_timer_->path().string() : std::string(),
      .node_socket = runtime_.endpoint_address(),
      .memory_budget = runtime_.memory() ? std::optional(runtime_.memory()->budget()) : std::nullopt,
      .socket_ifname = socket_ifname_,
      .cpus = cpus_,
      .gpus = gpus_,
      .gpu_cpus = gpu_cpus_};
  attempt_dir_ = attempt_dir;
  killed_by_us_.clear();
  start_straggler_watch();
  auto specs = worker_specs(attempt, inherited_environment(environ));
  error_files_.clear();
  for (const auto& spec : specs) error_files_.push_back(spec.error_file);
  signals_.set_workers_active(true);
  group_.emplace(std::move(specs), runtime_.process_backend());
  runtime_.update_status([&](NodeRuntime::Status& s) {
    s.worker_pids = group_->pids();
    s.attempt = attempt_;
  });
  std::string pids;
  for (auto p : group_->pids()) pids += fmt::format("{}{}", pids.empty() ? "" : ",", p);
  log_state("START_WORKERS", fmt::format("attempt {} restart {}: {} worker(s) pids {} ({})", attempt_, restart_count_,
                                         o_.nproc_per_node, pids, command_path_));
  events().emit(contract::event::kWorkersStarted,
                {{"attempt", attempt_},
                 {"restart_count", restart_count_},
                 {"ranks", {rdzv_->current().rank_offset, rdzv_->current().rank_offset + o_.nproc_per_node - 1}},
                 {"pids", group_->pids()},
                 {"started_by", group_->started_by()}});
  ++attempt_;
  return states::Monitor{};
}

// MONITOR: until the workers finish, one fails, a signal arrives or the membership changes.
Transition Agent::monitor() {
  log_state("MONITOR", "");
  std::vector<WorkerExit> seen;  // this attempt's exits so far, for CHECKPOINT_STOP
  bool checkpointed = false;
  std::optional<Change> scale_up;  // seen by wait_for_change, acted on after one more look at the exits
  while (true) {
    if (int sig = signals_.checkpoint_signal(); sig && !signals_.stop_signal())
      return states::CheckpointStop{stop_for_signal(sig), std::move(seen)};
    if (int sig = signals_.stop_signal()) {
      spdlog::info("stopping workers on {} (grace {} ms)", signal_name(sig), o_.stop_grace.count());
      stop_workers(o_.stop_grace);
      return exit_with(128 + sig);
    }
    std::vector<WorkerExit> failures;
    for (auto& e : collect_exits(/*record_failures=*/false)) {
      if (classify(e) == ExitKind::Failed) failures.push_back(e);
      if (classify(e) == ExitKind::Checkpointed) checkpointed = true;
      seen.push_back(std::move(e));
    }
    if (auto stop = failures.empty() ? std::nullopt : killed_by_slurm_stop_signal(failures)) {
      // Slurm signals every process of the step: a worker without a handler dies of the
      // SIGUSR1/SIGTERM that is also on its way to us. Not an application failure.
      spdlog::info("worker(s) killed by {}: waiting for the agent's own copy of the signal",
                   signal_name(failures.front().signal));
      return states::CheckpointStop{std::move(*stop), std::move(seen)};
    }
    if (!failures.empty()) return states::Failed{std::move(failures)};
    if (checkpointed)
      return states::CheckpointStop{
          {FailureClass::TimeLimit, 0,
           fmt::format("a worker exited {} (checkpointed)", elastrun::control::kCheckpointedExitCode)},
          std::move(seen)};
    if (group_->all_exited()) return states::Succeeded{};
    if (auto stop = stop_requested_elsewhere()) return states::CheckpointStop{std::move(*stop), std::move(seen)};
    watch_for_hangs();
    watch_stragglers();
    if (auto unhealthy = watch_node_health()) return exit_with(*unhealthy);
    if (scale_up) return states::MembershipChanged{*scale_up};
    if (const Change change = wait_for_change(o_.monitor_interval); change != Change::None) {
      // A node waiting to join: first one more look at our workers -- when they have just finished,
      // the job is done (SUCCEEDED: the others' exit barrier waits for us), not to be re-formed.
      if (change != Change::MemberWaiting) return states::MembershipChanged{change};
      scale_up = change;
    }
  }
}

// FAILED: a local worker failed. next_failed_action() decides, from what the agent observes
// (a membership change seen while the members confirm they are alive, the round's restart claim, the job-wide
// restart count), whether this is a restart, a re-form, or the end. The other local workers
// keep running until then.
Transition Agent::failed(states::Failed entered) {
  for (const auto& e : entered.failures) record(e);
  health_due_ = true;  // before this node joins again
  log_state("FAILED", failures_.last().one_line());
  FailedObservation seen;
  seen.max_restarts = o_.max_restarts;
  // Before counting: did a peer node die? (Its workers' death breaks ours within ~0.1 s; an etcd
  // lease tells of it seconds later.) Every member answers within about one of its
  // --monitor-interval; a loss or another agent's new round seen meanwhile ends the wait too. This
  // replaces a fixed settle window (0.3 s until #28): it waits for what it needs to know, no longer.
  auto confirmation = rdzv_->confirm_members(o_.heartbeat_timeout);
  seen.settle_change = note_change(confirmation.change);
  seen.unconfirmed = std::move(confirmation.unconfirmed);
  for (const auto& node : seen.unconfirmed)
    events().emit(contract::event::kMemberLost, {{"member", node}, {"how", "unconfirmed"}});
  collect_exits();  // the other local workers may have failed meanwhile
  auto action = next_failed_action(seen);
  for (; action == FailedAction::ClaimRestart || action == FailedAction::CountRestart;
       action = next_failed_action(seen)) {
    if (action == FailedAction::ClaimRestart)
      seen.claims = rdzv_->add_to_counter(fmt::format("restart-claim/{}", rdzv_->current().generation), 1);
    else
      seen.restarts = rdzv_->add_to_counter("restarts", 1);
  }
  Change change = seen.settle_change;
  events().emit(contract::event::kFailureDecision, {{"action", to_string(action)},
                                                    {"settle_change", to_string(seen.settle_change)},
                                                    {"restarts", seen.restarts.value_or(-1)},
                                                    {"max_restarts", o_.max_restarts}});
  switch (action) {
    case FailedAction::ExitClosed:  // someone gave up: stop, report, exit with the close reason
      break;
    case FailedAction::ReformUncounted:
      record_losses(seen, entered.failures);
      if (!seen.unconfirmed.empty())
        spdlog::warn(
            "node(s) {} did not confirm within {} ms that their agents are alive: lost; the failure is "
            "not counted against --max-restarts",
            fmt::join(seen.unconfirmed, ", "), o_.heartbeat_timeout.count());
      else
        spdlog::info("the failure coincides with a membership change ({}): not counted against --max-restarts",
                     to_string(change));
      break;
    case FailedAction::AwaitClaimer:
      // Wait for the claimer's decision: a new round (Reform) or the budget used up (Closed).
      spdlog::info("the failure coincides with a restart of this round counted by another agent: not counted again");
      change = wait_for_change(kClaimerPatience);
      break;
    case FailedAction::GiveUp: {
      // tell the other agents first, then stop our workers
      const auto reason = close_reason(JobOutcome::Failed, fmt::format("{} (--max-restarts={} used up)",
                                                                       failures_.first().one_line(), o_.max_restarts));
      try {
        rdzv_->publish("requeue-request", to_string(FailureClass::App));  // for group rank 0
      } catch (const std::exception& e) {
        spdlog::warn("warning: publishing the requeue request: {}", e.what());
      }
      rdzv_->close(reason);
      spdlog::info("stopping local workers (grace {} ms)", o_.stop_grace.count());
      stop_workers(o_.stop_grace);
      print_summary();
      requeue_failed_job();
      spdlog::error("error: giving up after {} restart(s): {}", *seen.restarts - 1, failures_.last().one_line());
      return exit_with(1);
    }
    case FailedAction::Restart:
      rdzv_->request_new_round();  // everyone else sees Reform at once
      log_state("RESTART", fmt::format("restart {} of {} (job-wide)", *seen.restarts, o_.max_restarts));
      break;
    case FailedAction::ClaimRestart:
    case FailedAction::CountRestart: break;  // consumed by the loop above
  }
  spdlog::info("stopping local workers (grace {} ms)", o_.stop_grace.count());
  stop_workers(o_.stop_grace);
  if (change == Change::Closed) {
    try {
      rdzv_->next_round();
    } catch (const RendezvousClosed& e) {
      print_summary();
      requeue_failed_job();
      return exit_with(closed_exit(e));
    }
  }
  return states::Rendezvous{};
}

// MEMBERSHIP_CHANGED: a member was lost, one waits to join, or another agent asked for a new
// round: stop the workers (after a scale-up checkpoint when a node joins) and re-form.
Transition Agent::membership_changed(states::MembershipChanged entered) {
  log_state("MEMBERSHIP_CHANGED",
            entered.change == Change::Closed
                ? std::string("rendezvous closed by another agent: stopping workers")
                : fmt::format("{}: stopping workers, re-forming (no restart counted)", to_string(entered.change)));
  if (entered.change == Change::MemberWaiting && o_.scale_up_checkpoint) checkpoint_before_scale_up();
  // Another agent restarts the round for a failure -- possibly ours: a worker that failed before
  // we saw the request (its error file's message) goes into the job-wide report, as in FAILED.
  if (entered.change == Change::Reform && group_) collect_exits();
  // The store lost (a cut link, or its host gone): while the workers stop, try it again at once, so
  // that after a short cut the others find this node alive when they re-form.
  std::future<void> reconnecting;
  if (entered.change == Change::StoreLost)
    reconnecting = std::async(std::launch::async, [this] {
      try {
        rdzv_->reconnect_to_the_same_store();
      } catch (const std::exception& e) {
        spdlog::warn("warning: reconnecting to the rendezvous store: {}", e.what());
      }
    });
  stop_workers(o_.stop_grace);
  if (reconnecting.valid()) reconnecting.get();
  return states::Rendezvous{};
}

// SUCCEEDED: every local worker exited 0; wait for the other nodes, then group rank 0 closes.
Transition Agent::succeeded() {
  if (group_) stop_workers(Millis(0));  // all exited; drains the output relay
  log_state("SUCCEEDED", fmt::format("all {} local worker(s) exited 0; exit barrier", o_.nproc_per_node));
  bool passed = false;
  try {
    passed = rdzv_->barrier("exit", o_.exit_barrier_timeout);
  } catch (const std::exception& e) {
    spdlog::warn("warning: exit barrier: {}", e.what());
  }
  if (!passed)
    spdlog::warn("warning: not every node reached the exit barrier within {} s",
                 o_.exit_barrier_timeout.count() / 1000);
  if (rdzv_->current().group_rank == 0) {
    write_outcome(JobOutcome::Succeeded, 0);
    try {
      rdzv_->close(close_reason(JobOutcome::Succeeded));
    } catch (const std::exception& e) {
      spdlog::warn("warning: closing the rendezvous: {}", e.what());
    }
  }
  spdlog::info("done; exiting 0");
  return exit_with(0);
}

// ---- helpers of the states ---------------------------------------------------------------------

// A fresh control channel per attempt: a new attempt never sees an old request.
void Agent::open_control_channel(const fs::path& attempt_dir) {
  fs::create_directories(attempt_dir);
  control_path_ = (attempt_dir / "control").string();
  control_sequence_ = 0;
  std::error_code ec;
  fs::remove(control_path_ + elastrun::control::kSeenSuffix, ec);
  write_control(elastrun::control::Request::None);
}

void Agent::write_control(elastrun::control::Request request) {
  const elastrun::control::Status status{request,
                                         request == elastrun::control::Request::None ? 0 : ++control_sequence_};
  if (!write_control_file(control_path_, status))
    throw std::system_error(errno, std::generic_category(), "writing the control file " + control_path_);
}

std::vector<WorkerExit> Agent::stop_workers(Millis grace) {
  auto exits = group_->stop(grace);
  for (const auto& e : exits) record_exit(e);
  group_.reset();
  signals_.set_workers_active(false);
  return exits;
}

std::vector<WorkerExit> Agent::collect_exits(bool record_failures) {
  auto exits = group_->poll_exits();
  for (const auto& e : exits) {
    record_exit(e);
    switch (classify(e)) {
      case ExitKind::Finished: spdlog::info("worker {} exited 0", e.global_rank); break;
      case ExitKind::Checkpointed: spdlog::info("worker {} exited {}: checkpointed", e.global_rank, e.exit_code); break;
      case ExitKind::Failed:
        if (record_failures) record(e);
        break;
    }
  }
  return exits;
}

void Agent::record(const WorkerExit& e) {
  const auto local = static_cast<std::size_t>(e.local_rank);
  const std::string error_file = local < error_files_.size() ? error_files_[local] : std::string();
  auto failure = failure_from_exit(e, plan_.me.node_name, static_cast<int>(restart_count_), error_file);
  if (auto it = killed_by_us_.find(e.pid); it != killed_by_us_.end()) {
    failure.watchdog = it->second.first;
    failure.stacks = it->second.second;
  }
  failures_.add(std::move(failure), *rdzv_, fmt::format("{}.{}", plan_.me.node_name, plan_.me.pid), e.pid);
}

// MONITOR, every tick: a torch FileTimer that expired gets its signal sent to its process (as
// torchrun's FileTimerServer does); with --hang-timeout, a worker whose progress file is older
// than the timeout gets its stacks dumped, then SIGKILL (its process group) -- the exit is then
// a failure like any other (restart within --max-restarts), its report naming why and the stacks.
void Agent::watch_for_hangs() {
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  if (file_timer_) {
    for (const auto& t : file_timer_->poll(now)) {
      if (t.signal <= 0) {
        spdlog::warn("pid {}: FileTimer '{}' expired (no signal asked for: left running)", t.pid, t.scope);
        continue;
      }
      spdlog::warn("pid {}: FileTimer '{}' expired: sending it {}", t.pid, t.scope, signal_name(t.signal));
      killed_by_us_[t.pid] = {fmt::format("its torch FileTimer '{}' expired", t.scope), ""};
      events().emit(contract::event::kTimerExpired,
                    {{"pid", t.pid}, {"scope", t.scope}, {"signal", signal_name(t.signal)}});
      if (::kill(t.pid, t.signal) != 0 && errno != ESRCH)
        spdlog::warn("warning: kill({}, {}): {}", t.pid, t.signal, std::strerror(errno));
    }
  }
  if (o_.hang_timeout.count() <= 0 || now < next_hang_check_ || !group_) return;
  next_hang_check_ = now + 1.0;
  const double timeout = std::chrono::duration<double>(o_.hang_timeout).count();
  const auto pids = group_->pids();
  for (std::size_t local = 0; local < pids.size(); ++local) {
    const pid_t pid = pids[local];
    if (pid <= 0 || killed_by_us_.contains(pid) || ::kill(pid, 0) != 0) continue;
    struct stat info {};
    std::optional<double> last;
    if (::stat(progress_file(attempt_dir_, static_cast<int>(local)).c_str(), &info) == 0)
      last = static_cast<double>(info.st_mtim.tv_sec) + static_cast<double>(info.st_mtim.tv_nsec) * 1e-9;
    if (!is_hung(last, now, timeout)) continue;
    const int rank = rdzv_->current().rank_offset + static_cast<int>(local);
    const auto last_step = read_progress_step(progress_file(attempt_dir_, static_cast<int>(local)).string());
    spdlog::warn(
        "rank {} (pid {}) made no progress for {:.0f} s{} (--hang-timeout): dumping its stacks, then "
        "restarting the group",
        rank, pid, now - *last, last_step ? fmt::format(" after step {}", *last_step) : "");
    std::string stacks = native_stacks(pid, 30);
    // Python workers that called elastrun_control.progress() registered faulthandler on this signal
    const auto python_file = python_stacks_file(attempt_dir_, static_cast<int>(local));
    if (::kill(pid, python_stacks_signal()) == 0) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      std::ifstream in(python_file);
      std::stringstream text;
      text << in.rdbuf();
      if (!text.str().empty()) stacks += "python stacks (faulthandler):\n" + text.str();
    }
    const auto stacks_path = attempt_dir_ / std::to_string(local) / "stacks.txt";
    std::ofstream(stacks_path) << stacks;
    for (std::string_view rest = stacks; !rest.empty();) {  // into the agent's log too, line by line
      const auto nl = rest.find('\n');
      spdlog::warn("  [rank {} stacks] {}", rank, rest.substr(0, nl));
      rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
    }
    killed_by_us_[pid] = {fmt::format("no progress for {:.0f} s (--hang-timeout {:g}); stacks in {}", now - *last,
                                      timeout, stacks_path.string()),
                          stacks.substr(0, 16384)};
    events().emit(contract::event::kHang, {{"rank", rank},
                                           {"pid", pid},
                                           {"since_progress_s", now - *last},
                                           {"last_step", last_step ? nlohmann::json(*last_step) : nlohmann::json()},
                                           {"stacks", stacks_path.string()}});
    ::kill(-pid, SIGKILL);  // its process group (workers lead their own)
    ::kill(pid, SIGKILL);
    return;  // one at a time: its failure stops and restarts the others
  }
}

int Agent::closed_exit(const RendezvousClosed& closed) {
  const int rc = exit_code_of(outcome_of_close(closed.reason()));
  spdlog::info("{}; exiting {}", closed.what(), rc);
  return rc;
}

void Agent::log_state(std::string_view name, const std::string& what) {
  {
    runtime_.update_status([&](NodeRuntime::Status& s) {
      s.state = name;
      if (!group_) s.worker_pids.clear();
    });
  }
  spdlog::info("state {}{}{}", name, what.empty() ? "" : " ", what);
  events().emit(contract::event::kState, {{"state", name}, {"detail", what}});
}

// srun's exit code is not the job's outcome when Slurm ended tasks on nodes that left the job (a
// shrink, scontrol update NumNodes): the batch script reads this file instead (sbatch/*.sbatch).
void Agent::write_outcome(JobOutcome outcome, int exit_code) {
  if (o_.outcome_file.empty()) return;
  const char* name = outcome == JobOutcome::Succeeded      ? "succeeded"
                     : outcome == JobOutcome::Checkpointed ? "checkpointed"
                                                           : "failed";
  const nlohmann::json j = {
      {"outcome", name}, {"exit_code", exit_code}, {"run_id", plan_.run_id}, {"node", plan_.me.node_name}};
  const auto text = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  const std::string tmp = o_.outcome_file + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text << "\n";
    if (!out) {
      spdlog::warn("warning: cannot write the outcome file {}", tmp);
      return;
    }
  }
  std::error_code ec;
  fs::rename(tmp, o_.outcome_file, ec);
  if (ec) spdlog::warn("warning: cannot rename {} to {}: {}", tmp, o_.outcome_file, ec.message());
}

// A lost member that explains local worker failures is their root cause: recorded (and
// published for the job-wide summary) just before the first of them.
void Agent::record_losses(const FailedObservation& seen, const std::vector<WorkerExit>& failures) {
  if (failures.empty()) return;
  auto first = std::min_element(failures.begin(), failures.end(), [](const auto& a, const auto& b) {
                 return a.when < b.when;
               })->when;
  first -= Millis(1);
  const auto agent_key = fmt::format("{}.{}", plan_.me.node_name, plan_.me.pid);
  for (const auto& node : seen.unconfirmed)
    failures_.add_loss(node,
                       fmt::format("its agent did not answer within {} ms of worker failures on {}",
                                   o_.heartbeat_timeout.count(), plan_.me.node_name),
                       first, *rdzv_, agent_key);
  if (seen.settle_change == Change::MemberLost && rdzv_->last_loss()) {
    const auto& loss = *rdzv_->last_loss();
    failures_.add_loss(loss.node_name,
                       loss.how.empty() ? std::string("its agent's lease ended")
                                        : fmt::format("its agent's lease ended ({})", loss.how),
                       first, *rdzv_, agent_key);
  }
}

// Every wait for a membership change goes through here, so that each member lost is in the
// event log whichever state noticed it (MONITOR, FAILED's confirmation, the scale-up checkpoint).
Change Agent::wait_for_change(Millis timeout) { return note_change(rdzv_->wait_for_change(timeout)); }

Change Agent::note_change(Change change) {
  if (change == Change::MemberLost && rdzv_->last_loss()) {
    const auto& loss = *rdzv_->last_loss();
    nlohmann::ordered_json fields = {{"member", loss.node_name}, {"how", loss.how}};
    if (loss.since_heartbeat_ms) fields["since_heartbeat_ms"] = *loss.since_heartbeat_ms;
    events().emit(contract::event::kMemberLost, fields);
  } else if (change == Change::StoreLost) {
    // the store's host (often group rank 0's node) is gone: its member keys went with it
    const auto& node = rdzv_->store_node().empty() ? plan_.store_host : rdzv_->store_node();
    events().emit(contract::event::kStoreLost, {{"store_node", node}});
  }
  return change;
}

void Agent::record_exit(const WorkerExit& e) {
  events().emit(contract::event::kWorkerExit, {{"rank", e.global_rank},
                                               {"local_rank", e.local_rank},
                                               {"pid", e.pid},
                                               {"exit_code", e.exit_code},
                                               {"signal", e.signal ? signal_name(e.signal) : ""}});
}

}  // namespace elastrun::launcher
