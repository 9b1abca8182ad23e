// deepnex-central: the GPU allocator as a gRPC service shared by many users,
// and its client.
//
// Every call carries a bearer token (auth.h). A user token acts as its user:
// it allocates for itself, sees and releases only its own allocations (another
// user's is PermissionDenied). Node, mode and quota changes are admin-only.
// Without tokens every caller is an admin.
#ifndef DEEPNEX_GPU_CENTRAL_H_
#define DEEPNEX_GPU_CENTRAL_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "deepnex/gpu/allocator.h"
#include "deepnex/gpu/jobs.h"
#include "deepnex/gpu/types.h"
#include "deepnex/status.h"

namespace deepnex::gpu {

struct CentralServerOptions {
  // Where to listen; port 0 lets the OS pick (see address()).
  // Default: "127.0.0.1:0"
  std::string address = "127.0.0.1:0";
  // The host (a name or an address, no port) peers dial, advertised by
  // address(). Empty: the listen host, or for a wildcard listen host
  // (0.0.0.0, [::]) this host's primary address: the source of the route to
  // $DEEPNEX_STORE_ADDR or $DEEPNEX_CENTRAL, else the first non-loopback
  // address. Default: ""
  std::string advertise;
  // The allocator behind the service (state_dir makes it persistent).
  AllocatorOptions allocator;
  // Bearer token (one user, role admin) or a token file (see auth.h).
  std::string token;
  std::string token_file;
  // TLS: PEM certificate chain and private key. Both empty: plaintext.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Also serve MetricsText() as GET /metrics over plain HTTP here
  // ("127.0.0.1:0" picks a port; see metrics_port()). Empty: no HTTP.
  std::string metrics_address;
  // deepnex-agents (include/deepnex/agent/agent.h) register their nodes and
  // heartbeat over a stream they open to this server. A node whose agent is
  // silent for node_timeout is NotReady (no new grants); after
  // node_lost_after its containers count as lost. Agents heartbeat every
  // agent_heartbeat (at most a third of node_timeout).
  // Defaults: 10s, 5min, 2s
  std::chrono::milliseconds node_timeout{10000};
  std::chrono::milliseconds node_lost_after{std::chrono::minutes(5)};
  std::chrono::milliseconds agent_heartbeat{2000};
  // Called as an agent's node turns NotReady ("not_ready"), its containers
  // count as lost ("lost"), or it is Ready again or its agent registers
  // ("ready", also when it was Ready already: a restarted central starts its
  // nodes Ready, and the notifier knows what it last told), with why; on
  // the hub's threads, with no lock of its held (deepnex-central's webhook
  // notifier). Empty: nothing is called.
  std::function<void(const std::string& node, const std::string& state,
                     const std::string& why)>
      on_node_state;
  // The job store (include/deepnex/gpu/jobs.h): its history is kept in
  // <allocator.state_dir>/jobs (in memory without a state_dir), pruned so.
  JobHistoryOptions job_history;
  // Told each job event (queued, started, ...; see JobObserver). Empty: none.
  JobObserver on_job_event;
  // Checks each notify URL a job of `user` gives (`deepnex run --notify
  // URL`) as the job is first reported; an error refuses the job with it (deepnex-central:
  // notify::CheckJobUrl, public addresses only). Empty: any URL.
  std::function<absl::Status(const std::string& user, const std::string& url)>
      check_job_notify_url;
  // More Prometheus text at the end of MetricsText, per scrape, on any
  // thread (deepnex-central: its notifier's deepnex_notify_* series).
  // Empty: none.
  std::function<std::string()> more_metrics;
};

// A running service. Thread-safe; serves until Stop().
class CentralServer {
 public:
  static absl::StatusOr<std::unique_ptr<CentralServer>> Create(
      const CentralServerOptions& options);
  virtual ~CentralServer() = default;

  // "host:port" with the port actually bound.
  virtual std::string address() const = 0;
  virtual int port() const = 0;
  // The allocator served, for in-process administration.
  virtual Allocator& allocator() = 0;
  // Prometheus text: per node and GPU memory allocated/free, GPUs by mode,
  // queue length, grants, releases, refusals.
  virtual std::string MetricsText() const = 0;
  // The HTTP metrics port, 0 without metrics_address.
  virtual int metrics_port() const = 0;
  // Stops serving; waiting allocations end with an error. Idempotent.
  virtual void Stop() = 0;
  virtual void Wait() = 0;
};

struct CentralClientOptions {
  // host:port of deepnex-central.
  std::string address;
  std::string token;
  std::string token_file;
  std::string tls_ca_file;
  // Deadline of every call but a waiting Allocate (its own timeout, plus
  // this).
  // Default: 30s
  std::chrono::milliseconds timeout{30000};
};

// The Allocator's methods over gRPC. Thread-safe.
class CentralClient {
 public:
  static absl::StatusOr<std::unique_ptr<CentralClient>> Create(
      const CentralClientOptions& options);
  virtual ~CentralClient() = default;

  virtual absl::Status AddNode(const Node& node) = 0;
  virtual absl::Status RemoveNode(const std::string& name) = 0;
  virtual absl::Status SetNodeMode(const std::string& name, Mode mode,
                                   ModeSwitch when = ModeSwitch::kRefuse) = 0;
  virtual absl::Status Cordon(const std::string& name) = 0;
  virtual absl::Status Uncordon(const std::string& name) = 0;
  virtual absl::Status Drain(const std::string& name, bool release = false) = 0;
  // `user` empty: the default quota.
  virtual absl::StatusOr<std::string> SetQuota(const std::string& user,
                                               const Quota& quota) = 0;
  // Quotas with usage (see Allocator::Quotas). A user token sees only its
  // own (PermissionDenied for another user's); `user` empty then means the
  // caller.
  virtual absl::StatusOr<std::vector<UserQuota>> Quotas(const std::string& user = "") = 0;
  // The queue (see Allocator::Pending); a user sees only their own requests.
  virtual absl::StatusOr<std::vector<PendingRequest>> Pending(const std::string& user = "") = 0;
  // `request.user` empty: the caller's user.
  virtual absl::StatusOr<Allocation> Allocate(const Request& request,
                                              const AllocateOptions& options = {}) = 0;
  virtual absl::StatusOr<std::vector<Allocation>> AllocateGang(
      const Request& request, const AllocateOptions& options = {}) = 0;
  virtual absl::Status Release(const std::string& id) = 0;
  virtual absl::StatusOr<Allocation> Renew(const std::string& id) = 0;
  // Asynchronous forms (see Allocator::AllocateGangAsync): `done` runs once,
  // on a gRPC thread. Calls in flight together travel in one RPC, so a
  // client that keeps many in flight is far faster than blocking threads.
  // A waiting Allocate (options.wait) travels alone, with its own deadline,
  // and returns a ticket for Withdraw (else 0).
  virtual uint64_t AllocateGangAsync(const Request& request, const AllocateOptions& options,
                                     Allocator::AllocateDone done) = 0;
  // Cancels the waiting Allocate of `ticket` (its caller gave up: a Ctrl-C):
  // central takes it out of the queue and `done` gets Cancelled, or the
  // grant that crossed the cancel. Nothing for a ticket already answered.
  virtual void Withdraw(uint64_t ticket) = 0;
  virtual void ReleaseAsync(const std::string& id, Allocator::Done done) = 0;
  // A user sees only their own; `user` filters (admins).
  virtual absl::StatusOr<std::vector<Allocation>> Allocations(const std::string& user = "") = 0;
  virtual absl::StatusOr<std::vector<NodeInfo>> Nodes() = 0;
  virtual absl::StatusOr<std::string> Metrics() = 0;
};

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_CENTRAL_H_
