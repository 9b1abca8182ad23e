// The parameter server's gRPC service: the tensors it holds, the RPC
// handlers over them, and the checkpoints it takes of them (the file itself
// is ps/checkpoint.h's). Private to libdeepnex; ServerImpl (server.cc)
// serves it and drives its leases and periodic checkpoints.
#ifndef DEEPNEX_PS_SERVICE_H_
#define DEEPNEX_PS_SERVICE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/grpc_util.h"
#include "deepnex/auth.h"
#include "deepnex/metrics.h"
#include "deepnex/ps.grpc.pb.h"
#include "deepnex/ps/server.h"
#include "ps/bulk_channel.h"
#include "ps/membership.h"
#include "ps/partition.h"
#include "ps/reply_buffers.h"
#include "ps/server_metrics.h"
#include "ps/shm_channel.h"

namespace deepnex::ps {

using ServiceBase = proto::ParameterServer::WithCallbackMethod_Register<
    proto::ParameterServer::WithCallbackMethod_Heartbeat<
        proto::ParameterServer::WithCallbackMethod_Leave<
            proto::ParameterServer::WithCallbackMethod_Stats<
                proto::ParameterServer::WithCallbackMethod_Checkpoint<
                    proto::ParameterServer::WithCallbackMethod_Claim<
                        proto::ParameterServer::WithCallbackMethod_Commit<
                            proto::ParameterServer::WithCallbackMethod_Describe<
                                proto::ParameterServer::WithRawCallbackMethod_WriteParts<
                                    proto::ParameterServer::WithRawCallbackMethod_Push<
                                        proto::ParameterServer::WithRawCallbackMethod_Pull<
                                            proto::ParameterServer::Service>>>>>>>>>>>;

class Call;
class BulkConnection;

// Where a push or pull came from: gRPC, or a bulk connection.
class CallSite {
 public:
  virtual ~CallSite() = default;
  // The connection, for the reply bytes it may hold (max_pending_reply_bytes).
  virtual std::string peer() const = 0;
  // The one worker the connection speaks for, or none (gRPC: any caller
  // that authenticates).
  virtual std::optional<int> worker() const { return std::nullopt; }
  // Ties `call` to the transport, before any partition sees it; its reply
  // goes back that way.
  virtual void Bind(std::shared_ptr<Call> call) = 0;
};

// The tensors this server holds, and the RPC handlers over them.
// Thread-safe: `mu_` guards the directory of tensors only; data operations
// lock the partitions they touch.
class Service final : public ServiceBase, public SnapshotSink, public DeferredLimit {
 public:
  // `job_token`: the table holds the job's token alone (see ServerOptions).
  Service(const ServerOptions& options, TokenTable tokens, bool job_token);
  ~Service() override;

  // Collects the partitions' periodic snapshots; once every partition has
  // given the same version, they form a checkpoint (see WritePeriodic).
  void Periodic(const Partition* partition, PartitionState state) override;

  absl::Status Take(int worker, uint64_t bytes) override;

  void Give(int worker, uint64_t bytes) override;

  // Writes the newest complete set of periodic snapshots, if any.
  absl::Status WritePeriodic();

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx,
                                     const proto::RegisterRequest* req,
                                     proto::RegisterReply* reply) override;

  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const proto::HeartbeatRequest* req,
                                      proto::HeartbeatReply*) override;

  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* ctx, const proto::LeaveRequest* req,
                                  proto::LeaveReply*) override;

  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const proto::StatsRequest*,
                                  proto::StatsReply* reply) override;

  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* ctx,
                                       const proto::CheckpointRequest* req,
                                       proto::CheckpointReply* reply) override;

  grpc::ServerUnaryReactor* Claim(grpc::CallbackServerContext* ctx, const proto::ClaimRequest* req,
                                  proto::ClaimReply* reply) override;

  grpc::ServerUnaryReactor* Commit(grpc::CallbackServerContext* ctx,
                                   const proto::CommitRequest* req, proto::CommitReply*) override;

  grpc::ServerUnaryReactor* Describe(grpc::CallbackServerContext* ctx,
                                     const proto::DescribeRequest* req,
                                     proto::DescribeReply* reply) override;

  grpc::ServerUnaryReactor* WriteParts(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;

  grpc::ServerUnaryReactor* Push(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;

  grpc::ServerUnaryReactor* Pull(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;

  // A push or pull from `site`, whose caller is authenticated. Binds the
  // call to `site` unless it returns an error or has no partition to wait
  // for; then the caller replies with the status (and `response`) at once.
  absl::Status StartPush(CallSite* site, const grpc::ByteBuffer& request,
                         grpc::ByteBuffer* response);
  absl::Status StartPull(CallSite* site, const grpc::ByteBuffer& request,
                         grpc::ByteBuffer* response);

  // Closes the bulk listener and every bulk connection, failing their calls;
  // returns once their threads are gone. Idempotent.
  void StopBulk();

  // Expires leases that ran out; rounds then shrink or abort.
  void ExpireLeases();

  // Fails every waiting call (the server is stopping).
  void FailWaiters(const absl::Status& status);

  absl::StatusOr<uint64_t> WriteCheckpoint(const std::string& dir,
                                           std::chrono::milliseconds timeout);

  // Loads <dir>/<name>.ckpt; nothing is changed unless all of it is good.
  absl::Status Restore(const std::string& dir);

  std::string MetricsText() const { return metrics_.registry.PrometheusText(); }
  uint64_t checkpoints_written() const { return metrics_.checkpoints->value(); }
  const MetricsRegistry* registry() const { return &metrics_.registry; }
  // Whether an HTTP request with this Authorization header value may read
  // /metrics: a token that may call this server.
  absl::Status AuthorizeMetrics(const std::string& authorization) const;

 private:
  struct Tensor {
    std::unique_ptr<proto::TensorMeta> meta;  // on the server holding part 0
    // On the other servers: the description their parts were written with,
    // which a checkpoint of them is read back against.
    std::unique_ptr<proto::TensorMeta> parts_meta;
    int claimed_by = -1;  // -1: nobody (restored from a checkpoint)
    std::map<uint32_t, std::unique_ptr<Partition>> parts;
  };

  // The metas, and the partitions with their (key, part), as they stand.
  proto::CheckpointFile Directory(std::vector<std::pair<std::string, uint32_t>>* names,
                                  std::vector<Partition*>* parts);

  absl::Status Write(const std::string& dir, uint64_t round, proto::CheckpointFile file,
                     const std::vector<std::pair<std::string, uint32_t>>& names,
                     const std::vector<Partition*>& parts, std::vector<PartitionState> states);

  std::vector<Partition*> AllPartitions();

  void MembershipChanged();

  void FillStats(proto::StatsReply* reply);

  // Who is calling. TokenTable lets a job-scoped token act on any job when
  // the server names none; here a job's token reaches only its job's
  // servers, so without a job_id no job-scoped token is taken.
  absl::StatusOr<Identity> Caller(const grpc::ServerContextBase& ctx) const;
  absl::StatusOr<Identity> OfThisServer(Identity who) const;

  absl::Status Authenticate(const grpc::ServerContextBase& ctx) const;

  // Where a Checkpoint call may write: a directory inside checkpoint_dir,
  // for an admin or the job's token. Counts the call in checkpoint_calls_
  // when it returns a directory.
  absl::StatusOr<std::string> CheckpointTarget(const grpc::ServerContextBase& ctx,
                                               const proto::CheckpointRequest& req);

  // Where each slice's values go in the reply, and its size: within
  // max_pull_reply_bytes, and each partition named once (a slice repeated
  // would copy the same values again for nothing).
  // `op` names the call in errors ("pull", or "push" asking for its values).
  absl::Status PullLayout(const char* op,
                          const google::protobuf::RepeatedPtrField<proto::Slice>& slices,
                          const std::vector<Partition*>& parts, std::vector<uint64_t>* offsets,
                          uint64_t* total) const;

  // Counts `bytes` of pull replies against the connection `peer`, refused
  // past max_pending_reply_bytes unless the connection holds none.
  absl::Status HoldReply(const std::string& peer, uint64_t bytes);

  void ReleaseReply(const std::string& peer, uint64_t bytes);

  // A call that failed (cancelled, say) may have left a waiting pull or a
  // kept push in its partitions; drop them now rather than when the
  // partition next moves, which may be never.
  static void DropFinished(const std::vector<Partition*>& parts, bool failed);

  absl::Status CheckWorker(int worker, const char* op) const;

  // A call whose values travel in the caller's shared-memory segment:
  // finds the segment of (worker, incarnation) (FailedPrecondition without
  // one: the lease ended or the server restarted, and the client resends
  // over TCP) and checks that `region` lies inside it.
  absl::StatusOr<std::shared_ptr<ShmSegment>> ShmOf(const char* op, int worker,
                                                    uint64_t incarnation,
                                                    const proto::ShmRegion& region) const;

  // Register: the caller's position for this server in its list of servers
  // (RegisterRequest's server_index of num_servers). The first one given
  // stays; another is FailedPrecondition, naming both.
  absl::Status ClaimPosition(const proto::RegisterRequest& req);

  // Register: a segment for a caller on this host that asks for one.
  void OfferShm(const proto::RegisterRequest& req, proto::RegisterReply* reply);

  // Register: a bulk connection's ticket, for a caller that asks for one.
  void OfferBulk(const proto::RegisterRequest& req, proto::RegisterReply* reply);

  // The worker left (as `incarnation`; 0: whichever) or its lease expired:
  // its bulk connection closes, failing its calls.
  void DropBulk(int worker, uint64_t incarnation);

  // service_bulk.cc: serves a connection the listener admitted.
  void ServeBulk(std::shared_ptr<BulkStream> stream, int worker, uint64_t incarnation);
  friend class BulkConnection;

  absl::Status CheckCall(const grpc::ServerContextBase& ctx, int worker, const char* op) const;

  // PermissionDenied when `site` speaks for a worker other than `worker`.
  absl::Status CheckSite(const CallSite& site, int worker, const char* op) const;

  // Finds each slice's partition and checks the slice against it; with
  // `payload`, also that it holds exactly the slices' bytes.
  absl::Status Resolve(const char* op,
                       const google::protobuf::RepeatedPtrField<proto::Slice>& slices,
                       std::vector<Partition*>* parts, const PayloadReader* payload);

  absl::Status DoClaim(const grpc::ServerContextBase& ctx, const proto::ClaimRequest& req,
                       proto::ClaimReply* reply);

  absl::Status DoWriteParts(const grpc::ServerContextBase& ctx, const grpc::ByteBuffer& request);

  absl::Status DoDescribe(const grpc::ServerContextBase& ctx, const proto::DescribeRequest& req,
                          proto::DescribeReply* reply);

  const ServerOptions options_;
  const TokenTable tokens_;
  const bool job_token_;
  Membership membership_;
  ServerMetrics metrics_;
  PartitionConfig config_;
  std::atomic<int> drops_left_;
  std::atomic<int> checkpoint_calls_{0};  // Checkpoint RPCs in progress
  std::mutex limits_mu_;
  std::vector<uint64_t> deferred_bytes_;  // per worker; guarded by limits_mu_
  // Pull reply bytes held per connection ("ipv4:host:port"); guarded by
  // limits_mu_.
  std::unordered_map<std::string, uint64_t> pending_by_peer_;
  // Idle buffers up to one default max_message_bytes of replies.
  const std::shared_ptr<ReplyBuffers> reply_buffers_ =
      std::make_shared<ReplyBuffers>(256ull << 20);
  const std::string host_id_;
  std::unique_ptr<ShmBroker> shm_;  // null: TCP only
  std::mutex bulk_mu_;
  std::unique_ptr<BulkListener> bulk_;  // null: gRPC only; guarded by bulk_mu_
  std::set<std::shared_ptr<BulkConnection>> bulk_connections_;  // guarded by bulk_mu_
  std::mutex mu_;
  std::unordered_map<std::string, Tensor> tensors_;
  // The first position a client gave this server (ClaimPosition), and whose
  // client it was; guarded by mu_.
  struct Position {
    uint32_t index = 0, count = 0;  // count 0: none given yet
    int worker = 0;
  } position_;
  std::mutex checkpoint_mu_;  // one checkpoint written at a time
  std::mutex periodic_mu_;
  std::map<uint64_t, std::map<const Partition*, PartitionState>> periodic_;
  uint64_t last_periodic_ = 0;
};

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_SERVICE_H_
