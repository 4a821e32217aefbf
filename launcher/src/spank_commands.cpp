// The two verbs the SPANK plugin (spank_plugin/, `srun --elastic`) runs this binary for:
//
//   elastrun store-serve --run-id ID [--port P] [--bind ADDR] [--rdzv-auth token|munge|none]
//                        [--ready-fd N] [--lifeline-fd N]
//     The rendezvous store alone, no agent. The plugin forks it from srun (slurm_spank_local_user_init):
//     it writes "<port>\n" to --ready-fd once it listens, and exits on SIGTERM/SIGINT/SIGHUP or
//     when --lifeline-fd reaches end of file (srun, which holds the write end, is gone).
//
//   a task of an `srun --elastic` step: slurmstepd execs this binary in place of the user's program
//     (the plugin's task_init replaced argv[0]) with ELASTRUN_SPANK_PROGRAM = the program's path and
//     ELASTRUN_SPANK_AGENT_ARGS = the agent's flags, one per line. run_spank_task() rebuilds
//     `elastrun FLAGS... PROGRAM ARGS...` and runs the agent.
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <system_error>
#include <vector>

#include "spank_commands.hpp"

#include "agent.hpp"
#include "elastrun/rdzv/auth.hpp"
#include "elastrun/rdzv/store.hpp"

namespace elastrun::launcher {

int run_store_serve(int argc, char** argv) {
  CLI::App app{"Serve the rendezvous store alone (used by the SPANK plugin's srun --elastic).", "elastrun store-serve"};
  rdzv::StoreServerOptions so;
  std::string auth = "token";
  int ready_fd = -1, lifeline_fd = -1;
  app.add_option("--run-id", so.run_id, "run id clients must name")->required();
  app.add_option("--port", so.port, "TCP port (default 0: any free port)");
  // srun's node cannot know which of its addresses the compute nodes reach it at, so 0.0.0.0
  // stays the default here: the store is guarded by its token (munge, or none only if asked).
  app.add_option("--bind", so.bind_address, "address to listen on (default 0.0.0.0)");
  app.add_option("--rdzv-auth", auth, "token|munge|none (default token: $ELASTRUN_RDZV_TOKEN)");
  app.add_option("--ready-fd", ready_fd, "write \"<port>\\n\" here once listening, then close it");
  app.add_option("--lifeline-fd", lifeline_fd, "exit when this descriptor reaches end of file");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    // Signals are taken synchronously (signalfd); block them before the server thread starts.
    sigset_t stop;
    sigemptyset(&stop);
    for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT}) sigaddset(&stop, sig);
    if (sigprocmask(SIG_BLOCK, &stop, nullptr) != 0)
      throw std::system_error(errno, std::generic_category(), "sigprocmask");
    const int sfd = signalfd(-1, &stop, SFD_CLOEXEC);
    if (sfd < 0) throw std::system_error(errno, std::generic_category(), "signalfd");

    so.auth = rdzv::auth_from_option(auth);
    if (so.auth.kind == rdzv::AuthKind::None)
      fmt::print(stderr, "elastrun store-serve: warning: --rdzv-auth=none: anyone who reaches the port may join\n");
    rdzv::StoreServer server(so);
    if (ready_fd >= 0) {
      const std::string line = fmt::format("{}\n", server.port());
      if (::write(ready_fd, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
        throw std::system_error(errno, std::generic_category(), "write --ready-fd");
      ::close(ready_fd);
    }
    while (true) {
      pollfd fds[2] = {{sfd, POLLIN, 0}, {lifeline_fd, POLLIN, 0}};
      const int rc = ::poll(fds, lifeline_fd >= 0 ? 2 : 1, -1);
      if (rc < 0 && errno == EINTR) continue;
      if (rc < 0) throw std::system_error(errno, std::generic_category(), "poll");
      if (fds[0].revents) break;  // a stop signal
      if (lifeline_fd >= 0 && fds[1].revents) {
        char buf[64];
        const ssize_t n = ::read(lifeline_fd, buf, sizeof buf);
        if (n <= 0 && !(n < 0 && errno == EINTR)) break;  // end of file: srun is gone
      }
    }
    ::close(sfd);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "elastrun store-serve: error: {}\n", e.what());
    return 1;
  }
}

int run_spank_task(int argc, char** argv) {
  const char* program = std::getenv("ELASTRUN_SPANK_PROGRAM");
  const char* flags = std::getenv("ELASTRUN_SPANK_AGENT_ARGS");
  if (!program || !*program || !flags) {
    fmt::print(stderr, "elastrun: error: ELASTRUN_SPANK_PROGRAM/ELASTRUN_SPANK_AGENT_ARGS are incomplete\n");
    return 2;
  }
  std::vector<std::string> args{argc > 0 ? argv[0] : "elastrun"};
  for (std::string_view rest = flags; !rest.empty();) {
    const auto nl = rest.find('\n');
    if (auto flag = rest.substr(0, nl); !flag.empty()) args.emplace_back(flag);
    rest = nl == std::string_view::npos ? std::string_view{} : rest.substr(nl + 1);
  }
  args.emplace_back(program);
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  // Neither the workers nor a nested elastrun must see these.
  ::unsetenv("ELASTRUN_SPANK_PROGRAM");
  ::unsetenv("ELASTRUN_SPANK_AGENT_ARGS");
  std::vector<char*> ptrs;
  for (auto& a : args) ptrs.push_back(a.data());
  ptrs.push_back(nullptr);
  return run_agent(static_cast<int>(args.size()), ptrs.data());
}

}  // namespace elastrun::launcher
