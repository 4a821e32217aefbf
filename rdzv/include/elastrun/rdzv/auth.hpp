// Who may join a rendezvous: only processes of the job's user.
//   munge: a MUNGE credential whose payload is the run id, decoded by the server, which accepts
//          it only if its uid is the server's own (munged's replay check stops reuse);
//   token: a shared secret (ELASTRUN_RDZV_TOKEN), compared in constant time;
//   none:  anyone who can reach the port (trusted networks, tests).
// The default, "auto", is munge when munged answers and none otherwise (logged).
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace elastrun::rdzv {

enum class AuthKind { None, Token, Munge };
std::string_view to_string(AuthKind kind);

struct AuthConfig {
  AuthKind kind = AuthKind::None;
  std::string token;         // AuthKind::Token
  std::string munge_socket;  // empty: libmunge's default socket
};

class AuthError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Parses --rdzv-auth (munge|token|none|auto). "token" reads ELASTRUN_RDZV_TOKEN (or the file
// named by ELASTRUN_RDZV_TOKEN_FILE). The munge socket is ELASTRUN_MUNGE_SOCKET, else Slurm's
// AuthInfo=socket=... from $SLURM_CONF, else libmunge's default. Throws AuthError.
AuthConfig auth_from_option(std::string_view option);

// Client side: the credential to present in Hello. Throws AuthError (e.g. munged unreachable).
std::string make_credential(const AuthConfig& config, std::string_view run_id);

// Server side: std::nullopt if accepted, else a one-line reason for the log and the client.
std::optional<std::string> check_credential(const AuthConfig& config, std::string_view kind,
                                            std::string_view credential, std::string_view run_id);

// The socket named by "AuthInfo=...socket=PATH..." in a slurm.conf, if any.
std::string munge_socket_from_slurm_conf(const std::string& slurm_conf_path);

}  // namespace elastrun::rdzv
