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

enum class AuthRole { kUser, kAdmin };

struct Identity {
  std::string name;          // user (or job) name
  AuthRole role = AuthRole::kUser;
  std::string job;           // empty: not scoped to a job
};

// Thread-compatible: build it, then share it read-only.
class TokenTable {
 public:
  // An empty table: every call is allowed (auth disabled).
  TokenTable() = default;

  // One token that grants `role` to `name` (for a job-scoped token, `job`).
  static TokenTable Single(const std::string& token,
                           const std::string& name = "user",
                           AuthRole role = AuthRole::kUser,
                           const std::string& job = "");
  // Reads a token file. Either a single token on its own (one line), or lines
  // "TOKEN NAME ROLE [JOB]" with ROLE user|admin; '#' starts a comment.
  // InvalidArgument naming the file and line for a malformed line.
  static absl::StatusOr<TokenTable> FromFile(const std::string& path);
  // Token string and token file are alternatives: both empty gives an empty
  // table, both set is InvalidArgument.
  static absl::StatusOr<TokenTable> FromOptions(const std::string& token,
                                                const std::string& token_file);

  absl::Status Add(const std::string& token, Identity identity);
  bool enabled() const { return !tokens_.empty(); }

  // `authorization` is the metadata value ("Bearer <token>"), empty if the
  // call had none. With `job` non-empty, a token scoped to another job is
  // PermissionDenied. With `require_admin`, a user token is PermissionDenied.
  absl::StatusOr<Identity> Authenticate(const std::string& authorization,
                                        const std::string& job = "",
                                        bool require_admin = false) const;

 private:
  std::map<std::string, Identity> tokens_;
};

// Reads a token the way clients take it: `token` itself, or the first line
// of `token_file` (trimmed). Both empty gives "".
absl::StatusOr<std::string> ResolveClientToken(const std::string& token,
                                               const std::string& token_file);

}  // namespace deepnex

#endif  // DEEPNEX_AUTH_H_
