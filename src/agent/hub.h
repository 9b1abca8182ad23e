// deepnex-central's side of its agents: the Agents service that each
// deepnex-agent keeps a stream open to, the registration of their nodes, the
// heartbeats that keep those Ready, and the commands central sends down the
// streams. Private to libdeepnex.
//
// An agent dials central (see agent.proto for why); its node is added to the
// allocator when central does not know it (labelled kAgentLabel), or taken
// over when an admin declared it. A node whose agent is not heard from for
// node_timeout is NotReady (Allocator::SetNodeReady: no new grants), a log
// line and a metric say so; after node_lost_after its containers' reports
// turn "lost" (exited), which ends them for whoever waits on them.
#ifndef DEEPNEX_AGENT_HUB_H_
#define DEEPNEX_AGENT_HUB_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "deepnex/agent.grpc.pb.h"
#include "deepnex/auth.h"
#include "deepnex/gpu/allocator.h"
#include "deepnex/metrics.h"

namespace deepnex::agent {

// The label central puts on a node that an agent registered, so that a
// restarted central still times out an agent that never comes back.
inline constexpr char kAgentLabel[] = "deepnex.io/agent";

struct HubOptions {
  // Silence after which a node is NotReady. Default: 10s
  std::chrono::milliseconds node_timeout{10000};
  // Silence after which its containers count as lost. Default: 5min
  std::chrono::milliseconds node_lost_after{std::chrono::minutes(5)};
  // How often agents are told to heartbeat (at most a third of
  // node_timeout). Default: 2s
  std::chrono::milliseconds heartbeat{2000};
  // See CentralServerOptions::on_node_state.
  std::function<void(const std::string& node, const std::string& state,
                     const std::string& why)>
      on_node_state;
};

class Stream;

// Thread-safe. Serve service() on central's port; the allocator and tokens
// outlive the hub.
class Hub {
 public:
  Hub(gpu::Allocator& alloc, const TokenTable& tokens, const HubOptions& options);
  ~Hub();
  Hub(const Hub&) = delete;
  Hub& operator=(const Hub&) = delete;

  grpc::Service* service() { return &service_; }
  // Ends every stream and the monitor; commands in flight fail with
  // Unavailable. Idempotent.
  void Shutdown();

  // Whether `node` is an agent's (registered through the hub, now or by an
  // earlier central), connected or not.
  bool HasAgent(const std::string& node) const;
  // The launch backend the node's agent runs ("" before it registered).
  std::string Backend(const std::string& node) const;
  // Sends `command` (its id is set here) to `node`'s agent and waits for the
  // reply. Unavailable when the agent is not connected or goes away;
  // DeadlineExceeded after `timeout`; the reply's own status otherwise.
  absl::StatusOr<proto::Reply> Call(const std::string& node, proto::Command command,
                                    std::chrono::milliseconds timeout);
  // The latest report of container `name` (the launcher's name) on `node`.
  std::optional<proto::ContainerReport> Report(const std::string& node,
                                               const std::string& name) const;
  // Drops that report: its agent removed the container (RemoteLauncher::
  // Remove). Kept, every container that ever ran on the node stayed in
  // central's memory. A heartbeat the agent built before the removal does
  // not bring it back; a start's reply of that name does.
  void Forget(const std::string& node, const std::string& name);
  // Waits until `done` holds for that report or `timeout` passes; returns
  // the latest report (nullopt when there is none).
  std::optional<proto::ContainerReport> WaitReport(
      const std::string& node, const std::string& name,
      const std::function<bool(const proto::ContainerReport&)>& done,
      std::chrono::milliseconds timeout);
  // Sets `info`'s last_heartbeat_ms, measured usage and address for an
  // agent's node.
  void Fill(gpu::NodeInfo* info) const;
  // Per agent node: ready (1/0), seconds since heard, NotReady events, what
  // its agent measures (cores, memory, per GPU), and per container; `more`
  // adds series of the same families (central's own containers') before
  // they are rendered, once each.
  std::string MetricsText(const std::function<void(MetricsRegistry&)>& more = {}) const;
  // Called with the containers an agent reports running when it registers
  // (a restarted central takes them back), on a gRPC thread, before the
  // agent is told it registered. Set once, before serving.
  using RegisteredFn =
      std::function<void(const std::string& node, const std::vector<proto::ContainerReport>&)>;
  void OnRegistered(RegisteredFn fn) { on_registered_ = std::move(fn); }

 private:
  friend class Stream;
  struct Link {
    Stream* stream = nullptr;  // the connected one
    std::string backend;
    std::string address;  // the node's, as its agent advertises it
    std::chrono::steady_clock::time_point heard;
    int64_t heard_ms = 0;  // system clock, for `deepnex nodes`
    bool ready = true;
    bool lost = false;
    std::map<std::string, proto::ContainerReport> containers;
    // Forgotten, until a heartbeat without them or a start of that name.
    std::set<std::string> forgotten;
    proto::NodeUsage usage;  // the latest heartbeat's
  };
  struct Pending {
    std::string node;
    Stream* stream = nullptr;  // the stream the command went out on
    bool done = false;
    proto::Reply reply;
  };

  class Service final : public proto::Agents::CallbackService {
   public:
    explicit Service(Hub* hub) : hub_(hub) {}
    grpc::ServerBidiReactor<proto::AgentMessage, proto::CentralMessage>* Connect(
        grpc::CallbackServerContext* ctx) override;

   private:
    Hub* const hub_;
  };

  // From a stream, under no lock of the hub's.
  absl::Status OnRegister(Stream* s, const Identity& who, const proto::Register& reg);
  void OnHeartbeat(Stream* s, const proto::Heartbeat& hb);
  void OnReply(Stream* s, const proto::Reply& reply);
  void OnGone(Stream* s);
  // Ends the commands sent on `s` that await a reply: once `s` is gone or
  // replaced, the agent may never have received them.
  void FailPendingLocked(Stream* s);
  // Marks the link heard now; returns true when the node was NotReady.
  bool HeardLocked(Link& link);
  void SetReady(const std::string& node, bool ready, const std::string& why);
  void Monitor();

  gpu::Allocator& alloc_;
  const TokenTable& tokens_;
  const HubOptions options_;
  Service service_{this};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Link> links_;
  std::map<uint64_t, Pending*> pending_;
  std::map<Stream*, bool> streams_;  // open ones
  uint64_t next_id_ = 0;
  bool stopping_ = false;
  MetricsRegistry registry_;
  RegisteredFn on_registered_;
  std::thread monitor_;  // last: it uses the members above
};

}  // namespace deepnex::agent

#endif  // DEEPNEX_AGENT_HUB_H_
