// deepnex-central's Images service: the catalog (images.h) over gRPC,
// served beside Containers (central.cc). Private to src/launch.
#ifndef DEEPNEX_LAUNCH_IMAGES_SERVICE_H_
#define DEEPNEX_LAUNCH_IMAGES_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <memory>

#include "agent/hub.h"
#include "deepnex/auth.h"
#include "launch/images.h"
#include "launch/session_service.h"

namespace deepnex::launch {

// Serves `catalog` to the holders of `tokens`' tokens; they and `hub`
// outlive it. `registry` (HOST:PORT, or empty): where registered OCI image
// layouts and committed containers are pushed (ContainerPolicy::registry).
// `containers` finds a user's container for a commit: here, or on an
// agent's node, which then commits it (its changes are there).
std::unique_ptr<grpc::Service> NewImagesService(ImageCatalog& catalog, const TokenTable& tokens,
                                                std::string registry, agent::Hub& hub,
                                                SessionResolver containers);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_IMAGES_SERVICE_H_
