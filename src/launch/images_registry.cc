#include "launch/images_registry.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/file_util.h"
#include "core/random.h"
#include "launch/command.h"
#include "launch/util.h"

namespace deepnex::launch {
namespace {

constexpr char kSkopeo[] = "/usr/bin/skopeo";
// A pull or push of a big image over a slow link.
constexpr std::chrono::minutes kCopyTimeout{30};
constexpr std::chrono::seconds kInspectTimeout{60};

// Runs skopeo; a failure becomes Unavailable (the registry cannot be
// reached), NotFound (it has no such image) or Unknown, naming `ref`.
absl::StatusOr<CommandResult> Skopeo(const std::vector<std::string>& args, const RegistryRef& ref,
                                     std::chrono::milliseconds timeout) {
  std::vector<std::string> argv = {kSkopeo, "--insecure-policy"};
  argv.insert(argv.end(), args.begin(), args.end());
  if (!std::filesystem::exists(kSkopeo)) {
    return absl::FailedPreconditionError(
        absl::StrCat(kSkopeo, " is missing (Debian's skopeo package): it moves images from and "
                              "to registry ", ref.registry));
  }
  DEEPNEX_ASSIGN_OR_RETURN(CommandResult r, RunCommand(argv, OwnEnv(), timeout));
  if (r.ok()) return r;
  const std::string err(absl::StripAsciiWhitespace(r.err));
  for (const char* down : {"connection refused", "dial tcp", "no such host", "i/o timeout",
                           "connection reset", "EOF"}) {
    if (absl::StrContains(err, down)) {
      return absl::UnavailableError(absl::StrCat("image registry ", ref.registry,
                                                 " is unreachable (", ref.ToString(), "): ", err));
    }
  }
  if (absl::StrContains(err, "manifest unknown") || absl::StrContains(err, "name unknown")) {
    return absl::NotFoundError(
        absl::StrCat("image ", ref.ToString(), " is not in registry ", ref.registry));
  }
  return absl::UnknownError(DescribeFailure(argv, r));
}

}  // namespace

std::string RegistryRef::ToString() const {
  return absl::StrCat(kRegistryScheme, registry, "/", repo, ":", tag,
                      digest.empty() ? "" : "@" + digest);
}

std::string RegistryRef::Location() const {
  return digest.empty() ? ToString() : absl::StrCat(kRegistryScheme, registry, "/", repo, "@",
                                                    digest);
}

absl::StatusOr<RegistryRef> RegistryRef::Parse(const std::string& full) {
  RegistryRef r;
  // A pinned digest, then the reference without it.
  const size_t at = full.find('@');
  const std::string text = full.substr(0, at);
  if (at != std::string::npos) {
    r.digest = full.substr(at + 1);
    absl::string_view hex(r.digest);
    if (!absl::ConsumePrefix(&hex, "sha256:") || hex.size() != 64 ||
        !std::all_of(hex.begin(), hex.end(),
                     [](char c) { return absl::ascii_isdigit(c) || (c >= 'a' && c <= 'f'); })) {
      return absl::InvalidArgumentError(absl::StrCat(
          "image \"", full, "\": digest \"", r.digest, "\" is not sha256:<64 hex digits>"));
    }
  }
  absl::string_view rest(text);
  const size_t slash = rest.find('/', sizeof kRegistryScheme - 1);
  const size_t colon = rest.rfind(':');
  if (!absl::ConsumePrefix(&rest, kRegistryScheme) || slash == std::string::npos ||
      colon == std::string::npos || colon < slash) {
    return absl::InvalidArgumentError(
        absl::StrCat("image \"", full, "\" is not docker://HOST:PORT/REPO:TAG[@DIGEST]"));
  }
  r.registry = text.substr(sizeof kRegistryScheme - 1, slash - (sizeof kRegistryScheme - 1));
  r.repo = text.substr(slash + 1, colon - slash - 1);
  r.tag = text.substr(colon + 1);
  if (r.registry.empty() || r.repo.empty() || r.tag.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("image \"", full, "\" is not docker://HOST:PORT/REPO:TAG[@DIGEST]"));
  }
  return r;
}

bool IsRegistryImage(const std::string& image) {
  return absl::StartsWith(image, kRegistryScheme);
}

absl::StatusOr<std::string> RegistryDigest(const RegistryRef& ref) {
  DEEPNEX_ASSIGN_OR_RETURN(
      CommandResult r,
      Skopeo({"inspect", "--raw", "--tls-verify=false", ref.Location()}, ref, kInspectTimeout));
  // skopeo computes the digest as the registry does (of the bytes it sent).
  const std::string manifest =
      (std::filesystem::temp_directory_path() / ("deepnex-manifest-" + RandomHex(8))).string();
  absl::Status written = WriteFileAtomically(manifest, r.out);
  absl::StatusOr<CommandResult> digest =
      written.ok() ? Skopeo({"manifest-digest", manifest}, ref, kInspectTimeout)
                   : absl::StatusOr<CommandResult>(written);
  std::error_code ec;
  std::filesystem::remove(manifest, ec);
  if (!digest.ok()) return digest.status();
  return std::string(absl::StripAsciiWhitespace(digest->out));
}

absl::Status PushLayout(const std::string& layout, const std::string& tag,
                        const RegistryRef& ref) {
  return Skopeo({"copy", "--quiet", "--dest-tls-verify=false",
                 absl::StrCat("oci:", layout, tag.empty() ? "" : ":" + tag), ref.ToString()},
                ref, kCopyTimeout)
      .status();
}

absl::Status PullLayout(const RegistryRef& ref, const std::string& dir) {
  return Skopeo({"copy", "--quiet", "--src-tls-verify=false", ref.Location(),
                 absl::StrCat("oci:", dir, ":", ref.tag)},
                ref, kCopyTimeout)
      .status();
}

}  // namespace deepnex::launch
