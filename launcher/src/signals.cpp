#include "signals.hpp"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <system_error>
#include <thread>

#include <spdlog/spdlog.h>

#include "metrics.hpp"
#include "workers.hpp"

namespace elastrun::launcher {
namespace {

sigset_t agent_signal_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2}) sigaddset(&set, sig);
  return set;
}

}  // namespace

bool is_checkpoint_signal(int sig) { return sig == SIGUSR1 || sig == SIGUSR2 || sig == SIGTERM; }

SignalAction decide_signal(int sig, const SignalContext& c) {
  const bool checkpoint = is_checkpoint_signal(sig);
  if (checkpoint && c.checkpoint_stopping) return SignalAction::Ignore;
  if (!c.workers_active) return checkpoint && c.requeuer_armed ? SignalAction::RequeueThenExit : SignalAction::Exit;
  return checkpoint ? SignalAction::CheckpointStop : SignalAction::Stop;
}

void AgentSignals::start() {
  sigset_t set = agent_signal_set();
  if (int rc = pthread_sigmask(SIG_BLOCK, &set, nullptr); rc != 0)
    throw std::system_error(rc, std::generic_category(), "pthread_sigmask");
  std::thread([this, set] {
    while (true) {
      int sig = 0;
      if (sigwait(&set, &sig) == 0) handle(sig);
    }
  }).detach();
}

void AgentSignals::handle(int sig) {
  const SignalContext context{.checkpoint_stopping = checkpoint_stopping_.load(),
                              .workers_active = workers_active_.load(),
                              .requeuer_armed = requeuer_armed_.load(std::memory_order_acquire)};
  switch (decide_signal(sig, context)) {
    case SignalAction::Ignore:
      spdlog::info("received {}: already stopping for a checkpoint; ignored", signal_name(sig));
      return;
    case SignalAction::RequeueThenExit:
      checkpoint_stopping_ = true;
      spdlog::info("received {} during the rendezvous (no workers running): the last checkpoint stands",
                   signal_name(sig));
      requeuer_(sig);
      [[fallthrough]];
    case SignalAction::Exit:
      spdlog::info("received {}: no workers running; exiting {}", signal_name(sig), 128 + sig);
      spdlog::default_logger()->flush();
      remove_metrics_file_now();  // no destructor runs on this way out
      ::_exit(128 + sig);
    case SignalAction::CheckpointStop: {
      int none = 0;
      checkpoint_signal_.compare_exchange_strong(none, sig);
      spdlog::info("received {}: asking workers to checkpoint and stop", signal_name(sig));
      return;
    }
    case SignalAction::Stop:
      stop_signal_ = sig;
      spdlog::info("received {}: stopping workers", signal_name(sig));
      return;
  }
}

}  // namespace elastrun::launcher
