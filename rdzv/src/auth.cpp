#include "elastrun/rdzv/auth.hpp"

#include <fmt/format.h>
#include <munge.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>

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

std::string read_token() {
  if (const char* t = std::getenv("ELASTRUN_RDZV_TOKEN"); t && *t) return t;
  if (const char* path = std::getenv("ELASTRUN_RDZV_TOKEN_FILE"); path && *path) {
    std::ifstream in(path);
    std::string token;
    if (!in || !std::getline(in, token) || token.empty())
      throw AuthError(fmt::format("ELASTRUN_RDZV_TOKEN_FILE={} cannot be read or is empty", path));
    return token;
  }
  throw AuthError("--rdzv-auth=token needs ELASTRUN_RDZV_TOKEN or ELASTRUN_RDZV_TOKEN_FILE");
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
  if (option == "munge" || option == "auto") {
    config.kind = AuthKind::Munge;
    try {
      make_credential(config, "probe");  // is munged there?
    } catch (const AuthError&) {
      if (option == "munge") throw;
      config.kind = AuthKind::None;
    }
    return config;
  }
  throw AuthError(fmt::format("--rdzv-auth={} is not one of munge, token, none, auto", option));
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
