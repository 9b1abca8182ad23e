#include "deepnex/ps/server.h"

#include <algorithm>
#include <cstdio>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/file_util.h"
#include "core/grpc_util.h"
#include "core/net.h"
#include "deepnex/auth.h"
#include "deepnex/metrics.h"
#include "deepnex/ps.grpc.pb.h"
#include "ps/membership.h"
#include "ps/partition.h"
#include "ps/plan.h"

namespace deepnex::ps {

const char* ModeName(Mode mode) {
  switch (mode) {
    case Mode::kSync: return "sync";
    case Mode::kSsp: return "ssp";
    case Mode::kAsync: return "async";
  }
  return "?";
}

absl::StatusOr<Mode> ParseMode(const std::string& name) {
  for (Mode m : {Mode::kSync, Mode::kSsp, Mode::kAsync}) {
    if (name == ModeName(m)) return m;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("mode: unknown \"", name, "\" (one of sync, ssp, async)"));
}

const char* LeasePolicyName(LeasePolicy policy) {
  return policy == LeasePolicy::kShrink ? "shrink" : "abort";
}

absl::StatusOr<LeasePolicy> ParseLeasePolicy(const std::string& name) {
  if (name == "shrink") return LeasePolicy::kShrink;
  if (name == "abort") return LeasePolicy::kAbort;
  return absl::InvalidArgumentError(
      absl::StrCat("lease policy: unknown \"", name, "\" (one of shrink, abort)"));
}

const char* ReductionName(Reduction reduction) {
  return reduction == Reduction::kMean ? "mean" : "sum";
}

absl::StatusOr<Reduction> ParseReduction(const std::string& name) {
  if (name == "mean") return Reduction::kMean;
  if (name == "sum") return Reduction::kSum;
  return absl::InvalidArgumentError(
      absl::StrCat("reduction: unknown \"", name, "\" (one of mean, sum)"));
}

absl::Status ServerOptions::Validate() const {
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(what); };
  if (num_workers < 1) {
    return bad(absl::StrCat("num_workers=", num_workers, ": must be at least 1"));
  }
  if (address.empty()) return bad("address is empty");
  DEEPNEX_RETURN_IF_ERROR(ValidateAdvertiseHost("advertise", advertise));
  if (max_message_bytes < 1024) {
    return bad(absl::StrCat("max_message_bytes=", max_message_bytes,
                            ": must be at least 1024"));
  }
  if (max_pending_reply_bytes == 0) return bad("max_pending_reply_bytes=0: must be positive");
  if (max_deferred_push_bytes == 0) return bad("max_deferred_push_bytes=0: must be positive");
  if (staleness < 0) return bad(absl::StrCat("staleness=", staleness, ": must be >= 0"));
  if (staleness > 0 && mode != Mode::kSsp) {
    return bad(absl::StrCat("staleness=", staleness, ": only mode ssp takes a staleness (",
                            ModeName(mode), " is ", mode == Mode::kSync ? "0" : "unbounded",
                            ")"));
  }
  if (lease_timeout.count() <= 0) {
    return bad(absl::StrCat("lease_timeout=", lease_timeout.count(), "ms: must be positive"));
  }
  if (heartbeat_interval.count() < 0 || heartbeat_interval >= lease_timeout) {
    return bad(absl::StrCat("heartbeat_interval=", heartbeat_interval.count(),
                            "ms: must be >= 0 and below lease_timeout (",
                            lease_timeout.count(), "ms)"));
  }
  if ((checkpoint_every_rounds > 0 || checkpoint_interval.count() > 0) &&
      checkpoint_dir.empty()) {
    return bad("periodic checkpoints need checkpoint_dir");
  }
  if (name.empty() || name.find('/') != std::string::npos) {
    return bad(absl::StrCat("name=\"", name, "\": must be a plain file name"));
  }
  return optimizer.Validate();
}

namespace {

namespace pb = ::deepnex::ps::proto;
using Clock = std::chrono::steady_clock;

constexpr char kCheckpointMagic[] = "DNXPSCK1";
constexpr uint32_t kCheckpointVersion = 1;

std::string CheckpointPath(const std::string& dir, const std::string& name) {
  return dir + "/" + name + ".ckpt";
}

// A call that may outlive its handler: it waits on partitions, which report
// to it from other calls' threads. Finished exactly once, by whichever of
// completion, failure or cancellation comes first.
class Call {
 public:
  virtual ~Call() = default;
  bool Finished() const { return finished_.load(std::memory_order_acquire); }
  void Fail(const absl::Status& status) {
    if (finished_.exchange(true)) return;
    failed_.store(true, std::memory_order_release);
    reactor_->Finish(ToGrpcStatus(status));
  }
  // Runs once gRPC is done with the call (its reply sent, or the call
  // cancelled); `failed` says whether it ended in an error, which may leave
  // parts of it behind in partitions.
  void OnDone(std::function<void(bool failed)> fn) { on_done_ = std::move(fn); }

 protected:
  // True for the one caller that gets to finish the call.
  bool Claim() { return !finished_.exchange(true); }
  grpc::ServerUnaryReactor* reactor_ = nullptr;

 private:
  friend class CallReactor;
  std::atomic<bool> finished_{false};
  std::atomic<bool> failed_{false};
  std::function<void(bool)> on_done_;
};

// Owns the Call until gRPC is done with it; a cancelled call (client gone,
// deadline passed) is finished so that the server never waits on it.
class CallReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit CallReactor(std::shared_ptr<Call> call) : call_(std::move(call)) {
    call_->reactor_ = this;
  }
  void OnCancel() override { call_->Fail(absl::CancelledError("call cancelled")); }
  void OnDone() override {
    if (call_->on_done_) call_->on_done_(call_->failed_.load(std::memory_order_acquire));
    delete this;
  }

 private:
  std::shared_ptr<Call> call_;
};

class PushCall final : public Call, public PushSink {
 public:
  // `lose_reply`: answer Unavailable once applied (testing hook).
  PushCall(size_t slices, bool lose_reply)
      : remaining_(slices), lose_reply_(lose_reply) {}
  void SliceApplied(size_t) override {
    if (remaining_.fetch_sub(1) != 1 || !Claim()) return;
    reactor_->Finish(lose_reply_ ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                                "reply dropped for testing")
                                 : grpc::Status::OK);
  }
  void Fail(const absl::Status& status) override { Call::Fail(status); }
  bool Finished() const override { return Call::Finished(); }

 private:
  std::atomic<size_t> remaining_;
  const bool lose_reply_;
};

class PullCall final : public Call, public PullSink {
 public:
  PullCall(std::vector<uint64_t> offsets, uint64_t total, grpc::ByteBuffer* response)
      : offsets_(std::move(offsets)),
        total_(total),
        versions_(offsets_.size()),
        remaining_(offsets_.size()),
        response_(response) {}
  // The buffer is made when the first values arrive, so that a pull waiting
  // for its round holds no reply memory.
  char* Destination(size_t slice) override {
    std::call_once(allocated_, [this] { buffer_.reset(new char[total_]); });
    return buffer_.get() + offsets_[slice];
  }
  void SliceReady(size_t slice, uint64_t version) override {
    versions_[slice] = version;
    if (remaining_.fetch_sub(1) != 1 || !Claim()) return;
    pb::PullHeader header;
    for (uint64_t v : versions_) header.add_versions(v);
    std::vector<grpc::Slice> payload;
    payload.push_back(OwnedSlice(std::move(buffer_), total_));
    *response_ = EncodeFramed(header, std::move(payload));
    reactor_->Finish(grpc::Status::OK);
  }
  void Fail(const absl::Status& status) override { Call::Fail(status); }
  bool Finished() const override { return Call::Finished(); }

 private:
  const std::vector<uint64_t> offsets_;
  const uint64_t total_;
  std::once_flag allocated_;
  std::unique_ptr<char[]> buffer_;
  std::vector<uint64_t> versions_;  // each written by one partition, once
  std::atomic<size_t> remaining_;
  grpc::ByteBuffer* const response_;
};

// A default-constructed ByteBuffer is not a message; gRPC refuses to send it.
grpc::ByteBuffer EmptyMessage() { return grpc::ByteBuffer(nullptr, 0); }

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx,
                                const absl::Status& status) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

std::string ShapeString(const pb::TensorMeta& meta) {
  std::vector<int64_t> shape(meta.shape().begin(), meta.shape().end());
  return DescribeShape(shape, static_cast<DType>(meta.dtype()));
}

void RunAll(Completions& done) {
  for (auto& fn : done) fn();
  done.clear();
}

// The server's metrics; partitions report into it.
class ServerMetrics final : public PartitionObserver {
 public:
  explicit ServerMetrics(int num_workers)
      : pushes(registry.GetCounter("deepnex_ps_pushes_total", "Push requests applied.")),
        pulls(registry.GetCounter("deepnex_ps_pulls_total", "Pull requests served.")),
        bytes_in(registry.GetCounter("deepnex_ps_bytes_in_total", "Tensor bytes received.")),
        bytes_out(registry.GetCounter("deepnex_ps_bytes_out_total", "Tensor bytes sent.")),
        rounds(registry.GetCounter("deepnex_ps_rounds_total",
                                   "Rounds completed, summed over partitions.")),
        round_latency(registry.GetHistogram(
            "deepnex_ps_round_latency_seconds",
            "From a round's first push to its update, per partition.",
            Histogram::Exponential(1e-4, 2, 20))),
        live_workers(registry.GetGauge("deepnex_ps_live_workers", "Workers holding a lease.")),
        lease_expiries(registry.GetCounter("deepnex_ps_lease_expiries_total",
                                           "Worker leases that expired.")),
        checkpoints(registry.GetCounter("deepnex_ps_checkpoints_total",
                                        "Checkpoints written.")),
        checkpoint_round(registry.GetGauge("deepnex_ps_checkpoint_round",
                                           "The round of the last checkpoint written.")),
        pending_reply_bytes(registry.GetGauge(
            "deepnex_ps_pending_reply_bytes",
            "Pull reply bytes held for clients: waiting pulls and unread replies.")),
        deferred_push_bytes(registry.GetGauge(
            "deepnex_ps_deferred_push_bytes",
            "Bytes of pushes kept until an earlier push or round arrives.")) {
    for (int w = 0; w < num_workers; ++w) {
      Labels l{{"worker", std::to_string(w)}};
      worker_pushes.push_back(registry.GetCounter("deepnex_ps_worker_pushes_total",
                                                  "Push requests per worker.", l));
      late.push_back(registry.GetCounter("deepnex_ps_late_pushes_total",
                                         "Pushes for rounds completed without them.", l));
      staleness.push_back(registry.GetHistogram(
          "deepnex_ps_staleness_rounds",
          "Rounds a worker was ahead of the applied version when its pull was served.",
          {0, 1, 2, 3, 4, 8, 16, 32}, l));
    }
  }

  void RoundCompleted(double latency) override {
    rounds->Add();
    round_latency->Observe(latency);
  }
  void PullServed(int worker, uint64_t lead) override {
    staleness[worker]->Observe(static_cast<double>(lead));
  }
  void LatePush(int worker) override { late[worker]->Add(); }

  MetricsRegistry registry;
  Counter* pushes;
  Counter* pulls;
  Counter* bytes_in;
  Counter* bytes_out;
  Counter* rounds;
  Histogram* round_latency;
  Gauge* live_workers;
  Counter* lease_expiries;
  Counter* checkpoints;
  Gauge* checkpoint_round;
  Gauge* pending_reply_bytes;
  Gauge* deferred_push_bytes;
  std::vector<Counter*> worker_pushes, late;
  std::vector<Histogram*> staleness;
};

using ServiceBase = pb::ParameterServer::WithCallbackMethod_Register<
    pb::ParameterServer::WithCallbackMethod_Heartbeat<
        pb::ParameterServer::WithCallbackMethod_Leave<
            pb::ParameterServer::WithCallbackMethod_Stats<
                pb::ParameterServer::WithCallbackMethod_Checkpoint<
                    pb::ParameterServer::WithCallbackMethod_Claim<
                        pb::ParameterServer::WithCallbackMethod_Commit<
                            pb::ParameterServer::WithCallbackMethod_Describe<
                                pb::ParameterServer::WithRawCallbackMethod_WriteParts<
                                    pb::ParameterServer::WithRawCallbackMethod_Push<
                                        pb::ParameterServer::WithRawCallbackMethod_Pull<
                                            pb::ParameterServer::Service>>>>>>>>>>>;

// The tensors this server holds, and the RPC handlers over them.
// Thread-safe: `mu_` guards the directory of tensors only; data operations
// lock the partitions they touch.
class Service final : public ServiceBase, public SnapshotSink, public DeferredLimit {
 public:
  // `job_token`: the table holds the job's token alone (see ServerOptions).
  Service(const ServerOptions& options, TokenTable tokens, bool job_token)
      : options_(options),
        tokens_(std::move(tokens)),
        job_token_(job_token),
        membership_(options.num_workers, options.lease_timeout, options.lease_policy),
        metrics_(options.num_workers),
        drops_left_(options.drop_push_replies_for_testing),
        deferred_bytes_(options.num_workers, 0) {
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
          options.checkpoint_every_rounds *
          (options.mode == Mode::kAsync ? options.num_workers : 1);
      config_.snapshots = this;
    }
  }

  // Collects the partitions' periodic snapshots; once every partition has
  // given the same version, they form a checkpoint (see WritePeriodic).
  void Periodic(const Partition* partition, PartitionState state) override {
    std::lock_guard<std::mutex> lock(periodic_mu_);
    uint64_t version = state.version;
    if (version <= last_periodic_) return;
    periodic_[version][partition] = std::move(state);
  }

  absl::Status Take(int worker, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(limits_mu_);
    uint64_t& held = deferred_bytes_[worker];
    const uint64_t cap = options_.max_deferred_push_bytes;
    if (held > cap || bytes > cap - held) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "push: worker %d already has %d bytes of pushes kept waiting for an "
          "earlier push or round, and %d more would pass max_deferred_push_bytes "
          "(%d); send pushes in seq order and wait for their replies",
          worker, held, bytes, cap));
    }
    held += bytes;
    metrics_.deferred_push_bytes->Add(static_cast<double>(bytes));
    return absl::OkStatus();
  }

  void Give(int worker, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(limits_mu_);
    deferred_bytes_[worker] -= bytes;
    metrics_.deferred_push_bytes->Add(-static_cast<double>(bytes));
  }

  // Writes the newest complete set of periodic snapshots, if any.
  absl::Status WritePeriodic() {
    std::vector<std::pair<std::string, uint32_t>> names;
    std::vector<Partition*> parts;
    pb::CheckpointFile file = Directory(&names, &parts);
    std::map<const Partition*, PartitionState> states;
    uint64_t round = 0;
    {
      std::lock_guard<std::mutex> lock(periodic_mu_);
      for (auto it = periodic_.rbegin(); it != periodic_.rend(); ++it) {
        if (it->second.size() == parts.size()) {
          round = it->first;
          states = std::move(it->second);
          break;
        }
      }
      if (round == 0) return absl::OkStatus();
      last_periodic_ = round;
      periodic_.erase(periodic_.begin(), periodic_.upper_bound(round));
    }
    std::vector<PartitionState> ordered;
    for (Partition* p : parts) {
      auto it = states.find(p);
      if (it == states.end()) return absl::OkStatus();  // the set of partitions changed
      ordered.push_back(std::move(it->second));
    }
    return Write(options_.checkpoint_dir, round, std::move(file), names, parts,
                 std::move(ordered));
  }

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx,
                                     const pb::RegisterRequest* req,
                                     pb::RegisterReply* reply) override {
    absl::Status s = CheckCall(*ctx, req->worker_id(), "register");
    if (s.ok() && req->incarnation() == 0) {
      s = absl::InvalidArgumentError("register: incarnation 0 is reserved");
    }
    if (s.ok()) {
      membership_.Register(req->worker_id(), req->incarnation());
      metrics_.live_workers->Set(membership_.LiveCount());
      reply->set_num_workers(options_.num_workers);
      reply->set_mode(ModeName(options_.mode));
      reply->set_staleness(config_.staleness);
      reply->set_heartbeat_interval_ms(
          options_.heartbeat_interval.count() > 0
              ? options_.heartbeat_interval.count()
              : std::max<int64_t>(1, options_.lease_timeout.count() / 4));
    }
    return Reply(ctx, s);
  }

  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const pb::HeartbeatRequest* req,
                                      pb::HeartbeatReply*) override {
    absl::Status s = CheckCall(*ctx, req->worker_id(), "heartbeat");
    if (s.ok()) s = membership_.Heartbeat(req->worker_id(), req->incarnation());
    return Reply(ctx, s);
  }

  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* ctx,
                                  const pb::LeaveRequest* req, pb::LeaveReply*) override {
    absl::Status s = CheckCall(*ctx, req->worker_id(), "leave");
    if (s.ok()) {
      membership_.Leave(req->worker_id(), req->incarnation());
      metrics_.live_workers->Set(membership_.LiveCount());
      MembershipChanged();
    }
    return Reply(ctx, s);
  }

  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const pb::StatsRequest*,
                                  pb::StatsReply* reply) override {
    absl::Status s = Authenticate(*ctx);
    if (s.ok()) FillStats(reply);
    return Reply(ctx, s);
  }

  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* ctx,
                                       const pb::CheckpointRequest* req,
                                       pb::CheckpointReply* reply) override {
    absl::StatusOr<std::string> dir = CheckpointTarget(*ctx, *req);
    if (!dir.ok()) return Reply(ctx, dir.status());
    // Writing may wait for a round boundary: off gRPC's callback threads.
    auto* reactor = ctx->DefaultReactor();
    std::thread([this, reactor, dir = *std::move(dir),
                 timeout = std::chrono::milliseconds(req->timeout_ms() ? req->timeout_ms()
                                                                       : 60000),
                 reply] {
      auto round = WriteCheckpoint(dir, timeout);
      if (round.ok()) reply->set_round(*round);
      checkpoint_calls_.fetch_sub(1);  // before Finish lets the server stop
      reactor->Finish(ToGrpcStatus(round.status()));
    }).detach();
    return reactor;
  }

  grpc::ServerUnaryReactor* Claim(grpc::CallbackServerContext* ctx,
                                  const pb::ClaimRequest* req,
                                  pb::ClaimReply* reply) override {
    return Reply(ctx, DoClaim(*ctx, *req, reply));
  }

  grpc::ServerUnaryReactor* Commit(grpc::CallbackServerContext* ctx,
                                   const pb::CommitRequest* req,
                                   pb::CommitReply*) override {
    absl::Status s = Authenticate(*ctx);
    if (s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = tensors_.find(req->key());
      if (it == tensors_.end() || !it->second.meta) {
        s = absl::NotFoundError(absl::StrCat("commit of \"", req->key(),
                                             "\": the tensor was never claimed"));
      } else {
        it->second.meta->set_ready(true);
      }
    }
    return Reply(ctx, s);
  }

  grpc::ServerUnaryReactor* Describe(grpc::CallbackServerContext* ctx,
                                     const pb::DescribeRequest* req,
                                     pb::DescribeReply* reply) override {
    return Reply(ctx, DoDescribe(*ctx, *req, reply));
  }

  grpc::ServerUnaryReactor* WriteParts(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override {
    absl::Status s = DoWriteParts(*ctx, *request);
    if (s.ok()) *response = EmptyMessage();
    return Reply(ctx, s);
  }

  grpc::ServerUnaryReactor* Push(grpc::CallbackServerContext* ctx,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override {
    pb::PushHeader header;
    PayloadReader payload;
    std::vector<Partition*> parts;
    absl::Status s = Authenticate(*ctx);
    if (s.ok()) s = DecodeFramed(*request, &header, &payload);
    if (s.ok()) s = CheckWorker(header.worker_id(), "push");
    if (s.ok()) s = Resolve("push", header.slices(), &parts, &payload);
    if (s.ok() && options_.reject_nonfinite) {
      PayloadReader check = payload;
      for (size_t i = 0; i < parts.size() && s.ok(); ++i) {
        absl::Status finite = parts[i]->CheckFinite(&check);
        if (!finite.ok()) {
          s = absl::InvalidArgumentError(absl::StrCat(
              "push of \"", header.slices(i).key(),
              "\": the gradient holds NaN or Inf (", finite.message(),
              "); refused, nothing applied"));
        }
      }
    }
    if (!s.ok()) return Reply(ctx, s);
    *response = EmptyMessage();
    if (parts.empty()) return Reply(ctx, absl::OkStatus());

    metrics_.pushes->Add();
    metrics_.worker_pushes[header.worker_id()]->Add();
    metrics_.bytes_in->Add(payload.remaining());
    bool lose_reply = drops_left_.load() > 0 && drops_left_.fetch_sub(1) > 0;
    auto call = std::make_shared<PushCall>(parts.size(), lose_reply);
    call->OnDone([parts](bool failed) { DropFinished(parts, failed); });
    auto* reactor = new CallReactor(call);
    Completions done;
    for (size_t i = 0; i < parts.size(); ++i) {
      parts[i]->Push(header.worker_id(), header.incarnation(), header.slices(i).seq(),
                     &payload, call, i, &done);
    }
    RunAll(done);
    return reactor;
  }

  grpc::ServerUnaryReactor* Pull(grpc::CallbackServerContext* ctx,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override {
    pb::PullRequest req;
    std::vector<Partition*> parts;
    absl::Status s = Authenticate(*ctx);
    if (s.ok()) {
      grpc::Slice whole;
      if (!request->DumpToSingleSlice(&whole).ok() ||
          !req.ParseFromArray(whole.begin(), static_cast<int>(whole.size()))) {
        s = absl::InvalidArgumentError("garbled request body: bad pull request");
      }
    }
    if (s.ok() && req.worker_id() != kObserver) s = CheckWorker(req.worker_id(), "pull");
    if (s.ok()) s = Resolve("pull", req.slices(), &parts, nullptr);
    std::vector<uint64_t> offsets;
    uint64_t total = 0;
    if (s.ok()) s = PullLayout(req, parts, &offsets, &total);
    const std::string peer = ctx->peer();
    if (s.ok()) s = HoldReply(peer, total);
    if (!s.ok()) return Reply(ctx, s);

    metrics_.pulls->Add();
    metrics_.bytes_out->Add(total);
    auto call = std::make_shared<PullCall>(std::move(offsets), total, response);
    call->OnDone([this, parts, peer, total](bool failed) {
      ReleaseReply(peer, total);
      DropFinished(parts, failed);
    });
    auto* reactor = new CallReactor(call);
    Completions done;
    for (size_t i = 0; i < parts.size(); ++i) {
      parts[i]->Pull(req.worker_id(), req.incarnation(), req.slices(i).seq(), call, i,
                     &done);
    }
    RunAll(done);
    return reactor;
  }

  // Expires leases that ran out; rounds then shrink or abort.
  void ExpireLeases() {
    std::vector<int> expired = membership_.Expire(Clock::now());
    if (expired.empty()) return;
    metrics_.lease_expiries->Add(expired.size());
    metrics_.live_workers->Set(membership_.LiveCount());
    MembershipChanged();
  }

  // Fails every waiting call (the server is stopping).
  void FailWaiters(const absl::Status& status) {
    Completions done;
    for (Partition* p : AllPartitions()) p->FailWaiters(status, &done);
    RunAll(done);
  }

  absl::StatusOr<uint64_t> WriteCheckpoint(const std::string& dir,
                                           std::chrono::milliseconds timeout) {
    std::vector<std::pair<std::string, uint32_t>> names;
    std::vector<Partition*> parts;
    pb::CheckpointFile file = Directory(&names, &parts);
    uint64_t round = 0;
    for (Partition* p : parts) round = std::max(round, p->version());

    struct Collector {
      std::mutex mu;
      std::condition_variable cv;
      std::vector<std::optional<PartitionState>> states;
      size_t remaining;
    };
    auto c = std::make_shared<Collector>();
    c->states.resize(parts.size());
    c->remaining = parts.size();
    Completions done;
    for (size_t i = 0; i < parts.size(); ++i) {
      parts[i]->SnapshotAt(round, [c, i](PartitionState s) {
        std::lock_guard<std::mutex> lock(c->mu);
        c->states[i] = std::move(s);
        if (--c->remaining == 0) c->cv.notify_all();
      }, &done);
    }
    RunAll(done);
    std::vector<PartitionState> states;
    {
      std::unique_lock<std::mutex> lock(c->mu);
      if (!c->cv.wait_for(lock, timeout, [&] { return c->remaining == 0; })) {
        for (size_t i = 0; i < parts.size(); ++i) {
          if (!c->states[i]) {
            return absl::DeadlineExceededError(absl::StrFormat(
                "checkpoint: \"%s\" part %d did not reach round %d within %d ms",
                names[i].first, names[i].second, round, timeout.count()));
          }
        }
      }
      for (auto& st : c->states) states.push_back(std::move(*st));
    }
    DEEPNEX_RETURN_IF_ERROR(Write(dir, round, std::move(file), names, parts, std::move(states)));
    return round;
  }

  // Loads <dir>/<name>.ckpt; nothing is changed unless all of it is good.
  absl::Status Restore(const std::string& dir) {
    std::string path = CheckpointPath(dir, options_.name);
    DEEPNEX_ASSIGN_OR_RETURN(std::string bytes, ReadWholeFile(path, "checkpoint"));
    DEEPNEX_ASSIGN_OR_RETURN(
        std::string body, DecodeChecksummed(kCheckpointMagic, kCheckpointVersion, bytes,
                                            absl::StrCat("checkpoint \"", path, "\"")));
    pb::CheckpointFile file;
    if (!file.ParseFromString(body)) {
      return absl::DataLossError(absl::StrCat("checkpoint \"", path, "\" does not parse"));
    }
    if (file.mode() != ModeName(options_.mode) ||
        file.num_workers() != options_.num_workers) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "checkpoint \"%s\" is of a %s server with %d workers, this one is %s with %d",
          path, file.mode(), file.num_workers(), ModeName(options_.mode),
          options_.num_workers));
    }
    std::unordered_map<std::string, Tensor> tensors;
    for (const auto& meta : file.metas()) {
      tensors[meta.key()].meta = std::make_unique<pb::TensorMeta>(meta);
    }
    for (const auto& r : file.parts()) {
      if (!IsValidDType(r.dtype())) {
        return absl::DataLossError(absl::StrCat("checkpoint \"", path, "\": bad dtype"));
      }
      DType dtype = static_cast<DType>(r.dtype());
      size_t elem = dtype == DType::kFloat64 ? 8 : 4;  // the compute type
      // Compared by division: a count from the file must not wrap a product.
      if (r.values().size() % elem != 0 || r.values().size() / elem != r.count() ||
          (!r.m().empty() && r.m().size() != r.values().size()) ||
          (!r.v().empty() && r.v().size() != r.values().size())) {
        return absl::DataLossError(absl::StrFormat(
            "checkpoint \"%s\": \"%s\" part %d has the wrong number of values", path,
            r.key(), r.part()));
      }
      PartitionState s;
      s.version = r.version();
      s.step = r.step();
      s.values = r.values();
      s.m = r.m();
      s.v = r.v();
      for (const auto& w : r.workers()) {
        s.workers.push_back({w.incarnation(), w.first_round(), w.next_seq()});
      }
      auto part = Partition::Create(config_, dtype, r.offset(), r.count());
      part->Restore(s);
      tensors[r.key()].parts[r.part()] = std::move(part);
    }
    // Clients that were connected keep their leases (fresh ones), so that a
    // push retried across the restart is recognised and applied once.
    for (int w = 0; w < file.incarnations_size() && w < options_.num_workers; ++w) {
      if (file.incarnations(w) != 0) membership_.Register(w, file.incarnations(w));
    }
    std::lock_guard<std::mutex> lock(mu_);
    tensors_ = std::move(tensors);
    return absl::OkStatus();
  }

  std::string MetricsText() const { return metrics_.registry.PrometheusText(); }
  const MetricsRegistry* registry() const { return &metrics_.registry; }

 private:
  struct Tensor {
    std::unique_ptr<pb::TensorMeta> meta;  // on the server holding part 0
    int claimed_by = -1;
    std::map<uint32_t, std::unique_ptr<Partition>> parts;
  };

  // The metas, and the partitions with their (key, part), as they stand.
  pb::CheckpointFile Directory(std::vector<std::pair<std::string, uint32_t>>* names,
                               std::vector<Partition*>* parts) {
    pb::CheckpointFile file;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, t] : tensors_) {
      if (t.meta) *file.add_metas() = *t.meta;
      for (auto& [part, p] : t.parts) {
        names->push_back({key, part});
        parts->push_back(p.get());
      }
    }
    return file;
  }

  absl::Status Write(const std::string& dir, uint64_t round, pb::CheckpointFile file,
                     const std::vector<std::pair<std::string, uint32_t>>& names,
                     const std::vector<Partition*>& parts,
                     std::vector<PartitionState> states) {
    std::lock_guard<std::mutex> one_at_a_time(checkpoint_mu_);
    file.set_name(options_.name);
    file.set_mode(ModeName(options_.mode));
    file.set_num_workers(options_.num_workers);
    file.set_round(round);
    for (int w = 0; w < options_.num_workers; ++w) {
      file.add_incarnations(membership_.Incarnation(w));
    }
    for (size_t i = 0; i < parts.size(); ++i) {
      PartitionState& s = states[i];
      pb::PartitionRecord* r = file.add_parts();
      r->set_key(names[i].first);
      r->set_part(names[i].second);
      r->set_offset(parts[i]->offset());
      r->set_count(parts[i]->count());
      r->set_dtype(static_cast<int>(parts[i]->dtype()));
      r->set_version(s.version);
      r->set_step(s.step);
      r->set_values(std::move(s.values));
      r->set_m(std::move(s.m));
      r->set_v(std::move(s.v));
      for (const auto& w : s.workers) {
        auto* rw = r->add_workers();
        rw->set_incarnation(w.incarnation);
        rw->set_first_round(w.first_round);
        rw->set_next_seq(w.next_seq);
      }
    }
    std::string body;
    if (!file.SerializeToString(&body)) {
      return absl::ResourceExhaustedError(
          "checkpoint: the state does not fit one protobuf message (2 GiB)");
    }
    DEEPNEX_RETURN_IF_ERROR(MakeDirectories(dir));
    DEEPNEX_RETURN_IF_ERROR(WriteFileAtomically(
        CheckpointPath(dir, options_.name),
        EncodeChecksummed(kCheckpointMagic, kCheckpointVersion, body)));
    metrics_.checkpoints->Add();
    metrics_.checkpoint_round->Set(static_cast<double>(round));
    return absl::OkStatus();
  }

  std::vector<Partition*> AllPartitions() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Partition*> all;
    for (auto& [key, t] : tensors_) {
      for (auto& [part, p] : t.parts) all.push_back(p.get());
    }
    return all;
  }

  void MembershipChanged() {
    Completions done;
    for (Partition* p : AllPartitions()) p->MembershipChanged(&done);
    RunAll(done);
  }

  void FillStats(pb::StatsReply* reply) {
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

  // Who is calling. TokenTable lets a job-scoped token act on any job when
  // the server names none; here a job's token reaches only its job's
  // servers, so without a job_id no job-scoped token is taken.
  absl::StatusOr<Identity> Caller(const grpc::ServerContextBase& ctx) const {
    DEEPNEX_ASSIGN_OR_RETURN(Identity who, AuthenticateCall(tokens_, ctx, options_.job_id));
    if (!who.job.empty() && options_.job_id.empty()) {
      return absl::PermissionDeniedError(absl::StrCat(
          "the token of \"", who.name, "\" is for job \"", who.job,
          "\", and this parameter server belongs to no job (job_id, --job)"));
    }
    return who;
  }

  absl::Status Authenticate(const grpc::ServerContextBase& ctx) const {
    return Caller(ctx).status();
  }

  // Where a Checkpoint call may write: a directory inside checkpoint_dir,
  // for an admin or the job's token. Counts the call in checkpoint_calls_
  // when it returns a directory.
  absl::StatusOr<std::string> CheckpointTarget(const grpc::ServerContextBase& ctx,
                                               const pb::CheckpointRequest& req) {
    DEEPNEX_ASSIGN_OR_RETURN(Identity who, Caller(ctx));
    if (who.role != AuthRole::kAdmin && who.job.empty() && !job_token_) {
      return absl::PermissionDeniedError(absl::StrCat(
          "checkpoint: \"", who.name,
          "\" is neither an admin nor this job's token; checkpoints need one of them"));
    }
    if (options_.checkpoint_dir.empty()) {
      return absl::FailedPreconditionError(
          "checkpoint: this server has no checkpoint_dir (--checkpoint-dir), the "
          "only place it writes checkpoints to when asked over the wire");
    }
    const std::string& name = req.name();
    bool plain = name.size() <= 255 && name != "." && name != "..";
    for (char c : name) {
      plain = plain && (absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' ||
                        c == '-' || c == '_');
    }
    if (!plain) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint: name \"", absl::CHexEscape(name.substr(0, 300)),
          "\" is not a plain name (letters, digits, '.', '-', '_'; not \".\" or "
          "\"..\"; at most 255): it names a directory inside the server's "
          "checkpoint_dir, never a path"));
    }
    constexpr uint64_t kMaxTimeoutMs = 3600 * 1000;
    if (req.timeout_ms() > kMaxTimeoutMs) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "checkpoint: timeout_ms %d is over an hour (%d)", req.timeout_ms(), kMaxTimeoutMs));
    }
    // Each call waits on a thread of its own.
    constexpr int kMaxCheckpointCalls = 4;
    if (checkpoint_calls_.fetch_add(1) >= kMaxCheckpointCalls) {
      checkpoint_calls_.fetch_sub(1);
      return absl::ResourceExhaustedError(absl::StrFormat(
          "checkpoint: %d checkpoint calls are already in progress", kMaxCheckpointCalls));
    }
    return name.empty() ? options_.checkpoint_dir
                        : absl::StrCat(options_.checkpoint_dir, "/", name);
  }

  // Where each slice's values go in the reply, and its size: within
  // max_pull_reply_bytes, and each partition named once (a slice repeated
  // would copy the same values again for nothing).
  absl::Status PullLayout(const pb::PullRequest& req, const std::vector<Partition*>& parts,
                          std::vector<uint64_t>* offsets, uint64_t* total) const {
    const uint64_t cap = options_.max_pull_reply_bytes > 0 ? options_.max_pull_reply_bytes
                                                           : options_.max_message_bytes;
    std::unordered_map<const Partition*, int> seen;
    for (size_t i = 0; i < parts.size(); ++i) {
      auto [it, fresh] = seen.emplace(parts[i], static_cast<int>(i));
      if (!fresh) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "pull of \"%s\" part %d: slices %d and %d name the same partition; "
            "name each once",
            req.slices(i).key(), req.slices(i).part(), it->second, i));
      }
      // *total stays within cap, so cap - *total does not wrap.
      if (parts[i]->bytes() > cap - *total) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "pull: the reply would hold more than %d bytes (max_pull_reply_bytes) "
            "at slice %d (\"%s\" part %d); pull fewer slices at a time",
            cap, i, req.slices(i).key(), req.slices(i).part()));
      }
      offsets->push_back(*total);
      *total += parts[i]->bytes();
    }
    return absl::OkStatus();
  }

  // Counts `bytes` of pull replies against the connection `peer`, refused
  // past max_pending_reply_bytes unless the connection holds none.
  absl::Status HoldReply(const std::string& peer, uint64_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(limits_mu_);
    uint64_t& held = pending_by_peer_[peer];
    const uint64_t cap = options_.max_pending_reply_bytes;
    if (held > 0 && (held > cap || bytes > cap - held)) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "pull: this connection (%s) already has %d bytes of pull replies held on "
          "the server, and %d more would pass max_pending_reply_bytes (%d); read "
          "the replies, or wait for them, before pulling more",
          peer, held, bytes, cap));
    }
    held += bytes;
    metrics_.pending_reply_bytes->Add(static_cast<double>(bytes));
    return absl::OkStatus();
  }

  void ReleaseReply(const std::string& peer, uint64_t bytes) {
    if (bytes == 0) return;
    std::lock_guard<std::mutex> lock(limits_mu_);
    auto it = pending_by_peer_.find(peer);
    it->second -= bytes;
    if (it->second == 0) pending_by_peer_.erase(it);
    metrics_.pending_reply_bytes->Add(-static_cast<double>(bytes));
  }

  // A call that failed (cancelled, say) may have left a waiting pull or a
  // kept push in its partitions; drop them now rather than when the
  // partition next moves, which may be never.
  static void DropFinished(const std::vector<Partition*>& parts, bool failed) {
    if (!failed) return;
    for (Partition* p : parts) p->DropFinished();
  }

  absl::Status CheckWorker(int worker, const char* op) const {
    if (worker < 0 || worker >= options_.num_workers) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: worker_id %d is outside 0..%d (the server has %d workers)", op,
          worker, options_.num_workers - 1, options_.num_workers));
    }
    return absl::OkStatus();
  }

  absl::Status CheckCall(const grpc::ServerContextBase& ctx, int worker,
                         const char* op) const {
    DEEPNEX_RETURN_IF_ERROR(Authenticate(ctx));
    return CheckWorker(worker, op);
  }

  // Finds each slice's partition and checks the slice against it; with
  // `payload`, also that it holds exactly the slices' bytes.
  absl::Status Resolve(const char* op,
                       const google::protobuf::RepeatedPtrField<pb::Slice>& slices,
                       std::vector<Partition*>* parts,
                       const PayloadReader* payload) {
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
          return absl::NotFoundError(absl::StrFormat(
              "%s of \"%s\": no such tensor (part %d is not on this server; "
              "init it first)",
              op, slice.key(), slice.part()));
        }
        if (!IsValidDType(slice.dtype()) ||
            static_cast<DType>(slice.dtype()) != part->dtype()) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s of \"%s\": got %s values, the tensor is %s", op, slice.key(),
              IsValidDType(slice.dtype())
                  ? DTypeName(static_cast<DType>(slice.dtype()))
                  : absl::StrCat("dtype ", slice.dtype()).c_str(),
              DTypeName(part->dtype())));
        }
        if (slice.offset() != part->offset() || slice.count() != part->count()) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s of \"%s\" part %d: got %d elements at offset %d, the part "
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
          "%s: the payload holds %d bytes, the slices need %d", op,
          payload->remaining(), bytes));
    }
    if (parts->empty() && payload == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": no slices"));
    }
    return absl::OkStatus();
  }

  absl::Status DoClaim(const grpc::ServerContextBase& ctx,
                       const pb::ClaimRequest& req, pb::ClaimReply* reply) {
    DEEPNEX_RETURN_IF_ERROR(CheckCall(ctx, req.worker_id(), "init"));
    const pb::TensorMeta& meta = req.meta();
    if (meta.key().empty()) return absl::InvalidArgumentError("init: empty key");
    if (!IsValidDType(meta.dtype())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "init of \"%s\": unknown dtype %d", meta.key(), meta.dtype()));
    }
    if (!IsFloatingPoint(static_cast<DType>(meta.dtype()))) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "init of \"%s\": dtype %s; parameters must be float32, float64, "
          "float16 or bfloat16",
          meta.key(), DTypeName(static_cast<DType>(meta.dtype()))));
    }
    for (int64_t d : meta.shape()) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "init of \"%s\": negative dimension %d", meta.key(), d));
      }
    }
    if (meta.num_parts() < 1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("init of \"%s\": num_parts 0", meta.key()));
    }
    std::lock_guard<std::mutex> lock(mu_);
    Tensor& t = tensors_[meta.key()];
    if (!t.meta) {
      t.meta = std::make_unique<pb::TensorMeta>(meta);
      t.meta->set_ready(false);
      t.claimed_by = req.worker_id();
      reply->set_won(true);
    } else {
      bool same = t.meta->dtype() == meta.dtype() &&
                  t.meta->shape_size() == meta.shape_size() &&
                  std::equal(meta.shape().begin(), meta.shape().end(),
                             t.meta->shape().begin());
      if (!same) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "init of \"%s\": %s differs from the existing %s", meta.key(),
            ShapeString(meta), ShapeString(*t.meta)));
      }
      // The claimer itself, restarted or retrying, writes again.
      reply->set_won(!t.meta->ready() && t.claimed_by == req.worker_id());
    }
    *reply->mutable_meta() = *t.meta;
    return absl::OkStatus();
  }

  absl::Status DoWriteParts(const grpc::ServerContextBase& ctx,
                            const grpc::ByteBuffer& request) {
    DEEPNEX_RETURN_IF_ERROR(Authenticate(ctx));
    pb::WritePartsHeader header;
    PayloadReader payload;
    DEEPNEX_RETURN_IF_ERROR(DecodeFramed(request, &header, &payload));
    DEEPNEX_RETURN_IF_ERROR(CheckWorker(header.worker_id(), "init"));
    if (header.slices_size() != header.metas_size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "init: %d slices and %d metas; they go in pairs", header.slices_size(),
          header.metas_size()));
    }
    // Every slice is checked, and the sizes added up without wrapping,
    // before anything is made.
    uint64_t bytes = 0;
    for (int i = 0; i < header.slices_size(); ++i) {
      DEEPNEX_ASSIGN_OR_RETURN(uint64_t slice_bytes,
                               CheckWrittenSlice(header.slices(i), header.metas(i)));
      if (slice_bytes > std::numeric_limits<uint64_t>::max() - bytes) {
        return absl::InvalidArgumentError(
            "init: the slices' sizes add up to more than 2^64 bytes");
      }
      bytes += slice_bytes;
    }
    if (bytes != payload.remaining()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "init: the payload holds %d bytes, the slices need %d",
          payload.remaining(), bytes));
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (const pb::Slice& slice : header.slices()) {
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
      tensors_[slice.key()].parts[slice.part()] = std::move(part);
    }
    return absl::OkStatus();
  }

  // A WriteParts slice must be the part its meta's partitioning gives;
  // returns its size in bytes.
  static absl::StatusOr<uint64_t> CheckWrittenSlice(const pb::Slice& slice,
                                                    const pb::TensorMeta& meta) {
    auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "init of \"%s\" part %d: %s", slice.key(), slice.part(), what));
    };
    if (slice.key().empty()) return bad("empty key");
    if (meta.key() != slice.key()) {
      return bad(absl::StrCat("its meta is of \"", meta.key(), "\""));
    }
    if (!IsValidDType(slice.dtype()) ||
        !IsFloatingPoint(static_cast<DType>(slice.dtype()))) {
      return bad(absl::StrCat("bad dtype ", slice.dtype()));
    }
    if (meta.dtype() != slice.dtype()) {
      return bad(absl::StrCat("dtype ", slice.dtype(), ", its meta says ", meta.dtype()));
    }
    if (slice.part() >= meta.num_parts()) {
      return bad(absl::StrCat("outside the tensor's ", meta.num_parts(), " parts"));
    }
    uint64_t elements = 1;
    for (int64_t d : meta.shape()) {
      if (d < 0) return bad(absl::StrCat("negative dimension ", d));
      if (__builtin_mul_overflow(elements, static_cast<uint64_t>(d), &elements)) {
        return bad(absl::StrCat("shape ", ShapeString(meta), " has more than 2^64 elements"));
      }
    }
    PartRange range = PartOf(elements, meta.num_parts(), slice.part());
    if (slice.offset() != range.offset || slice.count() != range.count) {
      return bad(absl::StrFormat(
          "got %d elements at offset %d; %d parts of %s make it %d at offset %d",
          slice.count(), slice.offset(), meta.num_parts(), ShapeString(meta),
          range.count, range.offset));
    }
    uint64_t bytes;
    if (__builtin_mul_overflow(slice.count(), DTypeSize(static_cast<DType>(slice.dtype())),
                               &bytes)) {
      return bad(absl::StrCat(slice.count(), " elements are more than 2^64 bytes"));
    }
    return bytes;
  }

  absl::Status DoDescribe(const grpc::ServerContextBase& ctx,
                          const pb::DescribeRequest& req,
                          pb::DescribeReply* reply) {
    DEEPNEX_RETURN_IF_ERROR(Authenticate(ctx));
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& key : req.keys()) {
      auto it = tensors_.find(key);
      if (it == tensors_.end() || !it->second.meta) {
        return absl::NotFoundError(
            absl::StrCat("no tensor \"", key, "\" (init it first)"));
      }
      pb::TensorMeta* meta = reply->add_metas();
      *meta = *it->second.meta;
      auto part0 = it->second.parts.find(0);
      if (part0 != it->second.parts.end()) meta->set_version(part0->second->version());
    }
    return absl::OkStatus();
  }

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
  std::mutex mu_;
  std::unordered_map<std::string, Tensor> tensors_;
  std::mutex checkpoint_mu_;  // one checkpoint written at a time
  std::mutex periodic_mu_;
  std::map<uint64_t, std::map<const Partition*, PartitionState>> periodic_;
  uint64_t last_periodic_ = 0;
};

class ServerImpl final : public Server {
 public:
  ServerImpl(const ServerOptions& options, TokenTable tokens, bool job_token)
      : options_(options), service_(options, std::move(tokens), job_token) {}
  ~ServerImpl() override { Stop(); }

  absl::Status Start() {
    DEEPNEX_RETURN_IF_ERROR(CheckForkSafe("ps server"));
    if (!options_.checkpoint_dir.empty()) {
      // Per server name, not per directory: a job's servers share one
      // directory, each writing its own NAME.ckpt.
      DEEPNEX_ASSIGN_OR_RETURN(
          checkpoint_lock_,
          DirectoryLock::Acquire(options_.checkpoint_dir, options_.name + ".lock",
                                 absl::StrCat("ps \"", options_.name, "\": checkpoint_dir")));
    }
    if (!options_.restore_dir.empty()) {
      DEEPNEX_RETURN_IF_ERROR(service_.Restore(options_.restore_dir));
    }
    DEEPNEX_ASSIGN_OR_RETURN(
        auto credentials,
        MakeServerCredentials(options_.tls_cert_file, options_.tls_key_file));
    grpc::ServerBuilder builder;
    builder.SetMaxReceiveMessageSize(
        static_cast<int>(std::min<uint64_t>(options_.max_message_bytes, INT32_MAX)));
    builder.SetMaxSendMessageSize(-1);
    builder.RegisterService(&service_);
    DEEPNEX_ASSIGN_OR_RETURN(
        server_, StartServer(builder, "ps server", options_.address, credentials, &port_));
    address_ = AdvertisedAddress(options_.address, options_.advertise, port_);
    if (!options_.metrics_address.empty()) {
      DEEPNEX_ASSIGN_OR_RETURN(
          metrics_http_, MetricsHttpServer::Create(service_.registry(),
                                                   options_.metrics_address));
    }
    background_ = std::thread([this] { Background(); });
    return absl::OkStatus();
  }

  std::string address() const override { return address_; }
  int port() const override { return port_; }

  void Stop() override {
    std::call_once(stop_once_, [this] {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
      }
      cv_.notify_all();
      if (background_.joinable()) background_.join();
      if (metrics_http_) metrics_http_->Stop();
      if (!server_) return;
      service_.FailWaiters(absl::UnavailableError("the parameter server is stopping"));
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
      server_->Wait();
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
      cv_.notify_all();
    });
  }

  void Wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return stopped_; });
  }

  absl::StatusOr<uint64_t> Checkpoint(const std::string& dir,
                                      std::chrono::milliseconds timeout) override {
    return service_.WriteCheckpoint(dir, timeout);
  }

  int metrics_port() const override { return metrics_http_ ? metrics_http_->port() : 0; }
  std::string MetricsText() const override { return service_.MetricsText(); }

 private:
  // Expires leases and writes periodic checkpoints until Stop().
  void Background() {
    const auto tick = std::clamp(options_.lease_timeout / 4, std::chrono::milliseconds(5),
                                 std::chrono::milliseconds(250));
    auto last_checkpoint = Clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      cv_.wait_for(lock, tick);
      if (stopping_) break;
      lock.unlock();
      service_.ExpireLeases();
      if (options_.checkpoint_every_rounds > 0) Report(service_.WritePeriodic());
      if (options_.checkpoint_interval.count() > 0 &&
          Clock::now() - last_checkpoint >= options_.checkpoint_interval) {
        Report(service_.WriteCheckpoint(options_.checkpoint_dir, std::chrono::seconds(30))
                   .status());
        last_checkpoint = Clock::now();
      }
      lock.lock();
    }
  }

  // A periodic checkpoint that failed leaves the previous one in place;
  // say so where an operator looks, and try again next time.
  void Report(const absl::Status& status) {
    if (!status.ok()) {
      std::fprintf(stderr, "deepnex ps %s: periodic checkpoint failed: %s\n",
                   options_.name.c_str(), std::string(status.message()).c_str());
    }
  }

  const ServerOptions options_;
  std::unique_ptr<DirectoryLock> checkpoint_lock_;  // released last
  Service service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  int port_ = 0;
  std::string address_;  // what peers dial (see AdvertisedAddress)
  std::once_flag stop_once_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool stopped_ = false;
  std::thread background_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Create(const ServerOptions& options) {
  DEEPNEX_RETURN_IF_ERROR(options.Validate());
  DEEPNEX_ASSIGN_OR_RETURN(TokenTable tokens,
                           TokenTable::FromOptions(options.token, options.token_file));
  // A token given alone is the job's (what its launcher hands every
  // process); a token file of named lines has admins, users and jobs. A
  // file's first line that is one field and a token of the table can only
  // be a file of the token alone, as a line of a table has three fields.
  bool job_token = !options.token.empty();
  if (!job_token && !options.token_file.empty()) {
    absl::StatusOr<std::string> lone = ResolveClientToken("", options.token_file);
    job_token = lone.ok() && tokens.Authenticate(BearerValue(*lone)).ok();
  }
  TuneMallocForLargeBuffers();
  auto server = std::make_unique<ServerImpl>(options, std::move(tokens), job_token);
  DEEPNEX_RETURN_IF_ERROR(server->Start());
  return std::unique_ptr<Server>(std::move(server));
}

}  // namespace deepnex::ps
