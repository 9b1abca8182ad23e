// The parameter server: holds the partitions of dense tensors that clients
// assign to it, aggregates pushes and applies the server-side optimizer.
#ifndef DEEPNEX_PS_SERVER_H_
#define DEEPNEX_PS_SERVER_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "deepnex/ps/optimizer.h"
#include "deepnex/status.h"

namespace deepnex::ps {

enum class Mode {
  kSync,   // a round completes when every worker pushed for it
  kSsp,    // as sync, but a worker may run `staleness` rounds ahead
  kAsync,  // each push is applied at once
};
const char* ModeName(Mode mode);
absl::StatusOr<Mode> ParseMode(const std::string& name);

// What a server does when a worker's lease expires in sync or ssp mode.
enum class LeasePolicy {
  kShrink,  // rounds complete with the workers left
  kAbort,   // every waiting call fails with Aborted naming the worker
};
const char* LeasePolicyName(LeasePolicy policy);
absl::StatusOr<LeasePolicy> ParseLeasePolicy(const std::string& name);

// How a sync round combines the workers' gradients before the optimizer.
enum class Reduction { kMean, kSum };
const char* ReductionName(Reduction reduction);
absl::StatusOr<Reduction> ParseReduction(const std::string& name);

struct ServerOptions {
  // Where to listen; port 0 lets the OS pick (see Server::address()).
  // Default: "127.0.0.1:0"
  std::string address = "127.0.0.1:0";
  // The host (a name or an address, no port) peers dial, advertised by
  // address(). Empty: the listen host, or for a wildcard listen host
  // (0.0.0.0, [::]) this host's primary address: the source of the route to
  // $DEEPNEX_STORE_ADDR or $DEEPNEX_CENTRAL, else the first non-loopback
  // address. Default: ""
  std::string advertise;
  // Default: kSync
  Mode mode = Mode::kSync;
  // Workers taking part; worker ids are 0..num_workers-1, at most
  // kMaxWorkers (the server keeps state and metrics per worker). Default: 1
  static constexpr int kMaxWorkers = 1 << 16;
  int num_workers = 1;
  // kSsp: rounds a worker may run ahead of the slowest live worker; a
  // worker that has pushed round c waits (in pull) until round c - staleness
  // is applied. Must be 0 in sync mode. Default: 0
  int staleness = 0;
  // Sync mode: mean or sum of the round's gradients. Default: kMean
  Reduction reduction = Reduction::kMean;
  OptimizerConfig optimizer;
  // A worker's lease ends this long after its last heartbeat. Default: 10 s
  std::chrono::milliseconds lease_timeout{10000};
  // How often clients renew their leases (the server tells them when they
  // register). 0: a quarter of lease_timeout. Default: 0
  std::chrono::milliseconds heartbeat_interval{0};
  // Default: kShrink
  LeasePolicy lease_policy = LeasePolicy::kShrink;
  // kShrink: what a dead worker pushed into rounds still open is kept
  // (true) or dropped. Default: true
  bool keep_dead_contributions = true;
  // Refuse gradients holding NaN or Inf (InvalidArgument); when false they
  // are applied as given. Default: true
  bool reject_nonfinite = true;
  // Largest request the server accepts; larger ones are ResourceExhausted.
  // Default: 256 MiB
  uint64_t max_message_bytes = 256ull << 20;
  // Largest pull reply: a pull whose slices add up to more is
  // ResourceExhausted. 0: max_message_bytes. Default: 0
  uint64_t max_pull_reply_bytes = 0;
  // Pull reply bytes that one client connection may have held on the
  // server: pulls waiting for their round, and replies the client has not
  // read yet. A pull past it is ResourceExhausted; a connection with none
  // held may always pull one reply. Default: 1 GiB
  uint64_t max_pending_reply_bytes = 1ull << 30;
  // Bytes of pushes that one worker may have the server keep for later (a
  // push whose earlier seq of the key has not arrived, or an ssp round too
  // far ahead); a push past it is ResourceExhausted. Kept pushes are dropped
  // when their callers go. Default: 256 MiB
  uint64_t max_deferred_push_bytes = 256ull << 20;
  // Largest shared-memory segment the server makes for a client on its host
  // (same hostname and boot id, same uid), through which that client's
  // pushes and pulls move instead of TCP; it counts against the server's
  // memory as far as the client fills it. 0: TCP only. Default: 1 GiB
  uint64_t max_shm_bytes = 1ull << 30;
  // Offer each client a plain TCP connection beside gRPC, on a port the OS
  // picks on the listen host, through which its pushes and pulls move
  // (their values too unless they go through shared memory); it costs
  // about 0.7x gRPC's CPU per round. Never with TLS. A client that cannot
  // reach the port stays on gRPC. Default: true
  bool bulk_tcp = true;
  // Bearer token every call must carry, or a token file (see auth.h).
  // Both empty: no auth. A token given alone (token, or a file holding only
  // it) is the job's token. Default: ""
  std::string token;
  std::string token_file;
  // The job this server belongs to; job-scoped tokens of other jobs are
  // refused, and so are all job-scoped tokens when it is empty.
  // Default: "" (none)
  std::string job_id;
  // TLS: PEM certificate chain and private key. Both empty: plaintext.
  std::string tls_cert_file;
  std::string tls_key_file;

  // This server's name among the job's servers; its checkpoint file is
  // <dir>/<name>.ckpt. Default: "ps"
  std::string name = "ps";
  // Where periodic checkpoints go, and the only place a Checkpoint call
  // from the wire may write: it names a directory inside this one (see
  // Client::Checkpoint). Default: "" (none; such calls are refused)
  std::string checkpoint_dir;
  // Checkpoint every N rounds (sync, ssp: cut when round N, 2N, ... is
  // applied; async: every N * num_workers pushes). 0: off. Default: 0
  uint64_t checkpoint_every_rounds = 0;
  // Checkpoint every this long. 0: off. Default: 0
  std::chrono::milliseconds checkpoint_interval{0};
  // Start from <restore_dir>/<name>.ckpt: values, optimizer state, rounds
  // and the workers' push sequences. Default: "" (start empty)
  std::string restore_dir;
  // Serve Prometheus text at http://<metrics_address>/metrics ("host:port",
  // port 0 picks one). Default: "" (off)
  std::string metrics_address;

  // Testing only: the first N pushes applied answer Unavailable, as if
  // their replies were lost, so that clients retry them. Default: 0
  int drop_push_replies_for_testing = 0;

  // InvalidArgument naming the field for a bad value.
  absl::Status Validate() const;
};

// A running parameter server. Thread-safe: Stop() may be called from any
// thread; the server serves from gRPC's threads until then.
class Server {
 public:
  // Starts serving; on success the server is listening.
  static absl::StatusOr<std::unique_ptr<Server>> Create(
      const ServerOptions& options);
  virtual ~Server() = default;

  // "host:port" with the port actually bound.
  virtual std::string address() const = 0;
  virtual int port() const = 0;
  // Stops accepting calls; calls in flight end with Unavailable. Idempotent.
  virtual void Stop() = 0;
  // Blocks until Stop() (from another thread or a signal handler's thread).
  virtual void Wait() = 0;

  // Writes a checkpoint to <dir>/<name>.ckpt atomically (temp file, fsync,
  // rename; the previous one stays until the new one is complete). In sync
  // and ssp modes it is cut at a round boundary: the latest round applied
  // on any partition, waiting up to `timeout` for the others to reach it
  // (after Stop(), which completes no more rounds, FailedPrecondition at
  // once where one is behind). Returns the round it holds. From the first checkpoint into `dir` until
  // Stop, the server holds <dir>/<name>.lock: FailedPrecondition where
  // another server of this name holds it. `dir` is the embedding program's choice;
  // calls from the wire (Client::Checkpoint) only name a directory inside
  // ServerOptions::checkpoint_dir.
  virtual absl::StatusOr<uint64_t> Checkpoint(
      const std::string& dir,
      std::chrono::milliseconds timeout = std::chrono::seconds(60)) = 0;
  // The port serving /metrics (0 if off) and the text it serves.
  virtual int metrics_port() const = 0;
  virtual std::string MetricsText() const = 0;
};

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_SERVER_H_
