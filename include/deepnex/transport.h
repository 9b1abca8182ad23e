// How a deepnex peer moves bytes to another on the same host: the choice the
// collectives (CommunicatorOptions::transport) and the parameter server's
// clients (ps::ClientOptions::transport) both offer, by one name.
#ifndef DEEPNEX_TRANSPORT_H_
#define DEEPNEX_TRANSPORT_H_

#include <string>

#include "deepnex/status.h"

namespace deepnex {

enum class Transport {
  kAuto,  // shared memory with a peer on this host that can give it, TCP otherwise
  kTcp,   // TCP always
  kShm,   // shared memory; FailedPrecondition where the peer cannot give it
};

// "auto", "tcp", "shm".
const char* TransportName(Transport transport);
// The inverse; InvalidArgument naming the value otherwise.
absl::StatusOr<Transport> ParseTransport(const std::string& name);

}  // namespace deepnex

#endif  // DEEPNEX_TRANSPORT_H_
