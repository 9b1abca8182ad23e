#include "deepnex/env.h"

#include <charconv>
#include <cstdlib>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "deepnex/units.h"

namespace deepnex {
namespace {

using Lookup = std::function<std::optional<std::string>(const std::string&)>;

std::string Quote(absl::string_view value) {
  return absl::StrCat("\"", absl::CEscape(value), "\"");
}

absl::Status Malformed(const std::string& name, const std::string& value,
                       absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat(name, "=", Quote(value), " ", why));
}

absl::StatusOr<std::string> Required(const Lookup& getenv,
                                     const std::string& name) {
  std::optional<std::string> value = getenv(name);
  if (!value.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        name,
        " is not set (the job environment is given by a deepnex launcher)"));
  }
  if (value->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        name,
        " is set but empty (the job environment is given by a deepnex "
        "launcher)"));
  }
  return *value;
}

// Optional variables: unset and empty both mean "not given".
std::string Optional(const Lookup& getenv, const std::string& name) {
  return getenv(name).value_or("");
}

// A decimal int, nothing else: no sign '+', no spaces, no trailing text.
absl::StatusOr<int> ParseInt(const std::string& name,
                             const std::string& value) {
  int result = 0;
  const char* end = value.data() + value.size();
  auto [ptr, ec] = std::from_chars(value.data(), end, result);
  if (ec == std::errc::result_out_of_range) {
    return Malformed(name, value, "is out of range for an integer");
  }
  if (ec != std::errc() || ptr != end || value.empty()) {
    return Malformed(name, value, "is not an integer");
  }
  return result;
}

struct HostPort {
  std::string host;  // without IPv6 brackets
  int port = 0;
};

// "host:port" or "[v6addr]:port", port 1..65535. `why` gets the reason on
// failure.
std::optional<HostPort> ParseHostPort(absl::string_view text,
                                      std::string* why) {
  if (text.find_first_of(" \t\r\n") != absl::string_view::npos) {
    *why = "has whitespace (expected host:port)";
    return std::nullopt;
  }
  size_t colon = text.rfind(':');
  if (colon == absl::string_view::npos) {
    *why = "has no port (expected host:port)";
    return std::nullopt;
  }
  absl::string_view host = text.substr(0, colon);
  absl::string_view port = text.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != absl::string_view::npos) {
    *why = "has an IPv6 address without brackets (write [addr]:port)";
    return std::nullopt;
  }
  if (host.empty()) {
    *why = "has an empty host (expected host:port)";
    return std::nullopt;
  }
  int value = 0;
  auto [ptr, ec] =
      std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || ptr != port.data() + port.size() ||
      value < 1 || value > 65535) {
    *why = absl::StrCat("has port ", Quote(port), " (must be 1..65535)");
    return std::nullopt;
  }
  return HostPort{std::string(host), value};
}

bool ParseRole(absl::string_view text, Role* role) {
  if (text == "worker") {
    *role = Role::kWorker;
  } else if (text == "ps") {
    *role = Role::kPs;
  } else if (text == "chief") {
    *role = Role::kChief;
  } else {
    return false;
  }
  return true;
}

}  // namespace

const char* RoleName(Role role) {
  switch (role) {
    case Role::kWorker:
      return "worker";
    case Role::kPs:
      return "ps";
    case Role::kChief:
      return "chief";
  }
  return "invalid";
}

absl::StatusOr<Context> Context::FromEnv() {
  return FromLookup([](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });
}

absl::StatusOr<Context> Context::FromLookup(const Lookup& getenv) {
  if (!getenv) return absl::InvalidArgumentError("FromLookup: the lookup function is empty");
  Context c;
  DEEPNEX_ASSIGN_OR_RETURN(c.job_id, Required(getenv, "DEEPNEX_JOB_ID"));

  DEEPNEX_ASSIGN_OR_RETURN(std::string role, Required(getenv, "DEEPNEX_ROLE"));
  if (!ParseRole(role, &c.role)) {
    return Malformed("DEEPNEX_ROLE", role,
                     "is not a role (use worker, ps or chief)");
  }

  DEEPNEX_ASSIGN_OR_RETURN(std::string world_size,
                           Required(getenv, "DEEPNEX_WORLD_SIZE"));
  DEEPNEX_ASSIGN_OR_RETURN(c.world_size,
                           ParseInt("DEEPNEX_WORLD_SIZE", world_size));
  if (c.world_size < 1) {
    return Malformed("DEEPNEX_WORLD_SIZE", world_size, "must be at least 1");
  }

  DEEPNEX_ASSIGN_OR_RETURN(std::string rank, Required(getenv, "DEEPNEX_RANK"));
  DEEPNEX_ASSIGN_OR_RETURN(c.rank, ParseInt("DEEPNEX_RANK", rank));
  if (c.rank < 0 || c.rank >= c.world_size) {
    return Malformed("DEEPNEX_RANK", rank,
                     absl::StrCat("is out of range: must be 0 <= rank < "
                                  "DEEPNEX_WORLD_SIZE (",
                                  c.world_size, ")"));
  }

  std::string local_rank = Optional(getenv, "DEEPNEX_LOCAL_RANK");
  if (!local_rank.empty()) {
    DEEPNEX_ASSIGN_OR_RETURN(c.local_rank,
                             ParseInt("DEEPNEX_LOCAL_RANK", local_rank));
    if (c.local_rank < 0) {
      return Malformed("DEEPNEX_LOCAL_RANK", local_rank,
                       "must not be negative");
    }
  }

  std::string ps_addrs = Optional(getenv, "DEEPNEX_PS_ADDRS");
  if (!ps_addrs.empty()) {
    int index = 0;
    for (absl::string_view addr : absl::StrSplit(ps_addrs, ',')) {
      ++index;
      if (addr.empty()) {
        return Malformed("DEEPNEX_PS_ADDRS", ps_addrs,
                         absl::StrCat("has an empty entry (number ", index,
                                      "; expected host:port,host:port,...)"));
      }
      std::string why;
      if (!ParseHostPort(addr, &why).has_value()) {
        return Malformed(
            "DEEPNEX_PS_ADDRS", ps_addrs,
            absl::StrCat("has entry ", Quote(addr), ", which ", why));
      }
      c.ps_addrs.emplace_back(addr);
    }
  }

  c.store_addr = Optional(getenv, "DEEPNEX_STORE_ADDR");
  c.token = Optional(getenv, "DEEPNEX_TOKEN");
  c.cuda_visible_devices = Optional(getenv, "CUDA_VISIBLE_DEVICES");
  c.nvidia_visible_devices = Optional(getenv, "NVIDIA_VISIBLE_DEVICES");

  std::string limit = Optional(getenv, "DEEPNEX_GPU_MEMORY_LIMIT");
  if (!limit.empty()) {
    DEEPNEX_ASSIGN_OR_RETURN(c.gpu_memory_limit,
                             ParseByteSize(limit, "DEEPNEX_GPU_MEMORY_LIMIT"));
  }
  return c;
}

std::map<std::string, std::string> Context::ToEnv() const {
  std::map<std::string, std::string> env;
  env["DEEPNEX_JOB_ID"] = job_id;
  env["DEEPNEX_ROLE"] = RoleName(role);
  env["DEEPNEX_RANK"] = env["RANK"] = absl::StrCat(rank);
  env["DEEPNEX_WORLD_SIZE"] = env["WORLD_SIZE"] = absl::StrCat(world_size);
  env["DEEPNEX_LOCAL_RANK"] = env["LOCAL_RANK"] = absl::StrCat(local_rank);
  if (!ps_addrs.empty()) env["DEEPNEX_PS_ADDRS"] = absl::StrJoin(ps_addrs, ",");
  if (!store_addr.empty()) {
    env["DEEPNEX_STORE_ADDR"] = store_addr;
    std::string why;
    if (std::optional<HostPort> hp = ParseHostPort(store_addr, &why)) {
      env["MASTER_ADDR"] = hp->host;
      env["MASTER_PORT"] = absl::StrCat(hp->port);
    }
  }
  if (!token.empty()) env["DEEPNEX_TOKEN"] = token;
  if (!cuda_visible_devices.empty()) {
    env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices;
  }
  if (!nvidia_visible_devices.empty()) {
    env["NVIDIA_VISIBLE_DEVICES"] = nvidia_visible_devices;
  }
  if (gpu_memory_limit.has_value()) {
    env["DEEPNEX_GPU_MEMORY_LIMIT"] = absl::StrCat(*gpu_memory_limit);
  }
  return env;
}

}  // namespace deepnex
