// The site's policy as deepnex-central and deepnex-agent take it from flags
// and files: which user runs as which uid:gid, and which image name is which
// directory. Declared in deepnex/launch/central.h.
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/file_util.h"
#include "deepnex/launch/central.h"
#include "launch/util.h"

namespace deepnex::launch {

absl::StatusOr<std::map<std::string, RunAs>> LoadUsersFile(const std::string& path) {
  DEEPNEX_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path, "users file"));
  std::map<std::string, RunAs> users;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    line = absl::StripAsciiWhitespace(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    std::vector<std::string> f = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    std::string ids;
    if (f.size() == 3) ids = absl::StrCat(f[1], ":", f[2]);
    if (f.size() == 2) ids = f[1];
    absl::Status added = ids.empty() ? absl::InvalidArgumentError("")
                                     : AddUserMapping(absl::StrCat(f[0], "=", ids), &users);
    if (!added.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "users file ", path, " line ", number, ": \"", line,
          "\" is not \"NAME UID GID\" or \"NAME UID:GID\" with a new NAME"));
    }
  }
  return users;
}

absl::Status AddUserMapping(const std::string& text, std::map<std::string, RunAs>* users) {
  const size_t eq = text.rfind('=');
  const std::string name = text.substr(0, eq == std::string::npos ? 0 : eq);
  std::vector<std::string> ids =
      absl::StrSplit(eq == std::string::npos ? "" : text.substr(eq + 1), ':');
  RunAs r;
  if (name.empty() || ids.size() != 2 || !absl::SimpleAtoi(ids[0], &r.uid) ||
      !absl::SimpleAtoi(ids[1], &r.gid) || users->count(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("user mapping \"", text, "\" is not NAME=UID:GID with a new NAME"));
  }
  // /etc/passwd's name in an oci container; "user" where it cannot be one.
  if (IsPasswdName(name)) r.user = name;
  (*users)[name] = r;
  return absl::OkStatus();
}

absl::Status AddImageMapping(const std::string& field, const std::string& text,
                             std::map<std::string, std::string>* images) {
  const size_t eq = text.find('=');
  const std::string name = text.substr(0, eq);
  const std::string dir = eq == std::string::npos ? "" : text.substr(eq + 1);
  if (name.empty() || name[0] == '/' || images->count(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " \"", text, "\": expected NAME=DIR with a new NAME that is not a path"));
  }
  if (dir == "host") {
    (*images)[name] = dir;
    return absl::OkStatus();
  }
  std::error_code ec;
  const std::filesystem::path real =
      dir.empty() || dir[0] != '/' ? std::filesystem::path() : std::filesystem::canonical(dir, ec);
  if (real.empty() || ec || !std::filesystem::is_directory(real, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " \"", text, "\": \"", dir, "\" is not an absolute directory or \"host\""));
  }
  (*images)[name] = real.string();
  return absl::OkStatus();
}

}  // namespace deepnex::launch
