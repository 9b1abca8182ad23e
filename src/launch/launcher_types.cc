// launcher.h's value types (states, exits, restart policies) apart from the
// Launcher: clients of deepnex-central (deepnex-shell) link these without
// launcher.cc, whose factory references every backend (and so libcurl).
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "deepnex/launch/launcher.h"
#include "launch/util.h"

namespace deepnex::launch {
namespace {

// How one run ended, without the restarts: the one spelling of an exit
// everywhere (records, CLIs, restart notices).
std::string RunEnd(const ExitStatus& e) {
  std::string s = ExitReasonName(e.reason);
  if (e.reason == ExitReason::kExited) absl::StrAppend(&s, "(", e.code, ")");
  if (e.reason == ExitReason::kSignaled) absl::StrAppend(&s, "(", SignalName(e.signal), ")");
  return s;
}

}  // namespace

const char* ExitReasonName(ExitReason reason) {
  switch (reason) {
    case ExitReason::kExited:
      return "exited";
    case ExitReason::kSignaled:
      return "signaled";
    case ExitReason::kOomKilled:
      return "oom_killed";
    case ExitReason::kLost:
      return "lost";
  }
  return "?";
}

const char* StateName(State state) {
  switch (state) {
    case State::kStarting:
      return "starting";
    case State::kRunning:
      return "running";
    case State::kRestarting:
      return "restarting";
    case State::kStopped:
      return "stopped";
    case State::kExited:
      return "exited";
  }
  return "?";
}

std::string ExitStatus::ToString() const {
  std::string s = RunEnd(*this);
  if (restarts > 0) absl::StrAppend(&s, " after ", restarts, restarts == 1 ? " restart" : " restarts");
  return s;
}

std::string RestartEvent::ToString() const {
  std::string s = absl::StrCat(RunEnd(exit), "; restarting (", restart);
  if (max_restarts >= 0) absl::StrAppend(&s, "/", max_restarts);
  absl::StrAppend(&s, ") in ", absl::StrFormat("%.1f", delay.count() / 1000.0), "s");
  return s;
}

absl::StatusOr<RestartPolicy> RestartPolicy::Parse(const std::string& text) {
  RestartPolicy p;
  std::vector<std::string> parts = absl::StrSplit(text, absl::MaxSplits(':', 1));
  const std::string& kind = parts[0];
  bool ok = true;
  if (kind == "never") {
    p.kind = Kind::kNever;
    ok = parts.size() == 1;
  } else if (kind == "on-failure" || kind == "always") {
    p.kind = kind == "always" ? Kind::kAlways : Kind::kOnFailure;
    p.max_restarts = -1;
    if (parts.size() == 2) {
      ok = absl::SimpleAtoi(parts[1], &p.max_restarts) && p.max_restarts >= 0 &&
           !absl::StartsWith(parts[1], "+");
    }
  } else {
    ok = false;
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "restart: \"", text, "\" is not a restart policy (never, on-failure[:N], always[:N])"));
  }
  return p;
}

std::string RestartPolicy::ToString() const {
  std::string s = kind == Kind::kNever ? "never" : kind == Kind::kAlways ? "always" : "on-failure";
  if (kind != Kind::kNever && max_restarts >= 0) absl::StrAppend(&s, ":", max_restarts);
  return s;
}

}  // namespace deepnex::launch
