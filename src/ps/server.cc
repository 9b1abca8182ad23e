#include "deepnex/ps/server.h"

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/grpc_util.h"
#include "deepnex/auth.h"
#include "deepnex/ps.grpc.pb.h"
#include "ps/partition.h"

namespace deepnex::ps {

const char* ModeName(Mode mode) {
  switch (mode) {
    case Mode::kSync: return "sync";
    case Mode::kAsync: return "async";
  }
  return "?";
}

absl::StatusOr<Mode> ParseMode(const std::string& name) {
  if (name == "sync") return Mode::kSync;
  if (name == "async") return Mode::kAsync;
  return absl::InvalidArgumentError(
      absl::StrCat("mode: unknown \"", name, "\" (one of sync, async)"));
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
  if (num_workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_workers=", num_workers, ": must be at least 1"));
  }
  if (address.empty()) return absl::InvalidArgumentError("address is empty");
  if (max_message_bytes < 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes=", max_message_bytes, ": must be at least 1024"));
  }
  return optimizer.Validate();
}

namespace {

namespace pb = ::deepnex::ps::proto;

// A call that may outlive its handler: it waits on partitions, which report
// to it from other calls' threads. Finished exactly once, by whichever of
// completion, failure or cancellation comes first.
class Call {
 public:
  virtual ~Call() = default;
  bool Finished() const { return finished_.load(std::memory_order_acquire); }
  void Fail(const absl::Status& status) {
    if (!finished_.exchange(true)) reactor_->Finish(ToGrpcStatus(status));
  }

 protected:
  // REQUIRES: the caller won `finished_`.
  bool Claim() { return !finished_.exchange(true); }
  grpc::ServerUnaryReactor* reactor_ = nullptr;

 private:
  friend class CallReactor;
  std::atomic<bool> finished_{false};
};

// Owns the Call until gRPC is done with it; a cancelled call (client gone,
// deadline passed) is finished so that the server never waits on it.
class CallReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit CallReactor(std::shared_ptr<Call> call) : call_(std::move(call)) {
    call_->reactor_ = this;
  }
  void OnCancel() override { call_->Fail(absl::CancelledError("call cancelled")); }
  void OnDone() override { delete this; }

 private:
  std::shared_ptr<Call> call_;
};

class PushCall final : public Call, public PushSink {
 public:
  explicit PushCall(size_t slices) : remaining_(slices) {}
  void SliceApplied(size_t) override {
    if (remaining_.fetch_sub(1) == 1 && Claim()) reactor_->Finish(grpc::Status::OK);
  }
  bool Finished() const override { return Call::Finished(); }

 private:
  std::atomic<size_t> remaining_;
};

class PullCall final : public Call, public PullSink {
 public:
  PullCall(std::vector<uint64_t> offsets, uint64_t total, grpc::ByteBuffer* response)
      : offsets_(std::move(offsets)),
        total_(total),
        buffer_(new char[total]),
        versions_(offsets_.size()),
        remaining_(offsets_.size()),
        response_(response) {}
  char* Destination(size_t slice) override { return buffer_.get() + offsets_[slice]; }
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
  bool Finished() const override { return Call::Finished(); }

 private:
  const std::vector<uint64_t> offsets_;
  const uint64_t total_;
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

using ServiceBase = pb::ParameterServer::WithCallbackMethod_Register<
    pb::ParameterServer::WithCallbackMethod_Claim<
        pb::ParameterServer::WithCallbackMethod_Commit<
            pb::ParameterServer::WithCallbackMethod_Describe<
                pb::ParameterServer::WithRawCallbackMethod_WriteParts<
                    pb::ParameterServer::WithRawCallbackMethod_Push<
                        pb::ParameterServer::WithRawCallbackMethod_Pull<
                            pb::ParameterServer::Service>>>>>>>;

// The tensors this server holds, and the RPC handlers over them.
// Thread-safe: `mu_` guards the directory of tensors only; data operations
// lock the partitions they touch.
class Service final : public ServiceBase {
 public:
  Service(const ServerOptions& options, TokenTable tokens)
      : options_(options), tokens_(std::move(tokens)) {
    config_.mode = options.mode;
    config_.num_workers = options.num_workers;
    config_.reduction = options.reduction;
    config_.optimizer = options.optimizer;
  }

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx,
                                     const pb::RegisterRequest* req,
                                     pb::RegisterReply* reply) override {
    absl::Status s = CheckCall(*ctx, req->worker_id(), "register");
    if (s.ok()) {
      reply->set_num_workers(options_.num_workers);
      reply->set_mode(ModeName(options_.mode));
    }
    return Reply(ctx, s);
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

    auto call = std::make_shared<PushCall>(parts.size());
    auto* reactor = new CallReactor(call);
    Completions done;
    for (size_t i = 0; i < parts.size(); ++i) {
      parts[i]->Push(header.worker_id(), header.slices(i).version(), &payload,
                     call, i, &done);
    }
    for (auto& fn : done) fn();
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
    if (s.ok()) s = CheckWorker(req.worker_id(), "pull");
    if (s.ok()) s = Resolve("pull", req.slices(), &parts, nullptr);
    if (!s.ok()) return Reply(ctx, s);

    std::vector<uint64_t> offsets;
    uint64_t total = 0;
    for (Partition* p : parts) {
      offsets.push_back(total);
      total += p->bytes();
    }
    auto call = std::make_shared<PullCall>(std::move(offsets), total, response);
    auto* reactor = new CallReactor(call);
    Completions done;
    for (size_t i = 0; i < parts.size(); ++i) {
      parts[i]->Pull(req.slices(i).version(), call, i, &done);
    }
    for (auto& fn : done) fn();
    return reactor;
  }

 private:
  struct Tensor {
    std::unique_ptr<pb::TensorMeta> meta;  // on the server holding part 0
    int claimed_by = -1;
    std::map<uint32_t, std::unique_ptr<Partition>> parts;
  };

  absl::Status Authenticate(const grpc::ServerContextBase& ctx) const {
    return AuthenticateCall(tokens_, ctx, options_.job_id).status();
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
              "%s of \"%s\" part %d: got elements [%d, %d), the part holds "
              "[%d, %d)",
              op, slice.key(), slice.part(), slice.offset(),
              slice.offset() + slice.count(), part->offset(),
              part->offset() + part->count()));
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
      return absl::InvalidArgumentError("init: slices and metas differ in number");
    }
    uint64_t bytes = 0;
    for (const pb::Slice& slice : header.slices()) {
      if (!IsValidDType(slice.dtype()) ||
          !IsFloatingPoint(static_cast<DType>(slice.dtype()))) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "init of \"%s\": bad dtype %d", slice.key(), slice.dtype()));
      }
      bytes += slice.count() * DTypeSize(static_cast<DType>(slice.dtype()));
    }
    if (bytes != payload.remaining()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "init: the payload holds %d bytes, the slices need %d",
          payload.remaining(), bytes));
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (const pb::Slice& slice : header.slices()) {
      DType dtype = static_cast<DType>(slice.dtype());
      auto& part = tensors_[slice.key()].parts[slice.part()];
      if (part) {  // first init wins
        payload.Skip(slice.count() * DTypeSize(dtype));
        continue;
      }
      part = Partition::Create(config_, dtype, slice.offset(), slice.count());
      part->Write(&payload);
    }
    return absl::OkStatus();
  }

  absl::Status DoDescribe(const grpc::ServerContextBase& ctx,
                          const pb::DescribeRequest& req,
                          pb::DescribeReply* reply) {
    DEEPNEX_RETURN_IF_ERROR(CheckCall(ctx, req.worker_id(), "describe"));
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
      if (part0 != it->second.parts.end()) {
        meta->set_version(part0->second->version());
        meta->set_next_round(part0->second->next_round(req.worker_id()));
      }
    }
    return absl::OkStatus();
  }

  const ServerOptions options_;
  const TokenTable tokens_;
  PartitionConfig config_;
  std::mutex mu_;
  std::unordered_map<std::string, Tensor> tensors_;
};

class ServerImpl final : public Server {
 public:
  ServerImpl(const ServerOptions& options, TokenTable tokens)
      : service_(options, std::move(tokens)) {}
  ~ServerImpl() override { Stop(); }

  absl::Status Start(const ServerOptions& options) {
    DEEPNEX_ASSIGN_OR_RETURN(
        auto credentials,
        MakeServerCredentials(options.tls_cert_file, options.tls_key_file));
    grpc::ServerBuilder builder;
    builder.AddListeningPort(options.address, credentials, &port_);
    builder.SetMaxReceiveMessageSize(
        static_cast<int>(std::min<uint64_t>(options.max_message_bytes, INT32_MAX)));
    builder.SetMaxSendMessageSize(-1);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    if (!server_ || port_ == 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on \"", options.address, "\""));
    }
    host_ = options.address.substr(0, options.address.rfind(':'));
    return absl::OkStatus();
  }

  std::string address() const override {
    return absl::StrCat(host_, ":", port_);
  }
  int port() const override { return port_; }

  void Stop() override {
    std::call_once(stop_once_, [this] {
      if (!server_) return;
      // Calls still waiting (pulls for a round that will not come) are
      // cancelled after a short grace.
      server_->Shutdown(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(200));
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

 private:
  Service service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string host_;
  std::once_flag stop_once_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopped_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Create(
    const ServerOptions& options) {
  DEEPNEX_RETURN_IF_ERROR(options.Validate());
  DEEPNEX_ASSIGN_OR_RETURN(
      TokenTable tokens,
      TokenTable::FromOptions(options.token, options.token_file));
  TuneMallocForLargeBuffers();
  auto server = std::make_unique<ServerImpl>(options, std::move(tokens));
  DEEPNEX_RETURN_IF_ERROR(server->Start(options));
  return std::unique_ptr<Server>(std::move(server));
}

}  // namespace deepnex::ps
