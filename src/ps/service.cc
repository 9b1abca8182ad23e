#include "ps/service.h"

#include <algorithm>
#include <condition_variable>
#include <limits>
#include <optional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/net.h"
#include "ps/calls.h"
#include "ps/checkpoint.h"
#include "ps/plan.h"

namespace deepnex::ps {

namespace pb = ::deepnex::ps::proto;
using Clock = std::chrono::steady_clock;

namespace {

// A default-constructed ByteBuffer is not a message; gRPC refuses to send it.
grpc::ByteBuffer EmptyMessage() { return grpc::ByteBuffer(nullptr, 0); }

}  // namespace

Service::Service(const ServerOptions& options, TokenTable tokens, bool job_token)
    : options_(options),
      tokens_(std::move(tokens)),
      job_token_(job_token),
      membership_(options.num_workers, options.lease_timeout, options.lease_policy),
      metrics_(options.num_workers),
      drops_left_(options.drop_push_replies_for_testing),
      deferred_bytes_(options.num_workers, 0),
      host_id_(HostIdentity()) {
  if (options.max_shm_bytes > 0) {
    // Without the broker's socket every client uses TCP.
    absl::StatusOr<std::unique_ptr<ShmBroker>> broker = ShmBroker::Start(options.max_shm_bytes);
    if (broker.ok()) shm_ = *std::move(broker);
  }
  // The bulk socket is plaintext: with TLS everything stays on gRPC. A
  // unix: server has no TCP host to bind it on.
  if (options.bulk_tcp && options.tls_cert_file.empty() &&
      !absl::StartsWith(options.address, "unix:")) {
    absl::StatusOr<std::unique_ptr<BulkListener>> bulk = BulkListener::Start(
        HostOf(options.address),
        [this](std::shared_ptr<BulkStream> stream, int worker, uint64_t incarnation) {
          ServeBulk(std::move(stream), worker, incarnation);
        });
    // Without it (an IPv6 listen host, say) clients stay on gRPC.
    if (bulk.ok()) bulk_ = *std::move(bulk);
  }
  config_.mode = options.mode;
  config_.num_workers = options.num_workers;
  config_.staleness = options.mode == Mode::kSsp ? options.staleness : 0;
  config_.reduction = options.reduction;
  config_.optimizer = options.optimizer;
  config_.keep_dead_contributions = options.keep_dead_contributions;
  config_.membership = &membership_;
  config_.observer = &metrics_;
  config_.deferred_limit = this;
  if (options.checkpoint_every_rounds > 0) {
    config_.snapshot_every =
        options.checkpoint_every_rounds * (options.mode == Mode::kAsync ? options.num_workers : 1);
    config_.snapshots = this;
  }
}

absl::Status Service::Take(int worker, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(limits_mu_);
  uint64_t& held = deferred_bytes_[worker];
  const uint64_t cap = options_.max_deferred_push_bytes;
  if (held > cap || bytes > cap - held) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("push: worker %d already has %d bytes of pushes kept waiting for an "
                        "earlier push or round, and %d more would pass max_deferred_push_bytes "
                        "(%d); send pushes in seq order and wait for their replies",
                        worker, held, bytes, cap));
  }
  held += bytes;
  metrics_.deferred_push_bytes->Add(static_cast<double>(bytes));
  return absl::OkStatus();
}

void Service::Give(int worker, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(limits_mu_);
  deferred_bytes_[worker] -= bytes;
  metrics_.deferred_push_bytes->Add(-static_cast<double>(bytes));
}

grpc::ServerUnaryReactor* Service::Register(grpc::CallbackServerContext* ctx,
                                            const pb::RegisterRequest* req,
                                            pb::RegisterReply* reply) {
  absl::Status s = CheckCall(*ctx, req->worker_id(), "register");
  if (s.ok() && req->incarnation() == 0) {
    s = absl::InvalidArgumentError("register: incarnation 0 is reserved");
  }
  if (s.ok()) s = ClaimPosition(*req);
  if (s.ok()) {
    membership_.Register(req->worker_id(), req->incarnation());
    metrics_.live_workers->Set(membership_.LiveCount());
    OfferShm(*req, reply);
    OfferBulk(*req, reply);
    reply->set_num_workers(options_.num_workers);
    reply->set_mode(ModeName(options_.mode));
    reply->set_staleness(config_.staleness);
    reply->set_reject_nonfinite(options_.reject_nonfinite);
    reply->set_heartbeat_interval_ms(
        options_.heartbeat_interval.count() > 0
            ? options_.heartbeat_interval.count()
            : std::max<int64_t>(1, options_.lease_timeout.count() / 4));
  }
  return Reply(ctx, s);
}

absl::Status Service::ClaimPosition(const pb::RegisterRequest& req) {
  if (req.num_servers() == 0) return absl::OkStatus();
  if (req.server_index() >= req.num_servers()) {
    return absl::InvalidArgumentError(absl::StrCat("register: server_index ", req.server_index(),
                                                   " of num_servers ", req.num_servers()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (position_.count == 0) {
    position_ = {req.server_index(), req.num_servers(), req.worker_id()};
    return absl::OkStatus();
  }
  if (position_.index == req.server_index() && position_.count == req.num_servers()) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "register: worker ", req.worker_id(), " lists this server as servers[", req.server_index(),
      "] of ", req.num_servers(), ", but worker ", position_.worker, " listed it as servers[",
      position_.index, "] of ", position_.count,
      ": every client must list the same servers, each once, in the same order (a tensor's "
      "parts are placed by that order)"));
}

grpc::ServerUnaryReactor* Service::Heartbeat(grpc::CallbackServerContext* ctx,
                                             const pb::HeartbeatRequest* req, pb::HeartbeatReply*) {
  absl::Status s = CheckCall(*ctx, req->worker_id(), "heartbeat");
  if (s.ok()) s = membership_.Heartbeat(req->worker_id(), req->incarnation());
  return Reply(ctx, s);
}

grpc::ServerUnaryReactor* Service::Leave(grpc::CallbackServerContext* ctx,
                                         const pb::LeaveRequest* req, pb::LeaveReply*) {
  absl::Status s = CheckCall(*ctx, req->worker_id(), "leave");
  if (s.ok()) {
    membership_.Leave(req->worker_id(), req->incarnation(), req->never_pushed());
    if (shm_) {
      shm_->Drop(req->worker_id(), req->incarnation());
      metrics_.shm_segments->Set(shm_->Count());
    }
    DropBulk(req->worker_id(), req->incarnation());
    metrics_.live_workers->Set(membership_.LiveCount());
    MembershipChanged();
  }
  return Reply(ctx, s);
}

grpc::ServerUnaryReactor* Service::Stats(grpc::CallbackServerContext* ctx,
                                         const pb::StatsRequest* req, pb::StatsReply* reply) {
  absl::Status s = Authenticate(*ctx);
  if (s.ok()) {
    FillStats(reply);
    // Each key once: a request naming one key a million times made a
    // million lookups of its parts (probe).
    const std::set<std::string> keys(req->keys().begin(), req->keys().end());
    const int worker = req->worker();
    std::vector<Partition*> parts;
    if (!keys.empty() && worker >= 0 && worker < options_.num_workers) {
      std::lock_guard<std::mutex> lock(mu_);
      for (const std::string& key : keys) {
        auto t = tensors_.find(key);
        if (t == tensors_.end()) continue;
        for (auto& [part, p] : t->second.parts) parts.push_back(p.get());
      }
    }
    std::set<int> awaited;
    for (const Partition* p : parts) {
      for (int w : p->Awaited(worker)) awaited.insert(w);
    }
    for (int w : awaited) reply->add_awaited(w);
  }
  return Reply(ctx, s);
}

grpc::ServerUnaryReactor* Service::Checkpoint(grpc::CallbackServerContext* ctx,
                                              const pb::CheckpointRequest* req,
                                              pb::CheckpointReply* reply) {
  absl::StatusOr<std::string> dir = CheckpointTarget(*ctx, *req);
  if (!dir.ok()) return Reply(ctx, dir.status());
  // Writing may wait for a round boundary: off gRPC's callback threads.
  auto* reactor = ctx->DefaultReactor();
  std::thread([this, reactor, dir = *std::move(dir),
               timeout = std::chrono::milliseconds(req->timeout_ms() ? req->timeout_ms() : 60000),
               reply] {
    auto round = WriteCheckpoint(dir, timeout);
    if (round.ok()) reply->set_round(*round);
    checkpoint_calls_.fetch_sub(1);  // before Finish lets the server stop
    reactor->Finish(ToGrpcStatus(round.status()));
  }).detach();
  return reactor;
}

grpc::ServerUnaryReactor* Service::Claim(grpc::CallbackServerContext* ctx,
                                         const pb::ClaimRequest* req, pb::ClaimReply* reply) {
  return Reply(ctx, DoClaim(*ctx, *req, reply));
}

grpc::ServerUnaryReactor* Service::Commit(grpc::CallbackServerContext* ctx,
                                          const pb::CommitRequest* req, pb::CommitReply*) {
  absl::Status s = Authenticate(*ctx);
  if (s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& key : req->keys()) {
      auto it = tensors_.find(key);
      if (it == tensors_.end() || !it->second.meta) {
        s = absl::NotFoundError(
            absl::StrCat("commit of \"", key, "\": the tensor was never claimed"));
        break;
      }
    }
    for (int i = 0; s.ok() && i < req->keys_size(); ++i) {
      tensors_[req->keys(i)].meta->set_ready(true);
    }
  }
  return Reply(ctx, s);
}

grpc::ServerUnaryReactor* Service::Describe(grpc::CallbackServerContext* ctx,
                                            const pb::DescribeRequest* req,
                                            pb::DescribeReply* reply) {
  return Reply(ctx, DoDescribe(*ctx, *req, reply));
}

grpc::ServerUnaryReactor* Service::WriteParts(grpc::CallbackServerContext* ctx,
                                              const grpc::ByteBuffer* request,
                                              grpc::ByteBuffer* response) {
  absl::Status s = DoWriteParts(*ctx, *request);
  if (s.ok()) *response = EmptyMessage();
  return Reply(ctx, s);
}

namespace {

// A call over gRPC: the reactor finishes it.
class GrpcSite final : public CallSite {
 public:
  explicit GrpcSite(grpc::CallbackServerContext* ctx) : ctx_(ctx) {}
  std::string peer() const override { return ctx_->peer(); }
  void Bind(std::shared_ptr<Call> call) override { reactor_ = new CallReactor(std::move(call)); }
  // The reply: the bound call's reactor, or `status` at once.
  grpc::ServerUnaryReactor* Reactor(const absl::Status& status) {
    return reactor_ != nullptr ? reactor_ : Reply(ctx_, status);
  }

 private:
  grpc::CallbackServerContext* const ctx_;
  grpc::ServerUnaryReactor* reactor_ = nullptr;
};

}  // namespace

grpc::ServerUnaryReactor* Service::Push(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) {
  GrpcSite site(ctx);
  absl::Status s = Authenticate(*ctx);
  if (s.ok()) s = StartPush(&site, *request, response);
  return site.Reactor(s);
}

grpc::ServerUnaryReactor* Service::Pull(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) {
  GrpcSite site(ctx);
  absl::Status s = Authenticate(*ctx);
  if (s.ok()) s = StartPull(&site, *request, response);
  return site.Reactor(s);
}

absl::Status Service::StartPush(CallSite* site, const grpc::ByteBuffer& request,
                                grpc::ByteBuffer* response) {
  pb::PushHeader header;
  PayloadReader payload;
  std::vector<Partition*> parts;
  DEEPNEX_RETURN_IF_ERROR(DecodeFramed(request, &header, &payload));
  DEEPNEX_RETURN_IF_ERROR(CheckWorker(header.worker_id(), "push"));
  DEEPNEX_RETURN_IF_ERROR(CheckSite(*site, header.worker_id(), "push"));
  std::shared_ptr<ShmSegment> segment;  // kept for the call's reply too
  if (header.has_shm()) {
    DEEPNEX_ASSIGN_OR_RETURN(
        segment, ShmOf("push", header.worker_id(), header.incarnation(), header.shm()));
    if (payload.remaining() > 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "push: %d bytes of values in the request as well as in shared memory",
          payload.remaining()));
    }
    payload = segment->Reader(header.shm().offset(), header.shm().bytes());
  }
  DEEPNEX_RETURN_IF_ERROR(Resolve("push", header.slices(), &parts, &payload));
  // A push of several slices is checked whole first, so that one bad slice
  // refuses all; a single slice, by its partition in the pass taking it in;
  // none that its client checked whole (a push it sent in several requests).
  const bool check = options_.reject_nonfinite && !header.finite_checked();
  const bool check_whole = check && parts.size() > 1;
  if (check_whole) {
    PayloadReader check = payload;
    for (size_t i = 0; i < parts.size(); ++i) {
      DEEPNEX_RETURN_IF_ERROR(parts[i]->CheckFinite(header.slices(i).key(), &check));
    }
  }
  std::vector<uint64_t> offsets;
  uint64_t total = 0;
  const std::string peer = header.pull() ? site->peer() : std::string();
  if (header.pull()) {
    DEEPNEX_RETURN_IF_ERROR(PullLayout("push", header.slices(), parts, &offsets, &total));
  }
  // A reply into shared memory holds no server memory.
  const uint64_t held = segment ? 0 : total;
  if (header.pull()) DEEPNEX_RETURN_IF_ERROR(HoldReply(peer, held));
  if (parts.empty()) {
    *response = header.pull() ? EncodeFramed(pb::PullHeader(), {}) : EmptyMessage();
    return absl::OkStatus();
  }

  metrics_.pushes->Add();
  metrics_.worker_pushes[header.worker_id()]->Add();
  metrics_.bytes_in->Add(payload.remaining());
  if (segment) metrics_.shm_bytes->Add(payload.remaining() + total);
  bool lose_reply = drops_left_.load() > 0 && drops_left_.fetch_sub(1) > 0;
  std::shared_ptr<PushSink> sink;
  if (header.pull()) {
    metrics_.pulls->Add();
    metrics_.bytes_out->Add(total);
    auto call = std::make_shared<PushPullCall>(header, parts, lose_reply, std::move(offsets),
                                               total, response, reply_buffers_, segment);
    call->OnDone([this, parts, peer, held](bool failed) {
      ReleaseReply(peer, held);
      DropFinished(parts, failed);
    });
    site->Bind(call);
    sink = std::move(call);
  } else {
    *response = EmptyMessage();
    auto call = std::make_shared<PushCall>(parts.size(), lose_reply);
    call->OnDone([parts](bool failed) { DropFinished(parts, failed); });
    site->Bind(call);
    sink = std::move(call);
  }
  Completions done;
  for (size_t i = 0; i < parts.size(); ++i) {
    parts[i]->Push(header.worker_id(), header.incarnation(), header.slices(i).seq(),
                   header.slices(i).key(), check && !check_whole, &payload,
                   sink, i, &done);
  }
  RunAll(done);
  return absl::OkStatus();
}

absl::Status Service::StartPull(CallSite* site, const grpc::ByteBuffer& request,
                                grpc::ByteBuffer* response) {
  pb::PullRequest req;
  std::vector<Partition*> parts;
  grpc::Slice whole;
  if (!request.DumpToSingleSlice(&whole).ok() ||
      !req.ParseFromArray(whole.begin(), static_cast<int>(whole.size()))) {
    return absl::InvalidArgumentError("garbled request body: bad pull request");
  }
  if (req.worker_id() != kObserver) {
    DEEPNEX_RETURN_IF_ERROR(CheckWorker(req.worker_id(), "pull"));
  }
  DEEPNEX_RETURN_IF_ERROR(CheckSite(*site, req.worker_id(), "pull"));
  DEEPNEX_RETURN_IF_ERROR(Resolve("pull", req.slices(), &parts, nullptr));
  std::vector<uint64_t> offsets;
  uint64_t total = 0;
  DEEPNEX_RETURN_IF_ERROR(PullLayout("pull", req.slices(), parts, &offsets, &total));
  std::shared_ptr<ShmSegment> segment;
  if (req.has_shm()) {
    DEEPNEX_ASSIGN_OR_RETURN(segment,
                             ShmOf("pull", req.worker_id(), req.incarnation(), req.shm()));
    if (req.shm().bytes() != total) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "pull: shm region of %d bytes for %d bytes of values", req.shm().bytes(), total));
    }
  }
  const std::string peer = site->peer();
  const uint64_t held = segment ? 0 : total;
  DEEPNEX_RETURN_IF_ERROR(HoldReply(peer, held));

  metrics_.pulls->Add();
  metrics_.bytes_out->Add(total);
  if (segment) metrics_.shm_bytes->Add(total);
  auto call = std::make_shared<PullCall>(std::move(offsets), total, response, reply_buffers_,
                                         segment, req.shm().offset());
  call->OnDone([this, parts, peer, held](bool failed) {
    ReleaseReply(peer, held);
    DropFinished(parts, failed);
  });
  site->Bind(call);
  Completions done;
  for (size_t i = 0; i < parts.size(); ++i) {
    parts[i]->Pull(req.worker_id(), req.incarnation(), req.slices(i).seq(), call, i, &done);
  }
  RunAll(done);
  return absl::OkStatus();
}

void Service::ExpireLeases() {
  std::vector<int> expired = membership_.Expire(Clock::now());
  if (expired.empty()) return;
  if (shm_) {
    for (int worker : expired) shm_->Drop(worker, 0);
    metrics_.shm_segments->Set(shm_->Count());
  }
  for (int worker : expired) DropBulk(worker, 0);
  metrics_.lease_expiries->Add(expired.size());
  metrics_.live_workers->Set(membership_.LiveCount());
  MembershipChanged();
}

void Service::FailWaiters(const absl::Status& status) {
  Completions done;
  for (Partition* p : AllPartitions()) p->FailWaiters(status, &done);
  RunAll(done);
}

std::vector<Partition*> Service::AllPartitions() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Partition*> all;
  for (auto& [key, t] : tensors_) {
    for (auto& [part, p] : t.parts) all.push_back(p.get());
  }
  return all;
}

void Service::MembershipChanged() {
  Completions done;
  for (Partition* p : AllPartitions()) p->MembershipChanged(&done);
  RunAll(done);
}

void Service::FillStats(pb::StatsReply* reply) {
  reply->set_mode(ModeName(options_.mode));
  reply->set_staleness(config_.staleness);
  reply->set_num_workers(options_.num_workers);
  reply->set_live_workers(membership_.LiveCount());
  reply->set_pushes(metrics_.pushes->value());
  reply->set_pulls(metrics_.pulls->value());
  reply->set_bytes_in(metrics_.bytes_in->value());
  reply->set_bytes_out(metrics_.bytes_out->value());
  reply->set_rounds(metrics_.rounds->value());
  Histogram::Snapshot latency = metrics_.round_latency->Get();
  reply->set_round_latency_p50(latency.Quantile(0.5));
  reply->set_round_latency_p99(latency.Quantile(0.99));
  reply->set_lease_expiries(metrics_.lease_expiries->value());
  reply->set_checkpoints(metrics_.checkpoints->value());
  reply->set_checkpoint_round(static_cast<uint64_t>(metrics_.checkpoint_round->value()));
  uint64_t lo = UINT64_MAX, hi = 0;
  for (Partition* p : AllPartitions()) {
    uint64_t v = p->version();
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  reply->set_min_version(lo == UINT64_MAX ? 0 : lo);
  reply->set_max_version(hi);
  static const char* kStates[] = {"expected", "live", "dead", "left"};
  for (int w = 0; w < options_.num_workers; ++w) {
    pb::WorkerStats* ws = reply->add_workers();
    ws->set_worker(w);
    ws->set_state(kStates[static_cast<int>(membership_.state(w))]);
    ws->set_pushes(metrics_.worker_pushes[w]->value());
    ws->set_max_lead(static_cast<uint64_t>(metrics_.staleness[w]->Get().max));
    ws->set_late_pushes(metrics_.late[w]->value());
  }
  reply->set_prometheus(MetricsText());
}

absl::StatusOr<Identity> Service::Caller(const grpc::ServerContextBase& ctx) const {
  DEEPNEX_ASSIGN_OR_RETURN(Identity who, AuthenticateCall(tokens_, ctx, options_.job_id));
  return OfThisServer(std::move(who));
}

absl::Status Service::AuthorizeMetrics(const std::string& authorization) const {
  DEEPNEX_ASSIGN_OR_RETURN(Identity who, AuthenticateHttp(tokens_, authorization,
                                                          "a token of this server's job",
                                                          options_.job_id));
  return OfThisServer(std::move(who)).status();
}

absl::StatusOr<Identity> Service::OfThisServer(Identity who) const {
  if (!who.job.empty() && options_.job_id.empty()) {
    return absl::PermissionDeniedError(
        absl::StrCat("the token of \"", who.name, "\" is for job \"", who.job,
                     "\", and this parameter server belongs to no job (job_id, --job)"));
  }
  return who;
}

absl::Status Service::Authenticate(const grpc::ServerContextBase& ctx) const {
  return Caller(ctx).status();
}

absl::Status Service::PullLayout(const char* op,
                                 const google::protobuf::RepeatedPtrField<pb::Slice>& slices,
                                 const std::vector<Partition*>& parts,
                                 std::vector<uint64_t>* offsets, uint64_t* total) const {
  const uint64_t cap = options_.max_pull_reply_bytes > 0 ? options_.max_pull_reply_bytes
                                                         : options_.max_message_bytes;
  std::unordered_map<const Partition*, int> seen;
  for (size_t i = 0; i < parts.size(); ++i) {
    auto [it, fresh] = seen.emplace(parts[i], static_cast<int>(i));
    if (!fresh) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s of \"%s\" part %d: slices %d and %d name the same partition; "
                          "name each once",
                          op, slices[i].key(), slices[i].part(), it->second, i));
    }
    // *total stays within cap, so cap - *total does not wrap.
    if (parts[i]->bytes() > cap - *total) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("%s: the reply would hold more than %d bytes (max_pull_reply_bytes) "
                          "at slice %d (\"%s\" part %d); pull fewer slices at a time",
                          op, cap, i, slices[i].key(), slices[i].part()));
    }
    offsets->push_back(*total);
    *total += parts[i]->bytes();
  }
  return absl::OkStatus();
}

absl::Status Service::HoldReply(const std::string& peer, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(limits_mu_);
  uint64_t& held = pending_by_peer_[peer];
  const uint64_t cap = options_.max_pending_reply_bytes;
  if (held > 0 && (held > cap || bytes > cap - held)) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("pull: this connection (%s) already has %d bytes of pull replies held on "
                        "the server, and %d more would pass max_pending_reply_bytes (%d); read "
                        "the replies, or wait for them, before pulling more",
                        peer, held, bytes, cap));
  }
  held += bytes;
  metrics_.pending_reply_bytes->Add(static_cast<double>(bytes));
  return absl::OkStatus();
}

void Service::ReleaseReply(const std::string& peer, uint64_t bytes) {
  if (bytes == 0) return;
  std::lock_guard<std::mutex> lock(limits_mu_);
  auto it = pending_by_peer_.find(peer);
  it->second -= bytes;
  if (it->second == 0) pending_by_peer_.erase(it);
  metrics_.pending_reply_bytes->Add(-static_cast<double>(bytes));
}

void Service::DropFinished(const std::vector<Partition*>& parts, bool failed) {
  if (!failed) return;
  for (Partition* p : parts) p->DropFinished();
}

absl::Status Service::CheckWorker(int worker, const char* op) const {
  if (worker < 0 || worker >= options_.num_workers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: worker_id %d is outside 0..%d (the server has %d workers)", op, worker,
                        options_.num_workers - 1, options_.num_workers));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<ShmSegment>> Service::ShmOf(const char* op, int worker,
                                                           uint64_t incarnation,
                                                           const pb::ShmRegion& region) const {
  std::shared_ptr<ShmSegment> segment = shm_ ? shm_->Find(worker, incarnation) : nullptr;
  if (segment == nullptr) {
    // The only FailedPrecondition of a push or pull: the client sends the
    // values again over TCP, where the usual checks (a restored server
    // knows the incarnation and its seqs) apply.
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: worker %d has no shared-memory segment here as incarnation %d (its lease ended, "
        "it left, or the server restarted); send the values over TCP",
        op, worker, incarnation));
  }
  // The limit gRPC puts on a request over TCP.
  if (region.bytes() > options_.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s: shm region of %d bytes is over max_message_bytes (%d)", op, region.bytes(),
        options_.max_message_bytes));
  }
  DEEPNEX_RETURN_IF_ERROR(segment->CheckRegion(op, region.offset(), region.bytes()));
  return segment;
}

void Service::OfferShm(const pb::RegisterRequest& req, pb::RegisterReply* reply) {
  // Another host's client (or one in another boot of this host) cannot map
  // the segment; comparing addresses would not tell (NAT, proxies).
  if (!shm_ || req.shm_bytes() == 0 || req.host_id() != host_id_) return;
  absl::StatusOr<ShmBroker::Offer> offer =
      shm_->Open(req.worker_id(), req.incarnation(), req.shm_bytes());
  metrics_.shm_segments->Set(shm_->Count());
  if (!offer.ok()) return;  // TCP, as for a client on another host
  reply->set_shm_socket(offer->socket);
  reply->set_shm_ticket(offer->ticket);
  reply->set_shm_bytes(offer->bytes);
}

absl::Status Service::CheckSite(const CallSite& site, int worker, const char* op) const {
  std::optional<int> speaks_for = site.worker();
  if (speaks_for && *speaks_for != worker) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s: this bulk connection is worker %d's; the request names worker %d", op, *speaks_for,
        worker));
  }
  return absl::OkStatus();
}

absl::Status Service::CheckCall(const grpc::ServerContextBase& ctx, int worker,
                                const char* op) const {
  DEEPNEX_RETURN_IF_ERROR(Authenticate(ctx));
  return CheckWorker(worker, op);
}

absl::Status Service::Resolve(const char* op,
                              const google::protobuf::RepeatedPtrField<pb::Slice>& slices,
                              std::vector<Partition*>* parts, const PayloadReader* payload) {
  uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const pb::Slice& slice : slices) {
      auto it = tensors_.find(slice.key());
      Partition* part = nullptr;
      if (it != tensors_.end()) {
        auto p = it->second.parts.find(slice.part());
        if (p != it->second.parts.end()) part = p->second.get();
      }
      if (part == nullptr) {
        return absl::NotFoundError(
            absl::StrFormat("%s of \"%s\": no such tensor (part %d is not on this server: "
                            "init it first, or again if the server restarted without a "
                            "checkpoint)",
                            op, slice.key(), slice.part()));
      }
      if (!IsValidDType(slice.dtype()) || static_cast<DType>(slice.dtype()) != part->dtype()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s of \"%s\": got %s values, the tensor is %s", op, slice.key(),
            IsValidDType(slice.dtype()) ? DTypeName(static_cast<DType>(slice.dtype()))
                                        : absl::StrCat("dtype ", slice.dtype()).c_str(),
            DTypeName(part->dtype())));
      }
      if (slice.offset() != part->offset() || slice.count() != part->count()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s of \"%s\" part %d: got %d elements at offset %d, the part "
                            "holds %d at offset %d",
                            op, slice.key(), slice.part(), slice.count(), slice.offset(),
                            part->count(), part->offset()));
      }
      bytes += part->bytes();
      parts->push_back(part);
    }
  }
  if (payload != nullptr && payload->remaining() != bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the payload holds %d bytes, the slices need %d", op, payload->remaining(), bytes));
  }
  if (parts->empty() && payload == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": no slices"));
  }
  return absl::OkStatus();
}

absl::Status Service::DoClaim(const grpc::ServerContextBase& ctx, const pb::ClaimRequest& req,
                              pb::ClaimReply* reply) {
  DEEPNEX_RETURN_IF_ERROR(CheckCall(ctx, req.worker_id(), "init"));
  if (req.metas_size() == 0) {
    // As an older client's (one tensor per claim, in a field now gone) reads.
    return absl::InvalidArgumentError(
        "init: the claim names no tensor (is the client older than this server?)");
  }
  for (const pb::TensorMeta& meta : req.metas()) {
    DEEPNEX_RETURN_IF_ERROR(
        CheckTensorMeta(absl::StrFormat("init of \"%s\"", meta.key()), meta).status());
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Every shape checked against the tensor as it stands (or as this request
  // has it first) before anything is claimed: a claim won before a refused
  // one would hold its tensor unready for values that never come.
  std::unordered_map<std::string, const pb::TensorMeta*> standing;
  for (const pb::TensorMeta& meta : req.metas()) {
    auto it = tensors_.find(meta.key());
    const pb::TensorMeta& was =
        *standing
             .try_emplace(meta.key(),
                          it != tensors_.end() && it->second.meta ? it->second.meta.get() : &meta)
             .first->second;
    if (&was == &meta) continue;  // a new tensor's first meta
    const bool same = was.dtype() == meta.dtype() && was.shape_size() == meta.shape_size() &&
                      std::equal(meta.shape().begin(), meta.shape().end(), was.shape().begin());
    if (!same) {
      return absl::InvalidArgumentError(
          absl::StrFormat("init of \"%s\": %s differs from the existing %s", meta.key(),
                          ShapeString(meta), ShapeString(was)));
    }
  }
  for (const pb::TensorMeta& meta : req.metas()) {
    Tensor& t = tensors_[meta.key()];
    if (!t.meta) {
      t.meta = std::make_unique<pb::TensorMeta>(meta);
      t.meta->set_ready(false);
      t.claimed_by = req.worker_id();
    }
    // The claimer itself, restarted or retrying, writes again; so does the
    // first claimer of a tensor restored unready (a checkpoint cut between
    // a claim and its values), which nobody claims: every init waited for
    // the first initializer until its deadline.
    if (!t.meta->ready() && t.claimed_by == -1) t.claimed_by = req.worker_id();
    reply->add_won(!t.meta->ready() && t.claimed_by == req.worker_id());
    *reply->add_metas() = *t.meta;
  }
  return absl::OkStatus();
}

absl::Status Service::DoWriteParts(const grpc::ServerContextBase& ctx,
                                   const grpc::ByteBuffer& request) {
  DEEPNEX_RETURN_IF_ERROR(Authenticate(ctx));
  pb::WritePartsHeader header;
  PayloadReader payload;
  DEEPNEX_RETURN_IF_ERROR(DecodeFramed(request, &header, &payload));
  DEEPNEX_RETURN_IF_ERROR(CheckWorker(header.worker_id(), "init"));
  if (header.slices_size() != header.metas_size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("init: %d slices and %d metas; they go in pairs", header.slices_size(),
                        header.metas_size()));
  }
  // Every slice is checked, and the sizes added up without wrapping,
  // before anything is made.
  uint64_t bytes = 0;
  for (int i = 0; i < header.slices_size(); ++i) {
    const pb::Slice& slice = header.slices(i);
    DEEPNEX_ASSIGN_OR_RETURN(
        uint64_t slice_bytes,
        CheckPart(absl::StrFormat("init of \"%s\" part %d", slice.key(), slice.part()),
                  slice.key(), slice.part(), slice.offset(), slice.count(), slice.dtype(),
                  header.metas(i)));
    if (slice_bytes > std::numeric_limits<uint64_t>::max() - bytes) {
      return absl::InvalidArgumentError("init: the slices' sizes add up to more than 2^64 bytes");
    }
    bytes += slice_bytes;
  }
  if (bytes != payload.remaining()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "init: the payload holds %d bytes, the slices need %d", payload.remaining(), bytes));
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (int i = 0; i < header.slices_size(); ++i) {
    const pb::Slice& slice = header.slices(i);
    DType dtype = static_cast<DType>(slice.dtype());
    auto t = tensors_.find(slice.key());
    if (t != tensors_.end() && t->second.parts.count(slice.part()) != 0) {
      payload.Skip(slice.count() * DTypeSize(dtype));  // first init wins
      continue;
    }
    // Made and filled before it is entered, so that a failure leaves no
    // entry behind.
    std::unique_ptr<Partition> part =
        Partition::Create(config_, dtype, slice.offset(), slice.count());
    part->Write(&payload);
    Tensor& entry = tensors_[slice.key()];
    entry.parts[slice.part()] = std::move(part);
    if (!entry.meta && !entry.parts_meta) {
      entry.parts_meta = std::make_unique<pb::TensorMeta>(header.metas(i));
    }
  }
  return absl::OkStatus();
}

absl::Status Service::DoDescribe(const grpc::ServerContextBase& ctx, const pb::DescribeRequest& req,
                                 pb::DescribeReply* reply) {
  DEEPNEX_RETURN_IF_ERROR(Authenticate(ctx));
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::string& key : req.keys()) {
    auto it = tensors_.find(key);
    if (it == tensors_.end() || !it->second.meta) {
      return absl::NotFoundError(absl::StrCat("no tensor \"", key, "\" (init it first)"));
    }
    pb::TensorMeta* meta = reply->add_metas();
    *meta = *it->second.meta;
    auto part0 = it->second.parts.find(0);
    if (part0 != it->second.parts.end()) meta->set_version(part0->second->version());
  }
  return absl::OkStatus();
}

}  // namespace deepnex::ps
