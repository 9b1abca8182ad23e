// deepnex-central's Images service: the catalog (images.h) over gRPC,
// served beside Containers (central.cc). Private to src/launch.
#ifndef DEEPNEX_LAUNCH_IMAGES_SERVICE_H_
#define DEEPNEX_LAUNCH_IMAGES_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <memory>

#include "deepnex/auth.h"
#include "launch/images.h"

namespace deepnex::launch {

// Serves `catalog` to the holders of `tokens`' tokens; both outlive it.
// `registry` (HOST:PORT, or empty): where registered OCI image layouts are
// pushed (ContainerPolicy::registry).
std::unique_ptr<grpc::Service> NewImagesService(ImageCatalog& catalog, const TokenTable& tokens,
                                                std::string registry);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_IMAGES_SERVICE_H_
