// The parameter-server client used by each worker of a job.
#ifndef DEEPNEX_PS_CLIENT_H_
#define DEEPNEX_PS_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "deepnex/status.h"
#include "deepnex/tensor.h"
#include "deepnex/transport.h"

namespace deepnex::ps {

// How a client moves push and pull values to a server. kAuto: shared
// memory with a server on this host that offers it, TCP otherwise; kShm:
// FailedPrecondition if a server cannot give it.
using ::deepnex::ParseTransport;
using ::deepnex::Transport;
using ::deepnex::TransportName;

struct ClientOptions {
  // host:port of every server of the job, each once, in the same order on
  // every worker (it decides placement). A server refuses a client that
  // lists it at another position than the first client did
  // (FailedPrecondition); a repeated address is InvalidArgument.
  std::vector<std::string> servers;
  // This worker's id, 0..num_workers-1, or -1 for an observer that only
  // reads (pull, describe, stats) and never joins the job. Default: 0
  int worker_id = 0;
  // Largest partition a tensor is cut into; the first init of a tensor fixes
  // its partitioning for every client. Default: 4 MiB
  uint64_t partition_bytes = 4ull << 20;
  // Partitions bound for one server are batched into requests of about this
  // many bytes, all in flight at once. Default: 4 MiB
  uint64_t request_bytes = 4ull << 20;
  // Deadline of each operation, retries included. Default: 60 s
  std::chrono::milliseconds timeout{60000};
  // First delay between retries of an Unavailable call; doubles each time.
  // Default: 50 ms
  std::chrono::milliseconds retry_backoff{50};
  // TCP connections per server. Default: 2
  int connections_per_server = 2;
  // Bearer token, or a file holding it. Default: none
  std::string token;
  std::string token_file;
  // TLS: PEM root certificates to verify the servers. Empty: plaintext.
  std::string tls_ca_file;
  // Renew this worker's lease on every server from a thread of the client's,
  // at the interval the servers ask for. Default: true
  bool heartbeat = true;
  // The environment variable DEEPNEX_PS_TRANSPORT (auto|tcp|shm), when set,
  // overrides this. Default: kAuto
  Transport transport = Transport::kAuto;
  // Bytes of the shared-memory segment asked of each server on this host
  // (the server may give less); a request that finds no room in it goes
  // over TCP. Default: 256 MiB
  uint64_t shm_bytes = 256ull << 20;

  // InvalidArgument naming the field for a bad value.
  absl::Status Validate() const;
};

// A named tensor in a push, pull or init.
struct NamedTensor {
  std::string key;
  TensorView view;
};

// Shape and dtype of a tensor held by the servers.
struct TensorInfo {
  std::string key;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  // Updates applied to its first partition: rounds (sync, ssp) or pushes
  // (async). After a server restart, training resumes at version + 1.
  uint64_t version = 0;
};

// One server's counters, as Client::Stats() reads them.
struct WorkerStats {
  int worker = 0;
  std::string state;        // "expected", "live", "dead" or "left"
  uint64_t pushes = 0;
  uint64_t max_lead = 0;    // most rounds ahead of the applied version at a pull
  uint64_t late_pushes = 0; // pushes for rounds completed without them
};
struct ServerStats {
  std::string address;
  std::string mode;
  int staleness = 0;
  int num_workers = 0;
  int live_workers = 0;
  uint64_t pushes = 0, pulls = 0, bytes_in = 0, bytes_out = 0;
  uint64_t rounds = 0;  // completed, summed over partitions
  double round_latency_p50 = 0, round_latency_p99 = 0;  // seconds
  uint64_t lease_expiries = 0;
  uint64_t checkpoints = 0;
  uint64_t checkpoint_round = 0;  // the round of the last checkpoint written
  uint64_t min_version = 0, max_version = 0;
  std::vector<WorkerStats> workers;
  std::string prometheus;  // the server's metrics as Prometheus text
};

// An operation in flight. Wait() may be called from any thread, repeatedly.
class PendingOp {
 public:
  virtual ~PendingOp() = default;
  // Waits up to `timeout` for the operation; DeadlineExceeded if it is still
  // running then (it keeps running), else the operation's status.
  virtual absl::Status Wait(std::chrono::milliseconds timeout) = 0;
  // Waits without a limit of its own (the operation has its deadline).
  virtual absl::Status Wait() = 0;
  virtual bool Done() const = 0;
};

// A worker's connection to the job's parameter servers.
//
// Each client is one incarnation of its worker id: it registers with every
// server, holds a lease there by heartbeats, and numbers its pushes of each
// key so that a retried push is applied once. A push that fails while a
// server may have taken part of it (a timeout, a server out of reach) says
// so, and its unsure requests go again, with their seqs, at the start of
// the client's next call (or in Close): every part of a tensor stays at the
// same step. One every server refused outright took nothing. When a server
// says the lease expired or that it restarted, the client registers again
// as a new incarnation, which joins at the first round it has not pushed
// into.
// Thread-safe: operations may be issued from several threads; a push and
// a pull of the same key from different threads are not ordered.
class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Create(
      const ClientOptions& options);
  virtual ~Client() = default;

  // Creates the tensors. For each key the first init wins on every server;
  // later inits of the same shape and dtype are no-ops (then pull to get the
  // winner's values), of another shape or dtype InvalidArgument.
  // Returns once every tensor is fully initialized on its servers.
  virtual absl::Status Init(const std::vector<NamedTensor>& tensors) = 0;

  // Sync and ssp modes: joins this worker's next round of each key (ssp: a
  // round more than `staleness` ahead of the slowest worker waits). Async
  // mode: applied at once. Applied exactly once even when retried.
  virtual absl::Status Push(const std::vector<NamedTensor>& grads) = 0;
  // Into the caller's tensors. Sync mode: waits until the round of this
  // worker's last push of each key has been applied; ssp: that round minus
  // the staleness; async: until this worker's last push is applied.
  virtual absl::Status Pull(const std::vector<NamedTensor>& out) = 0;
  // Push then pull into `out` (same keys or others).
  virtual absl::Status PushPull(const std::vector<NamedTensor>& grads,
                                const std::vector<NamedTensor>& out) = 0;

  // Asynchronous variants: the tensors must stay alive and unchanged (the
  // outputs untouched) until the returned op is done.
  virtual std::shared_ptr<PendingOp> PushAsync(
      const std::vector<NamedTensor>& grads) = 0;
  virtual std::shared_ptr<PendingOp> PullAsync(
      const std::vector<NamedTensor>& out) = 0;
  virtual std::shared_ptr<PendingOp> PushPullAsync(
      const std::vector<NamedTensor>& grads,
      const std::vector<NamedTensor>& out) = 0;

  // Shape and dtype of each key (NotFound for a key never initialized).
  virtual absl::StatusOr<std::vector<TensorInfo>> Describe(
      const std::vector<std::string>& keys) = 0;

  // Every server's counters, in the order of ClientOptions::servers.
  virtual absl::StatusOr<std::vector<ServerStats>> Stats() = 0;
  // Asks every server to checkpoint (see Server::Checkpoint) into
  // <checkpoint_dir>/<name>, checkpoint_dir being the server's own
  // (--checkpoint-dir); "" names checkpoint_dir itself, where periodic
  // checkpoints go. `name` is one path component of letters, digits, '.',
  // '-' and '_', not "." or "..". Needs an admin token or the job's token.
  // Returns the round each server cut at.
  virtual absl::StatusOr<std::vector<uint64_t>> Checkpoint(const std::string& name) = 0;

  virtual int worker_id() const = 0;
  // Leaves the job cleanly (the servers stop waiting for this worker) and
  // ends the session; later calls are FailedPrecondition. Idempotent. A
  // client that pushed nothing (made to describe or pull before training)
  // leaves a worker the servers had not seen yet still awaited. A push that
  // failed unsure (see above) goes again first; the error, when it cannot,
  // says the servers may hold it in part.
  virtual absl::Status Close() = 0;
  // Close(), the worker leaving for good whether or not this client pushed:
  // how an elastic job's rank 0 releases the slots a generation leaves empty.
  virtual absl::Status Leave() = 0;
};

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_CLIENT_H_
