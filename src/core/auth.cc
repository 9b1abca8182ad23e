#include "deepnex/auth.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace deepnex {
namespace {

std::string Quote(absl::string_view value) {
  return absl::StrCat("\"", absl::CEscape(value), "\"");
}

// Compares without an early exit, so the time taken does not tell an
// attacker how many leading characters of a guess were right.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    unsigned char other = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = diff | (static_cast<unsigned char>(a[i]) ^ other);
  }
  return diff == 0;
}

bool HasWhitespace(absl::string_view s) {
  for (char c : s) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c))) return true;
  }
  return false;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  // An ifstream opens a directory and reads it as empty: a new user's
  // --token-file /tmp read "the first line is empty".
  std::error_code ignored;
  if (std::filesystem::is_directory(path, ignored)) {
    return absl::FailedPreconditionError(
        absl::StrCat("token file ", Quote(path), ": is a directory, not a file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    int err = errno;
    std::string message =
        absl::StrCat("token file ", Quote(path), ": ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(message);
    if (err == EACCES) return absl::PermissionDeniedError(message);
    return absl::FailedPreconditionError(message);
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) {
    return absl::DataLossError(
        absl::StrCat("token file ", Quote(path), ": read failed"));
  }
  return buffer.str();
}

// The whitespace-separated fields of `line` up to a field starting with '#'.
std::vector<absl::string_view> Fields(absl::string_view line) {
  std::vector<absl::string_view> fields;
  for (absl::string_view f :
       absl::StrSplit(line, absl::ByAnyChar(" \t\r\v\f"), absl::SkipEmpty())) {
    if (f.front() == '#') break;
    fields.push_back(f);
  }
  return fields;
}

}  // namespace

TokenTable TokenTable::Single(const std::string& token, const std::string& name,
                              AuthRole role, const std::string& job) {
  TokenTable table;
  // An empty or malformed token leaves the table empty; FromOptions is the
  // checked way to build a table from user input.
  table.Add(token, Identity{name, role, job}).IgnoreError();
  return table;
}

absl::StatusOr<TokenTable> TokenTable::FromFile(const std::string& path) {
  DEEPNEX_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  struct Line {
    int number;
    std::vector<absl::string_view> fields;
  };
  std::vector<Line> lines;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    std::vector<absl::string_view> fields = Fields(line);
    if (!fields.empty()) lines.push_back(Line{number, std::move(fields)});
  }
  if (lines.empty()) {
    // An empty table would disable auth: refuse rather than open the server.
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", Quote(path), " holds no token"));
  }

  TokenTable table;
  if (lines.size() == 1 && lines[0].fields.size() == 1) {
    DEEPNEX_RETURN_IF_ERROR(table.Add(std::string(lines[0].fields[0]),
                                      Identity{"user", AuthRole::kUser, ""}));
    return table;
  }
  for (const Line& line : lines) {
    const auto& f = line.fields;
    std::string where =
        absl::StrCat("token file ", Quote(path), " line ", line.number, ": ");
    if (f.size() < 3 || f.size() > 4) {
      // The line holds the token, so it is not quoted back.
      return absl::InvalidArgumentError(
          absl::StrCat(where, "expected \"TOKEN NAME ROLE [JOB]\", got ",
                       f.size(), f.size() == 1 ? " field" : " fields"));
    }
    Identity identity;
    identity.name = std::string(f[1]);
    if (f[2] == "user") {
      identity.role = AuthRole::kUser;
    } else if (f[2] == "admin") {
      identity.role = AuthRole::kAdmin;
    } else if (f[2] == "node") {
      identity.role = AuthRole::kNode;
      if (f.size() == 4) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, "a node token has no job, got ", Quote(f[3])));
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          where, "role ", Quote(f[2]), " is not user, admin or node"));
    }
    if (f.size() == 4) identity.job = std::string(f[3]);
    absl::Status added = table.Add(std::string(f[0]), std::move(identity));
    if (!added.ok()) {
      return absl::Status(added.code(), absl::StrCat(where, added.message()));
    }
  }
  return table;
}

absl::StatusOr<TokenTable> TokenTable::FromOptions(
    const std::string& token, const std::string& token_file) {
  if (!token.empty() && !token_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a token and a token file (", Quote(token_file),
                     ") were both given; give one"));
  }
  if (!token_file.empty()) return FromFile(token_file);
  TokenTable table;
  if (!token.empty()) {
    DEEPNEX_RETURN_IF_ERROR(
        table.Add(token, Identity{"user", AuthRole::kUser, ""}));
  }
  return table;
}

absl::Status TokenTable::Add(const std::string& token, Identity identity) {
  if (token.empty()) return absl::InvalidArgumentError("empty token");
  if (HasWhitespace(token)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the token for ", Quote(identity.name), " contains whitespace"));
  }
  if (identity.name.empty()) {
    return absl::InvalidArgumentError("a token needs a non-empty name");
  }
  if (tokens_.count(token) != 0) {
    return absl::AlreadyExistsError(absl::StrCat(
        "the token for ", Quote(identity.name),
        " is already in the table (for ", Quote(tokens_.at(token).name), ")"));
  }
  tokens_.emplace(token, std::move(identity));
  return absl::OkStatus();
}

// Read by whoever ran the client: say how to give a token.
constexpr char kMissingToken[] =
    "missing bearer token (authorization metadata); give one with --token, "
    "--token-file or $DEEPNEX_TOKEN (token= or token_file= in code)";

absl::StatusOr<Identity> TokenTable::Authenticate(
    const std::string& authorization, const std::string& job,
    bool require_admin, bool allow_node) const {
  if (!enabled()) return Identity{"anonymous", AuthRole::kAdmin, ""};

  absl::string_view value = absl::StripAsciiWhitespace(authorization);
  if (value.empty()) {
    return absl::UnauthenticatedError(kMissingToken);
  }
  constexpr absl::string_view kScheme = "bearer ";
  if (absl::EqualsIgnoreCase(value, "bearer")) {
    return absl::UnauthenticatedError(kMissingToken);
  }
  if (!absl::StartsWithIgnoreCase(value, kScheme)) {
    return absl::UnauthenticatedError(
        "the authorization is not \"Bearer <token>\"");
  }
  absl::string_view token =
      absl::StripLeadingAsciiWhitespace(value.substr(kScheme.size()));

  // Visit every entry so that timing depends on neither the match nor
  // where it sits in the table.
  const Identity* found = nullptr;
  for (const auto& [known, identity] : tokens_) {
    if (ConstantTimeEquals(token, known)) found = &identity;
  }
  if (found == nullptr) return absl::UnauthenticatedError("invalid token");

  if (found->role == AuthRole::kNode && !allow_node) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the token of ", Quote(found->name),
        " is a node token: it may only act as its node (deepnex-agent)"));
  }
  if (!job.empty() && !found->Reaches(job)) {
    return absl::PermissionDeniedError(
        absl::StrCat("the token of ", Quote(found->name), " is for job ",
                     Quote(found->job), ", not job ", Quote(job)));
  }
  if (require_admin && found->role != AuthRole::kAdmin) {
    return absl::PermissionDeniedError(
        absl::StrCat(Quote(found->name),
                     " is not an admin (this call requires the admin role)"));
  }
  return *found;
}

absl::StatusOr<Identity> AuthenticateHttp(const TokenTable& tokens,
                                          const std::string& authorization,
                                          const std::string& whose, const std::string& job,
                                          bool require_admin, bool allow_node) {
  if (tokens.enabled() && absl::StripAsciiWhitespace(authorization).empty()) {
    return absl::UnauthenticatedError(
        absl::StrCat("missing bearer token: send \"Authorization: Bearer TOKEN\" with ", whose,
                     " (Prometheus: authorization.credentials_file)"));
  }
  return tokens.Authenticate(authorization, job, require_admin, allow_node);
}

absl::Status CheckJob(const Identity& who, const std::string& job,
                      const std::string& what) {
  if (who.Reaches(job)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "the token of ", Quote(who.name), " is for job ", Quote(who.job), "; ",
      what, job.empty() ? " is of no job" : absl::StrCat(" is of job ", Quote(job))));
}

absl::StatusOr<std::string> ResolveClientToken(const std::string& token,
                                               const std::string& token_file) {
  if (!token.empty() && !token_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a token and a token file (", Quote(token_file),
                     ") were both given; give one"));
  }
  if (token_file.empty()) {
    return std::string(absl::StripAsciiWhitespace(token));
  }
  DEEPNEX_ASSIGN_OR_RETURN(std::string text, ReadFile(token_file));
  absl::string_view first = text;
  first = first.substr(0, first.find('\n'));
  first = absl::StripAsciiWhitespace(first);
  if (first.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token file ", Quote(token_file), ": the first line is empty"));
  }
  if (HasWhitespace(first)) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", Quote(token_file),
                     ": the first line has more than one field; a client "
                     "token file holds the token alone"));
  }
  return std::string(first);
}

}  // namespace deepnex
