// Removing the per-step state of --elastic (the agents' --log-dir: error files) from
// slurmstepd (step end, remote.cpp) and from the job epilog (slurmd.cpp). Both may run as root;
// the tree is writable by the job's user, so it is never walked as root (a user could swap a
// directory for a symlink meanwhile): a child drops to the user and execs rm.
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "common.hpp"

namespace elastrun::spank {

void remove_user_tree(const std::string& path, uid_t uid, gid_t gid) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno != ENOENT) log_error("cannot inspect {}: {}", path, std::strerror(errno));
    return;
  }
  if (!S_ISDIR(st.st_mode) || st.st_uid != uid) {
    log_error("not removing {}: not a directory owned by uid {}", path, uid);
    return;
  }
  if (::geteuid() == uid) {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
    if (ec)
      log_error("cannot remove {}: {}", path, ec.message());
    else
      log_debug("removed {}", path);
    return;
  }
  if (::geteuid() != 0) {
    log_error("not removing {}: it belongs to uid {} and this process runs as uid {}", path, uid, ::geteuid());
    return;
  }
  // Everything the child needs is prepared before fork (the parent may be multi-threaded).
  const char* argv[] = {"/bin/rm", "-rf", "--one-file-system", "--", path.c_str(), nullptr};
  const pid_t pid = ::fork();
  if (pid < 0) {
    log_error("cannot remove {}: fork: {}", path, std::strerror(errno));
    return;
  }
  if (pid == 0) {
    sigset_t none;  // slurmstepd blocks signals; do not pass that on
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (::setgroups(0, nullptr) != 0 || ::setresgid(gid, gid, gid) != 0 || ::setresuid(uid, uid, uid) != 0) _exit(126);
    ::execv(argv[0], const_cast<char* const*>(argv));
    _exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      log_error("waitpid(rm {}): {}", path, std::strerror(errno));
      return;
    }
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    log_error("removing {} as uid {} failed (status {})", path, uid, status);
  else
    log_debug("removed {}", path);
}

}  // namespace elastrun::spank
