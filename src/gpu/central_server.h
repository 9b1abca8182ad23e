// How a part above gpu serves more RPCs from deepnex-central (the launcher's
// Containers service) on the same port, tokens and allocator, without gpu
// depending on that part. Private to libdeepnex.
#ifndef DEEPNEX_GPU_CENTRAL_SERVER_H_
#define DEEPNEX_GPU_CENTRAL_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <vector>

#include "deepnex/auth.h"
#include "deepnex/gpu/allocator.h"
#include "deepnex/gpu/central.h"
#include "deepnex/metrics.h"

namespace deepnex::agent {
class Hub;
}

namespace deepnex::gpu {

class CentralExtension {
 public:
  virtual ~CentralExtension() = default;
  virtual grpc::Service* service() = 0;
  // Services it serves besides service() (launch's image catalog and
  // sessions).
  virtual std::vector<grpc::Service*> more_services() { return {}; }
  // Adds the series of what it runs itself (central's own launcher's
  // containers) to central's metrics, at each scrape.
  virtual void ExportMetrics(MetricsRegistry&) {}
  // The first step of CentralServer::Stop, while the allocator still serves
  // (so that what ends here can release its allocations). Idempotent.
  virtual void Shutdown() = 0;
};

// Called once by CreateCentralServer with the served allocator, token table
// and agents' hub (through which containers run on agents' nodes), which
// outlive the extension.
using CentralExtensionFactory = std::function<absl::StatusOr<std::unique_ptr<CentralExtension>>(
    Allocator& allocator, const TokenTable& tokens, agent::Hub& hub)>;

// CentralServer::Create plus the extension's service.
absl::StatusOr<std::unique_ptr<CentralServer>> CreateCentralServer(
    const CentralServerOptions& options, const CentralExtensionFactory& extension);

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_CENTRAL_SERVER_H_
