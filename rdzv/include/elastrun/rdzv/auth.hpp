// Who may join a rendezvous: only processes of the job's user.
//   munge: a MUNGE credential whose payload is the run id, decoded by the server, which accepts
//          it only if its uid is the server's own (munged's replay check stops reuse);
//   token: a shared secret (ELASTRUN_RDZV_TOKEN), compared in constant time;
//   none:  anyone who can reach the port (trusted networks, tests); only when asked for.
// The default, "auto", never means none (resolve_auth): a token the user gave, else a token the
// store host generates when every agent runs on this host, else munge, else an error.
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
  std::string token_file;    // the generated token's file (resolve_auth on one host), else empty
};

class AuthError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Parses --rdzv-auth (munge|token|none|auto). "token" reads ELASTRUN_RDZV_TOKEN (or the file
// named by ELASTRUN_RDZV_TOKEN_FILE). The munge socket is ELASTRUN_MUNGE_SOCKET, else Slurm's
// AuthInfo=socket=... from $SLURM_CONF, else libmunge's default. Throws AuthError.
AuthConfig auth_from_option(std::string_view option);

// Where a rendezvous runs, as --rdzv-auth=auto needs to know it.
struct AuthScope {
  std::string run_id;
  bool one_host = false;  // every agent is on this host: standalone, a loopback endpoint, a 1-node step
};

// --rdzv-auth as the agent uses it. "auto": a token from ELASTRUN_RDZV_TOKEN,
// ELASTRUN_RDZV_TOKEN_FILE or SLURM_ELASTRUN_TOKEN if set; else, on one host, a random token in
// a 0600 file in a 0700 directory of the user (token_file_path): the run's first agent creates
// it, the others read it, the store host removes it at the end; else munge if munged answers;
// else AuthError saying how to choose. Other options as auth_from_option. Throws AuthError.
AuthConfig resolve_auth(std::string_view option, const AuthScope& scope);

// The file that holds a run's generated token: $TMPDIR (else /tmp)/elastrun-<uid>/rdzv-<run>.token.
std::string token_file_path(std::string_view run_id);

// Client side: the credential to present in Hello. Throws AuthError (e.g. munged unreachable).
std::string make_credential(const AuthConfig& config, std::string_view run_id);

// Server side: std::nullopt if accepted, else a one-line reason for the log and the client.
std::optional<std::string> check_credential(const AuthConfig& config, std::string_view kind,
                                            std::string_view credential, std::string_view run_id);

// The socket named by "AuthInfo=...socket=PATH..." in a slurm.conf, if any.
std::string munge_socket_from_slurm_conf(const std::string& slurm_conf_path);

}  // namespace elastrun::rdzv
