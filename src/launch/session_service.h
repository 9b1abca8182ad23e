// deepnex-central's Sessions service (a user's exec, shell and port-forward
// streams) and AgentSessions service (the streams agents open back for the
// sessions of their nodes' containers). A session of a container that runs
// here is served here (ServeSession); one on an agent's node is spliced:
// central sends the agent a SessionCommand, the agent dials an AgentSessions
// stream for it, and central passes the frames between the two streams.
// Private to libdeepnex.
#ifndef DEEPNEX_LAUNCH_SESSION_SERVICE_H_
#define DEEPNEX_LAUNCH_SESSION_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "agent/hub.h"
#include "deepnex/auth.h"
#include "deepnex/launch/launcher.h"

namespace deepnex::launch {

// Where a session's container runs.
struct SessionTarget {
  std::shared_ptr<Handle> local;  // here; else on `node`'s agent
  std::string backend;            // of the launcher it runs on
  std::string node;
  std::string name;  // the launcher's name of the container
  std::string user;  // whose container it is: their sessions are counted
};

// The caller's container `name` (admins: `user`'s): NotFound for another
// user's. Called on a gRPC thread; must not block long.
using SessionResolver = std::function<absl::StatusOr<SessionTarget>(
    const grpc::ServerContextBase& ctx, const std::string& user, const std::string& name)>;

class SessionServices {
 public:
  virtual ~SessionServices() = default;
  virtual std::vector<grpc::Service*> services() = 0;
  // Ends every session (their processes are killed) and waits for them.
  // Idempotent.
  virtual void Shutdown() = 0;
};

// Thread-safe. `tokens` and `hub` outlive it.
std::unique_ptr<SessionServices> NewSessionServices(const TokenTable& tokens, agent::Hub& hub,
                                                    SessionResolver resolve);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_SESSION_SERVICE_H_
