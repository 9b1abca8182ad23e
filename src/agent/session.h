// deepnex-agent's end of sessions (launch/session_service.h): for each
// SessionCommand from central, a stream dialled back to central's
// AgentSessions service that serves the session on a container of this node
// (launch::ServeSession). Private to libdeepnex.
#ifndef DEEPNEX_AGENT_SESSION_H_
#define DEEPNEX_AGENT_SESSION_H_

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <functional>
#include <map>
#include <string>

#include "deepnex/launch/launcher.h"
#include "deepnex/status.h"

namespace deepnex::agent {

// Thread-safe. Each session runs on a thread of its own until its process
// ends, central ends it, or Stop.
class AgentSessions {
 public:
  AgentSessions(std::shared_ptr<grpc::Channel> central, std::string token)
      : central_(std::move(central)), token_(std::move(token)) {}
  ~AgentSessions() { Stop(); }

  // Dials central for session `id` on `container` (run by a launcher of
  // `backend`); returns once the thread runs (the session's errors go down
  // its stream).
  absl::Status Start(std::shared_ptr<launch::Handle> container, const std::string& backend,
                     const std::string& id);
  // Session `id`'s user is gone: kills its process and cancels its stream.
  // Its thread may be blocked writing input the process does not read, and
  // then reads nothing of the stream that central ended. Unknown ids are
  // ignored (the session ended first).
  void End(const std::string& id);
  // Cancels every session and waits for their threads. Idempotent.
  void Stop();

 private:
  struct Live {
    std::shared_ptr<grpc::ClientContext> ctx;
    std::function<void()> gone;  // launch::SessionPeer::OnGone's; may be null
  };
  void Serve(std::shared_ptr<launch::Handle> container, std::string backend, std::string id,
             std::shared_ptr<grpc::ClientContext> ctx);
  // Sets session `id`'s `gone` (null: none), as its peer's OnGone.
  void SetGone(const std::string& id, std::function<void()> gone);

  const std::shared_ptr<grpc::Channel> central_;
  const std::string token_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Live> live_;  // by session id
  int threads_ = 0;
  bool stopping_ = false;
};

}  // namespace deepnex::agent

#endif  // DEEPNEX_AGENT_SESSION_H_
