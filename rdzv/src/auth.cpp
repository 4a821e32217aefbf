#include "elastrun/rdzv/auth.hpp"

#include <fmt/format.h>
#include <fcntl.h>
#include <munge.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>

#include "elastrun/util/random.hpp"
#include "elastrun/util/unique_fd.hpp"

namespace elastrun::rdzv {
namespace {

struct MungeCtxDeleter {
  void operator()(munge_ctx_t ctx) const { munge_ctx_destroy(ctx); }
};
using MungeCtx = std::unique_ptr<std::remove_pointer_t<munge_ctx_t>, MungeCtxDeleter>;

MungeCtx munge_context(const AuthConfig& config) {
  MungeCtx ctx(munge_ctx_create());
  if (!ctx) throw AuthError("cannot create a MUNGE context (out of memory)");
  if (!config.munge_socket.empty() &&
      munge_ctx_set(ctx.get(), MUNGE_OPT_SOCKET, config.munge_socket.c_str()) != EMUNGE_SUCCESS)
    throw AuthError(fmt::format("cannot use MUNGE socket {}: {}", config.munge_socket, munge_ctx_strerror(ctx.get())));
  return ctx;
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

bool constant_time_equal(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  return diff == 0;
}

// A token the user gave: ELASTRUN_RDZV_TOKEN, the first line of ELASTRUN_RDZV_TOKEN_FILE, or
// SLURM_ELASTRUN_TOKEN (what the SPANK plugin puts into a step's tasks); nullopt if none is set.
std::optional<std::string> user_token() {
  if (const char* t = std::getenv("ELASTRUN_RDZV_TOKEN"); t && *t) return t;
  if (const char* path = std::getenv("ELASTRUN_RDZV_TOKEN_FILE"); path && *path) {
    std::ifstream in(path);
    std::string token;
    if (!in || !std::getline(in, token) || token.empty())
      throw AuthError(fmt::format("ELASTRUN_RDZV_TOKEN_FILE={} cannot be read or is empty", path));
    return token;
  }
  if (const char* t = std::getenv("SLURM_ELASTRUN_TOKEN"); t && *t) return t;
  return std::nullopt;
}

std::string read_token() {
  if (auto token = user_token()) return *token;
  throw AuthError("--rdzv-auth=token needs ELASTRUN_RDZV_TOKEN or ELASTRUN_RDZV_TOKEN_FILE");
}

// The user's private directory for token files: created 0700, and refused if it is anything
// but a directory of ours that nobody else can enter (another user could have made it first).
// $TMPDIR (else /tmp)/elastrun-<uid>: where the generated tokens live.
std::string token_directory() {
  const char* tmp = std::getenv("TMPDIR");
  return fmt::format("{}/elastrun-{}", tmp && *tmp ? tmp : "/tmp", ::getuid());
}

std::string private_token_dir() {
  const std::string dir = token_directory();
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw AuthError(fmt::format("cannot create {} for the rendezvous token: {}", dir, std::strerror(errno)));
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) throw AuthError(fmt::format("cannot inspect {}: {}", dir, std::strerror(errno)));
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::getuid() || (st.st_mode & 077) != 0)
    throw AuthError(
        fmt::format("{} is not a private directory of yours (owner uid {}, mode {:o}); remove it or set TMPDIR", dir,
                    st.st_uid, st.st_mode & 07777));
  return dir;
}

// The token of `run_id` on this host: the first agent of the run to get here creates it (a random
// secret in a 0600 file, published atomically with link(2), which never replaces a file); every
// later one reads it. A file left by a crashed run of the same id is simply reused: it is as
// private as a new one.
std::string shared_token(std::string_view run_id) {
  private_token_dir();
  const auto path = token_file_path(run_id);
  const auto temp = fmt::format("{}.{}", path, ::getpid());
  {
    util::UniqueFd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!fd) throw AuthError(fmt::format("cannot write the rendezvous token {}: {}", temp, std::strerror(errno)));
    const auto line = util::random_hex(24) + "\n";
    const bool written = ::write(fd.get(), line.data(), line.size()) == static_cast<ssize_t>(line.size());
    const int err = errno;
    if (!written || ::link(temp.c_str(), path.c_str()) != 0) {
      const int why = written ? errno : err;
      ::unlink(temp.c_str());
      if (why != EEXIST)
        throw AuthError(fmt::format("cannot write the rendezvous token {}: {}", path, std::strerror(why)));
    }
    ::unlink(temp.c_str());
  }
  util::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  struct stat st {};
  if (!fd || ::fstat(fd.get(), &st) != 0 || st.st_uid != ::getuid() || (st.st_mode & 077) != 0)
    throw AuthError(fmt::format("{} is not a private file of yours; remove it", path));
  char buf[256];
  const ssize_t n = ::read(fd.get(), buf, sizeof buf);
  std::string token(buf, n > 0 ? static_cast<std::size_t>(n) : 0);
  if (auto nl = token.find('\n'); nl != std::string::npos) token.resize(nl);
  if (token.empty()) throw AuthError(fmt::format("the rendezvous token {} is empty; remove it", path));
  return token;
}

}  // namespace

std::string_view to_string(AuthKind kind) {
  switch (kind) {
    case AuthKind::None: return "none";
    case AuthKind::Token: return "token";
    case AuthKind::Munge: return "munge";
  }
  return "unknown";
}

std::string munge_socket_from_slurm_conf(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("AuthInfo=", 0) != 0) continue;
    auto pos = line.find("socket=");
    if (pos == std::string::npos) continue;
    auto end = line.find_first_of(", \t#", pos);
    return line.substr(pos + 7, end == std::string::npos ? std::string::npos : end - pos - 7);
  }
  return {};
}

AuthConfig auth_from_option(std::string_view option) {
  AuthConfig config;
  if (const char* s = std::getenv("ELASTRUN_MUNGE_SOCKET"); s && *s)
    config.munge_socket = s;
  else if (const char* conf = std::getenv("SLURM_CONF"); conf && *conf)
    config.munge_socket = munge_socket_from_slurm_conf(conf);

  if (option == "none") return config;
  if (option == "token") {
    config.kind = AuthKind::Token;
    config.token = read_token();
    return config;
  }
  if (option == "munge") {
    config.kind = AuthKind::Munge;
    make_credential(config, "probe");  // is munged there?
    return config;
  }
  if (option == "auto")
    throw AuthError("--rdzv-auth=auto depends on where the rendezvous runs: resolve it with resolve_auth()");
  throw AuthError(fmt::format("--rdzv-auth={} is not one of munge, token, none, auto", option));
}

std::string token_file_path(std::string_view run_id) {
  std::string name;
  for (char c : run_id) name.push_back(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' ? c : '_');
  return fmt::format("{}/rdzv-{}.token", token_directory(), name);
}

AuthConfig resolve_auth(std::string_view option, const AuthScope& scope) {
  if (option != "auto") return auth_from_option(option);
  AuthConfig config = auth_from_option("none");  // the munge socket, kind None for now
  if (auto token = user_token()) {
    config.kind = AuthKind::Token;
    config.token = std::move(*token);
    return config;
  }
  if (scope.one_host) {
    config.kind = AuthKind::Token;
    config.token = shared_token(scope.run_id);
    config.token_file = token_file_path(scope.run_id);
    return config;
  }
  config.kind = AuthKind::Munge;
  try {
    make_credential(config, "probe");  // is munged there?
    return config;
  } catch (const AuthError& e) {
    throw AuthError(fmt::format(
        "--rdzv-auth=auto: this rendezvous spans several hosts and MUNGE is not available ({}); start munged, or "
        "give every agent the same secret in ELASTRUN_RDZV_TOKEN (or ELASTRUN_RDZV_TOKEN_FILE), or pass "
        "--rdzv-auth=none on a network you trust",
        e.what()));
  }
}

std::string make_credential(const AuthConfig& config, std::string_view run_id) {
  switch (config.kind) {
    case AuthKind::None: return {};
    case AuthKind::Token: return config.token;
    case AuthKind::Munge: {
      auto ctx = munge_context(config);
      char* raw = nullptr;
      auto rc = munge_encode(&raw, ctx.get(), run_id.data(), static_cast<int>(run_id.size()));
      std::unique_ptr<char, FreeDeleter> cred(raw);
      if (rc != EMUNGE_SUCCESS)
        throw AuthError(fmt::format(
            "MUNGE credential failed ({}){}; is munged running? or use "
            "--rdzv-auth=token",
            munge_ctx_strerror(ctx.get()), config.munge_socket.empty() ? "" : " on " + config.munge_socket));
      return cred.get();
    }
  }
  return {};
}

std::optional<std::string> check_credential(const AuthConfig& config, std::string_view kind,
                                            std::string_view credential, std::string_view run_id) {
  if (kind != to_string(config.kind) && config.kind != AuthKind::None)
    return fmt::format("client offered '{}' authentication, this store requires '{}'", kind, to_string(config.kind));
  switch (config.kind) {
    case AuthKind::None: return std::nullopt;
    case AuthKind::Token:
      if (!constant_time_equal(credential, config.token)) return std::string("wrong token");
      return std::nullopt;
    case AuthKind::Munge: {
      MungeCtx ctx;
      try {
        ctx = munge_context(config);
      } catch (const AuthError& e) {
        return e.what();
      }
      void* raw = nullptr;
      int len = 0;
      uid_t uid = 0;
      gid_t gid = 0;
      const std::string cred(credential);
      auto rc = munge_decode(cred.c_str(), ctx.get(), &raw, &len, &uid, &gid);
      std::unique_ptr<void, FreeDeleter> payload(raw);
      if (rc != EMUNGE_SUCCESS) return fmt::format("MUNGE credential rejected: {}", munge_ctx_strerror(ctx.get()));
      if (uid != getuid())
        return fmt::format("MUNGE credential of uid {} but the job belongs to uid {}", uid, getuid());
      std::string_view got(static_cast<const char*>(payload.get()), static_cast<std::size_t>(len));
      if (got != run_id)
        return fmt::format("MUNGE credential for run '{}' but this store serves run '{}'", got, run_id);
      return std::nullopt;
    }
  }
  return std::string("unknown authentication kind");
}

}  // namespace elastrun::rdzv
