// CentralClient: blocking unary calls to deepnex-central, each with a
// deadline; a waiting Allocate gets its own timeout plus the client's.
// The asynchronous Allocate and Release travel in Batch calls: while
// kBatchesInFlight batches are out, new ops gather and leave together when
// one returns, so a client with many calls in flight pays for few RPCs.
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/grpc_util.h"
#include "core/text.h"
#include "deepnex/central.grpc.pb.h"
#include "deepnex/gpu/central.h"
#include "deepnex/units.h"
#include "gpu/central_convert.h"

namespace deepnex::gpu {
namespace {

// Two: one batch on the wire while the next gathers behind it.
constexpr int kBatchesInFlight = 2;

std::vector<Allocation> AllocationsFrom(const google::protobuf::RepeatedPtrField<pb::Allocation>& as) {
  std::vector<Allocation> out;
  for (const auto& a : as) out.push_back(FromProto(a));
  return out;
}

class CentralClientImpl final : public CentralClient {
 public:
  CentralClientImpl(const CentralClientOptions& options, std::string token)
      : options_(options), token_(std::move(token)) {}

  // Cancels the calls in flight, blocking ones (a waiting Allocate on
  // another thread returns Cancelled) and asynchronous ones (their ops are
  // answered Cancelled, or with the answer that crossed the cancel), and
  // waits for them to return.
  ~CentralClientImpl() override {
    std::unique_lock<std::mutex> lock(mu_);
    closing_ = true;
    for (grpc::ClientContext* ctx : in_flight_) ctx->TryCancel();
    for (grpc::ClientContext* ctx : blocking_) ctx->TryCancel();
    cv_.wait(lock, [this] { return in_flight_.empty() && blocking_.empty(); });
  }

  absl::Status Connect() {
    DEEPNEX_ASSIGN_OR_RETURN(auto credentials, MakeChannelCredentials(options_.tls_ca_file));
    DEEPNEX_ASSIGN_OR_RETURN(auto channel, Dial("central", options_.address, credentials,
                                                std::min(options_.timeout, kConnectTimeout)));
    stub_ = pb::Central::NewStub(channel);
    return absl::OkStatus();
  }

  absl::Status AddNode(const Node& node) override {
    pb::Node req;
    ToProto(node, &req);
    pb::Empty reply;
    return Call(req, options_.timeout, [&](auto* ctx) { return stub_->AddNode(ctx, req, &reply); });
  }
  absl::Status RemoveNode(const std::string& name) override {
    pb::NameRequest req;
    req.set_name(name);
    pb::Empty reply;
    return Call(req, options_.timeout,
                [&](auto* ctx) { return stub_->RemoveNode(ctx, req, &reply); });
  }
  absl::Status SetNodeMode(const std::string& name, Mode mode, ModeSwitch when) override {
    pb::ModeRequest req;
    req.set_name(name);
    req.set_mode(ModeName(mode));
    req.set_when_drained(when == ModeSwitch::kWhenDrained);
    pb::Empty reply;
    return Call(req, options_.timeout,
                [&](auto* ctx) { return stub_->SetNodeMode(ctx, req, &reply); });
  }
  absl::Status Cordon(const std::string& name) override {
    pb::NameRequest req;
    req.set_name(name);
    pb::Empty reply;
    return Call(req, options_.timeout, [&](auto* ctx) { return stub_->Cordon(ctx, req, &reply); });
  }
  absl::Status Uncordon(const std::string& name) override {
    pb::NameRequest req;
    req.set_name(name);
    pb::Empty reply;
    return Call(req, options_.timeout,
                [&](auto* ctx) { return stub_->Uncordon(ctx, req, &reply); });
  }
  absl::Status Drain(const std::string& name, bool release) override {
    pb::DrainRequest req;
    req.set_name(name);
    req.set_release(release);
    pb::Empty reply;
    return Call(req, options_.timeout, [&](auto* ctx) { return stub_->Drain(ctx, req, &reply); });
  }
  absl::StatusOr<std::string> SetQuota(const std::string& user, const Quota& quota) override {
    pb::QuotaRequest req;
    req.set_user(user);
    ToProto(quota, req.mutable_quota());
    pb::NoteReply reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(req, options_.timeout, [&](auto* ctx) { return stub_->SetQuota(ctx, req, &reply); }));
    return reply.note();
  }
  absl::StatusOr<std::vector<UserQuota>> Quotas(const std::string& user) override {
    pb::QuotasRequest req;
    req.set_user(user);
    pb::Quotas reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(req, options_.timeout, [&](auto* ctx) { return stub_->GetQuotas(ctx, req, &reply); }));
    std::vector<UserQuota> out;
    for (const auto& q : reply.quotas()) out.push_back(FromProto(q));
    return out;
  }
  absl::StatusOr<std::vector<PendingRequest>> Pending(const std::string& user) override {
    pb::PendingRequestsRequest req;
    req.set_user(user);
    pb::PendingRequests reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(req, options_.timeout,
             [&](auto* ctx) { return stub_->ListPending(ctx, req, &reply); }));
    std::vector<PendingRequest> out;
    for (const auto& p : reply.pending()) {
      DEEPNEX_ASSIGN_OR_RETURN(PendingRequest r, FromProto(p));
      out.push_back(std::move(r));
    }
    return out;
  }
  absl::StatusOr<Allocation> Allocate(const Request& request,
                                      const AllocateOptions& options) override {
    if (request.replicas != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "replicas=", request.replicas, ": Allocate grants one part; use AllocateGang"));
    }
    DEEPNEX_ASSIGN_OR_RETURN(auto parts, AllocateGang(request, options));
    return std::move(parts.front());
  }
  absl::StatusOr<std::vector<Allocation>> AllocateGang(const Request& request,
                                                       const AllocateOptions& options) override {
    pb::Request req;
    ToProto(request, options, &req);
    pb::Allocations reply;
    DEEPNEX_RETURN_IF_ERROR(Call(req, AllocateDeadline(options),
                                 [&](auto* ctx) { return stub_->Allocate(ctx, req, &reply); }));
    if (reply.allocations_size() == 0) return NoneGranted();
    return AllocationsFrom(reply.allocations());
  }
  absl::Status Release(const std::string& id) override {
    pb::IdRequest req;
    req.set_id(id);
    pb::Empty reply;
    return Call(req, options_.timeout, [&](auto* ctx) { return stub_->Release(ctx, req, &reply); });
  }
  absl::StatusOr<Allocation> Renew(const std::string& id) override {
    pb::IdRequest req;
    req.set_id(id);
    pb::Allocation reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(req, options_.timeout, [&](auto* ctx) { return stub_->Renew(ctx, req, &reply); }));
    return FromProto(reply);
  }
  absl::StatusOr<std::vector<Allocation>> Allocations(const std::string& user) override {
    pb::AllocationsRequest req;
    req.set_user(user);
    pb::Allocations reply;
    DEEPNEX_RETURN_IF_ERROR(Call(req, options_.timeout, [&](auto* ctx) {
      return stub_->ListAllocations(ctx, req, &reply);
    }));
    return AllocationsFrom(reply.allocations());
  }
  absl::StatusOr<std::vector<NodeInfo>> Nodes() override {
    pb::Empty req;
    pb::Nodes reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(req, options_.timeout, [&](auto* ctx) { return stub_->ListNodes(ctx, req, &reply); }));
    std::vector<NodeInfo> out;
    for (const auto& n : reply.nodes()) {
      DEEPNEX_ASSIGN_OR_RETURN(NodeInfo info, FromProto(n));
      out.push_back(std::move(info));
    }
    return out;
  }
  absl::StatusOr<std::string> Metrics() override {
    pb::Empty req;
    pb::MetricsReply reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(req, options_.timeout, [&](auto* ctx) { return stub_->Metrics(ctx, req, &reply); }));
    return reply.text();
  }

  uint64_t AllocateGangAsync(const Request& request, const AllocateOptions& options,
                             Allocator::AllocateDone done) override {
    if (absl::Status s = CheckForkSafe("central client"); !s.ok()) {
      done(s);
      return 0;
    }
    QueuedOp p;
    ToProto(request, options, p.op.mutable_allocate());
    // Refused alone: in a batch it failed the other ops sent with it.
    if (absl::Status s = CheckUtf8Fields(p.op.allocate()); !s.ok()) {
      done(s);
      return 0;
    }
    p.done = [done = std::move(done)](absl::Status s, pb::BatchResult* r) {
      if (s.ok() && r->allocations_size() == 0) s = NoneGranted();
      if (!s.ok()) return done(s);
      done(AllocationsFrom(r->allocations()));
    };
    if (!options.wait) {
      Enqueue(std::move(p));
      return 0;
    }
    // It may wait in the queue: a batch of its own, with its own deadline.
    std::vector<QueuedOp> alone;
    alone.push_back(std::move(p));
    return SendBatch(std::move(alone), AllocateDeadline(options), /*coalesced=*/false);
  }

  void Withdraw(uint64_t ticket) override {
    std::lock_guard<std::mutex> lock(mu_);
    // Central withdraws a queued request whose call is cancelled.
    if (auto it = waiting_.find(ticket); it != waiting_.end()) it->second->TryCancel();
  }

  void ReleaseAsync(const std::string& id, Allocator::Done done) override {
    if (absl::Status s = CheckForkSafe("central client"); !s.ok()) return done(s);
    if (!IsUtf8(id)) {
      return done(
          absl::InvalidArgumentError(absl::StrCat("id ", Quoted(id), " is not UTF-8 text")));
    }
    QueuedOp p;
    p.op.set_release(id);
    p.done = [done = std::move(done)](const absl::Status& s, pb::BatchResult*) { done(s); };
    Enqueue(std::move(p));
  }

 private:
  // An op of a Batch call and what to do with its result (`r` is null when
  // the call failed as a whole, `s` says why).
  struct QueuedOp {
    pb::BatchOp op;
    std::function<void(absl::Status s, pb::BatchResult* r)> done;
  };

  static absl::Status NoneGranted() {
    return absl::InternalError("deepnex-central granted no allocations");
  }

  // A waiting call without a timeout has no deadline of its own.
  std::chrono::milliseconds AllocateDeadline(const AllocateOptions& options) const {
    return !options.wait                 ? options_.timeout
           : options.timeout.count() > 0 ? options.timeout + options_.timeout
                                         : std::chrono::hours(24 * 365);
  }

  void Prepare(grpc::ClientContext* ctx, std::chrono::milliseconds timeout) const {
    ctx->set_deadline(std::chrono::system_clock::now() + timeout);
    // A call bounded by the client's timeout rides out a reconnect. A call
    // that may wait far longer (an Allocate queued without a timeout) must
    // not wait for a server that is gone: it fails Unavailable instead.
    ctx->set_wait_for_ready(timeout <= options_.timeout);
    if (!token_.empty()) ctx->AddMetadata(kAuthorizationKey, BearerValue(token_));
  }

  absl::Status Finished(const grpc::Status& s, std::chrono::milliseconds timeout) const {
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
        s.error_message() == "Deadline Exceeded") {
      return absl::UnavailableError(absl::StrCat("deepnex-central at ", options_.address,
                                                 " did not answer within ", timeout.count(), "ms"));
    }
    return ToAbslStatus(s);
  }

  // fn(&ctx) sends `request`: one with a string that is not UTF-8 is
  // refused here, naming the field, since no proto string can carry it (the
  // server could not parse the call and answered UNIMPLEMENTED, no message).
  template <class Fn>
  absl::Status Call(const google::protobuf::Message& request, std::chrono::milliseconds timeout,
                    Fn fn) {
    DEEPNEX_RETURN_IF_ERROR(CheckForkSafe("central client"));
    DEEPNEX_RETURN_IF_ERROR(CheckUtf8Fields(request));
    grpc::ClientContext ctx;
    Prepare(&ctx, timeout);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closing_) return absl::CancelledError("the central client was destroyed");
      blocking_.insert(&ctx);
    }
    absl::Status s = Finished(fn(&ctx), timeout);
    std::lock_guard<std::mutex> lock(mu_);
    blocking_.erase(&ctx);
    cv_.notify_all();  // the destructor may wait for this call
    return s;
  }

  // Sends `p` now if fewer than kBatchesInFlight batches are out, else with
  // the next batch.
  void Enqueue(QueuedOp p) {
    std::vector<QueuedOp> batch;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queued_.push_back(std::move(p));
      if (batches_ >= kBatchesInFlight) return;
      ++batches_;
      batch.swap(queued_);
    }
    SendBatch(std::move(batch), options_.timeout, /*coalesced=*/true);
  }

  // One Batch call. A coalesced one holds a slot of kBatchesInFlight; when
  // it returns, what queued meanwhile leaves in the next. An uncoalesced one
  // (a waiting Allocate) gets a ticket for Withdraw, returned (else 0).
  uint64_t SendBatch(std::vector<QueuedOp> ops, std::chrono::milliseconds timeout,
                     bool coalesced) {
    struct BatchCall {
      grpc::ClientContext ctx;
      pb::BatchRequest req;
      pb::BatchReply reply;
      std::vector<QueuedOp> ops;
    };
    auto* call = new BatchCall;
    Prepare(&call->ctx, timeout);
    for (auto& p : ops) call->req.add_ops()->Swap(&p.op);
    call->ops = std::move(ops);
    uint64_t ticket = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_flight_.insert(&call->ctx);
      if (!coalesced) {
        ticket = ++last_ticket_;
        waiting_[ticket] = &call->ctx;
      }
    }
    stub_->async()->Batch(
        &call->ctx, &call->req, &call->reply,
        [this, call, timeout, coalesced, ticket](grpc::Status gs) {
          absl::Status s = Finished(gs, timeout);
          const int n = static_cast<int>(call->ops.size());
          if (s.ok() && call->reply.results_size() != n) {
            s = absl::InternalError(absl::StrCat("deepnex-central answered ",
                                                 call->reply.results_size(), " of ", n, " ops"));
          }
          for (int i = 0; i < n; ++i) {
            if (!s.ok()) {
              call->ops[i].done(s, nullptr);
              continue;
            }
            pb::BatchResult* r = call->reply.mutable_results(i);
            call->ops[i].done(absl::Status(static_cast<absl::StatusCode>(r->code()), r->message()),
                              r);
          }
          std::vector<QueuedOp> next;
          bool closing = false;
          if (coalesced) {
            std::lock_guard<std::mutex> lock(mu_);
            closing = closing_;
            if (queued_.empty()) {
              --batches_;
            } else {
              next.swap(queued_);
            }
          }
          if (closing) {
            for (auto& p : next) p.done(absl::CancelledError("the CentralClient was destroyed"), nullptr);
          } else if (!next.empty()) {
            // In flight before this call leaves in_flight_, so the
            // destructor cannot miss it.
            SendBatch(std::move(next), options_.timeout, /*coalesced=*/true);
          }
          std::lock_guard<std::mutex> lock(mu_);
          in_flight_.erase(&call->ctx);
          if (ticket != 0) waiting_.erase(ticket);
          delete call;
          cv_.notify_all();
        });
    return ticket;
  }

  const CentralClientOptions options_;
  const std::string token_;
  std::unique_ptr<pb::Central::Stub> stub_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<QueuedOp> queued_;  // for the next coalesced batch
  int batches_ = 0;              // coalesced batches in flight
  std::set<grpc::ClientContext*> in_flight_;  // Batch calls
  std::set<grpc::ClientContext*> blocking_;   // Call's, on their callers' threads
  std::map<uint64_t, grpc::ClientContext*> waiting_;  // by ticket: waiting Allocates
  uint64_t last_ticket_ = 0;
  bool closing_ = false;         // the destructor runs
};

}  // namespace

absl::StatusOr<std::unique_ptr<CentralClient>> CentralClient::Create(
    const CentralClientOptions& options) {
  DEEPNEX_RETURN_IF_ERROR(CheckMillis(options.timeout, "timeout"));
  DEEPNEX_ASSIGN_OR_RETURN(std::string token,
                           ResolveClientToken(options.token, options.token_file));
  auto client = std::make_unique<CentralClientImpl>(options, std::move(token));
  DEEPNEX_RETURN_IF_ERROR(client->Connect());
  return std::unique_ptr<CentralClient>(std::move(client));
}

}  // namespace deepnex::gpu
