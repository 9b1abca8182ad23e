// Bearer tokens for deepnex's gRPC services.
//
// A client sends "authorization: Bearer <token>" in call metadata. A server
// holds a TokenTable mapping each token to an Identity. A missing or unknown
// token is Unauthenticated; a known token without the right role or for
// another job is PermissionDenied.
#ifndef DEEPNEX_AUTH_H_
#define DEEPNEX_AUTH_H_

#include <map>
#include <string>

#include "deepnex/status.h"

namespace deepnex {

// kNode: a deepnex-agent's token; its name is the node's, and it may act
// only as that node (register it, heartbeat, answer central's commands).
enum class AuthRole { kUser, kAdmin, kNode };

struct Identity {
  std::string name;  // user (or job) name
  AuthRole role = AuthRole::kUser;
  std::string job;  // empty: not scoped to a job

  // Whether this identity may act on what belongs to `job` ("": no job).
  bool Reaches(const std::string& other_job) const {
    return job.empty() || job == other_job;
  }
};

// Thread-compatible: build it, then share it read-only.
class TokenTable {
 public:
  // An empty table: every call is allowed (auth disabled).
  TokenTable() = default;

  // One token that grants `role` to `name` (for a job-scoped token, `job`).
  // An empty token, or one with whitespace, gives an empty table (auth
  // disabled): build tables from user input with FromOptions, which checks.
  static TokenTable Single(const std::string& token,
                           const std::string& name = "user",
                           AuthRole role = AuthRole::kUser,
                           const std::string& job = "");
  // Reads a token file. Either a single token on its own (one line; name
  // "user", role user), or lines "TOKEN NAME ROLE [JOB]" with ROLE
  // user|admin|node (a node line has no JOB); a field starting with '#' starts a comment, blank lines are
  // skipped. InvalidArgument naming the file and line (never the token) for a
  // malformed line, and for a file without tokens; AlreadyExists for a
  // duplicate token; NotFound / PermissionDenied when it cannot be opened.
  static absl::StatusOr<TokenTable> FromFile(const std::string& path);
  // Token string and token file are alternatives: both empty gives an empty
  // table, both set is InvalidArgument.
  static absl::StatusOr<TokenTable> FromOptions(const std::string& token,
                                                const std::string& token_file);

  // InvalidArgument for an empty token, a token with whitespace or an empty
  // name; AlreadyExists for a token already in the table.
  absl::Status Add(const std::string& token, Identity identity);
  bool enabled() const { return !tokens_.empty(); }

  // `authorization` is the metadata value ("Bearer <token>"), empty if the
  // call had none; the scheme is case-insensitive. Missing token:
  // Unauthenticated "missing bearer token (authorization metadata); give one
  // with --token, ..."; unknown
  // token: Unauthenticated "invalid token". With `job` non-empty, a token
  // scoped to another job is PermissionDenied naming both jobs (a token
  // without a job may act on any job). With `require_admin`, a user token is
  // PermissionDenied. A node token is PermissionDenied unless `allow_node`
  // (the agents' service alone passes it): an agent never acts as a user.
  // Tokens are compared in constant time and never appear
  // in messages. With auth disabled (empty table) every call gets
  // Identity{"anonymous", kAdmin, ""}.
  absl::StatusOr<Identity> Authenticate(const std::string& authorization,
                                        const std::string& job = "",
                                        bool require_admin = false,
                                        bool allow_node = false) const;

 private:
  std::map<std::string, Identity> tokens_;
};

// Authenticate for an HTTP request's Authorization header (`authorization`,
// "" without one), as a server's GET /metrics takes it
// (MetricsHttpServer's `authorize`): a missing token is Unauthenticated
// naming the header and `whose` ("an admin's token of central's
// --token-file"), the rest as Authenticate answers. With auth disabled
// (empty table) every request is allowed.
absl::StatusOr<Identity> AuthenticateHttp(const TokenTable& tokens,
                                          const std::string& authorization,
                                          const std::string& whose, const std::string& job = "",
                                          bool require_admin = false, bool allow_node = false);

// Confines a job-scoped token to its job: OK when `who` has no job or
// `job` (the job of what the call acts on, "" for none) is its job, else
// PermissionDenied naming both and `what` ("allocation a3"):
//   the token of "alice" is for job "j1"; allocation a3 is of job "j2"
absl::Status CheckJob(const Identity& who, const std::string& job,
                      const std::string& what);

// Reads a token the way clients take it: `token` itself (trimmed), or the
// first line of `token_file` (trimmed), which must hold the token alone.
// Both empty gives ""; both set is InvalidArgument.
absl::StatusOr<std::string> ResolveClientToken(const std::string& token,
                                               const std::string& token_file);

}  // namespace deepnex

#endif  // DEEPNEX_AUTH_H_
