// The agent's signals, behind one object. They are blocked in every thread (start() runs before
// any other thread exists) and taken by one thread with sigwait, which decides with
// decide_signal() below:
//  - SIGINT/SIGHUP/SIGQUIT stop: while workers run, the monitor loop stops them (SIGTERM, grace,
//    SIGKILL) and the agent exits 128+sig; with no workers (rendezvous, exit barrier) the agent
//    exits at once.
//  - SIGUSR1/SIGUSR2 (Slurm's --signal time-limit warning) and SIGTERM (preemption) ask the
//    workers to checkpoint and stop through the control channel (state CHECKPOINT_STOP); once
//    that is under way, further ones (e.g. Slurm's SIGTERM after our own requeue) are only logged.
//  - While group rank 0 of the last round re-forms (no workers run), a time-limit or preemption
//    signal cannot reach any worker: the newest checkpoint stands, so that agent requeues the job
//    from the signal thread (the armed rendezvous requeuer) before exiting.
#pragma once

#include <atomic>
#include <functional>

namespace elastrun::launcher {

// SIGUSR1, SIGUSR2, SIGTERM: "checkpoint and stop", not "stop now".
bool is_checkpoint_signal(int sig);

// What the signal thread does with one signal, given the agent's state when it arrives.
enum class SignalAction {
  Ignore,           // a checkpoint signal while already stopping for a checkpoint: logged only
  Exit,             // no workers run: exit 128+sig at once
  RequeueThenExit,  // no workers, group rank 0 re-forming: requeue the job, then exit 128+sig
  CheckpointStop,   // workers run: ask them to checkpoint and stop
  Stop,             // workers run: stop them
};
struct SignalContext {
  bool checkpoint_stopping = false;
  bool workers_active = false;
  bool requeuer_armed = false;
};
SignalAction decide_signal(int sig, const SignalContext& context);

class AgentSignals {
 public:
  AgentSignals() = default;
  AgentSignals(const AgentSignals&) = delete;
  AgentSignals& operator=(const AgentSignals&) = delete;

  // Blocks the agent's signals in the calling thread (so in every thread started later) and
  // starts the sigwait thread. Call once, before any other thread starts; the object must
  // outlive the process's last use of it (the thread is detached: make it static).
  void start();

  int stop_signal() const { return stop_signal_.load(); }              // 0: none
  int checkpoint_signal() const { return checkpoint_signal_.load(); }  // first one, 0: none
  void set_workers_active(bool on) { workers_active_ = on; }
  void set_checkpoint_stopping(bool on) { checkpoint_stopping_ = on; }

  // What the signal thread calls for RequeueThenExit (with the signal). Set once, before the
  // first arm; it runs on the signal thread while the main thread may be inside the rendezvous.
  void set_rendezvous_requeuer(std::function<void(int)> requeue) { requeuer_ = std::move(requeue); }

  // Arms the rendezvous requeuer for its lifetime (around one next_round(), on group rank 0).
  class RendezvousRequeue {
   public:
    RendezvousRequeue(AgentSignals& signals, bool on) : signals_(signals) {
      signals_.requeuer_armed_.store(on, std::memory_order_release);
    }
    ~RendezvousRequeue() { signals_.requeuer_armed_.store(false, std::memory_order_release); }
    RendezvousRequeue(const RendezvousRequeue&) = delete;
    RendezvousRequeue& operator=(const RendezvousRequeue&) = delete;

   private:
    AgentSignals& signals_;
  };

 private:
  void handle(int sig);

  std::atomic<int> stop_signal_{0};
  std::atomic<int> checkpoint_signal_{0};
  std::atomic<bool> workers_active_{false};
  std::atomic<bool> checkpoint_stopping_{false};
  std::atomic<bool> requeuer_armed_{false};
  std::function<void(int)> requeuer_;
};

}  // namespace elastrun::launcher
