#include "deepnex/transport.h"

#include "absl/strings/str_cat.h"

namespace deepnex {

const char* TransportName(Transport transport) {
  switch (transport) {
    case Transport::kAuto: return "auto";
    case Transport::kTcp: return "tcp";
    case Transport::kShm: return "shm";
  }
  return "?";
}

absl::StatusOr<Transport> ParseTransport(const std::string& name) {
  for (Transport t : {Transport::kAuto, Transport::kTcp, Transport::kShm}) {
    if (name == TransportName(t)) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("transport \"", name, "\": must be auto, tcp or shm"));
}

}  // namespace deepnex
