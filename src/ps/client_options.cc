// ClientOptions: validation.
#include "absl/strings/str_cat.h"
#include "core/grpc_util.h"
#include "deepnex/ps/client.h"
#include "deepnex/units.h"

namespace deepnex::ps {

absl::Status ClientOptions::Validate() const {
  if (servers.empty()) {
    return absl::InvalidArgumentError("servers: empty (give at least one host:port)");
  }
  // All of them before dialing any, so that a typo is refused at once.
  for (size_t i = 0; i < servers.size(); ++i) {
    DEEPNEX_RETURN_IF_ERROR(ValidateAddress("ps server address", servers[i]));
    // Each server holds the parts placed at its position (ps/plan.h); one
    // listed twice would hold two positions' parts under the same keys.
    for (size_t j = 0; j < i; ++j) {
      if (servers[j] == servers[i]) {
        return absl::InvalidArgumentError(absl::StrCat("servers[", i, "] \"", servers[i],
                                                       "\": listed twice (also servers[", j,
                                                       "]); give each server once"));
      }
    }
  }
  if (worker_id < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker_id=", worker_id, ": must be >= 0, or -1 for an observer"));
  }
  if (partition_bytes < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition_bytes=", partition_bytes, ": must be at least 8"));
  }
  if (request_bytes < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_bytes=", request_bytes, ": must be at least 8"));
  }
  // Each is a channel and a connection to every server: a million would be
  // a million sockets.
  if (connections_per_server < 1 || connections_per_server > 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "connections_per_server=", connections_per_server, ": must be 1..16"));
  }
  if (retry_backoff.count() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry_backoff=", retry_backoff.count(), "ms: must not be negative"));
  }
  DEEPNEX_RETURN_IF_ERROR(CheckMillis(retry_backoff, "retry_backoff", true));
  if (TransportName(transport)[0] == '?') {
    return absl::InvalidArgumentError(absl::StrCat(
        "transport=", static_cast<int>(transport), ": not a Transport (auto, tcp, shm)"));
  }
  DEEPNEX_RETURN_IF_ERROR(CheckMillis(timeout, "timeout"));
  return absl::OkStatus();
}

}  // namespace deepnex::ps
