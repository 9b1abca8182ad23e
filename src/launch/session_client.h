// The client's end of deepnex-central's Sessions service (see
// launch/session_service.h). Private to libdeepnex.
#ifndef DEEPNEX_LAUNCH_SESSION_CLIENT_H_
#define DEEPNEX_LAUNCH_SESSION_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "deepnex/launch/session.h"

namespace deepnex::launch {

// Opens a session on `channel` (deepnex-central) with bearer `token`.
absl::StatusOr<std::unique_ptr<Session>> OpenCentralSession(
    const std::shared_ptr<grpc::Channel>& channel, const std::string& token,
    const SessionOptions& options);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_SESSION_CLIENT_H_
