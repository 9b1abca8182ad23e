// CentralClient: blocking unary calls to deepnex-central, each with a
// deadline; a waiting Allocate gets its own timeout plus the client's.
#include "absl/strings/str_cat.h"
#include "core/grpc_util.h"
#include "deepnex/central.grpc.pb.h"
#include "deepnex/gpu/central.h"
#include "gpu/central_convert.h"

namespace deepnex::gpu {
namespace {

class CentralClientImpl final : public CentralClient {
 public:
  CentralClientImpl(const CentralClientOptions& options, std::string token)
      : options_(options), token_(std::move(token)) {}

  absl::Status Connect() {
    DEEPNEX_ASSIGN_OR_RETURN(auto credentials, MakeChannelCredentials(options_.tls_ca_file));
    stub_ = pb::Central::NewStub(MakeChannel(options_.address, credentials));
    return absl::OkStatus();
  }

  absl::Status AddNode(const Node& node) override {
    pb::Node req;
    ToProto(node, &req);
    pb::Empty reply;
    return Call(options_.timeout, [&](auto* ctx) { return stub_->AddNode(ctx, req, &reply); });
  }
  absl::Status RemoveNode(const std::string& name) override {
    pb::NameRequest req;
    req.set_name(name);
    pb::Empty reply;
    return Call(options_.timeout, [&](auto* ctx) { return stub_->RemoveNode(ctx, req, &reply); });
  }
  absl::Status SetNodeMode(const std::string& name, Mode mode, ModeSwitch when) override {
    pb::ModeRequest req;
    req.set_name(name);
    req.set_mode(ModeName(mode));
    req.set_when_drained(when == ModeSwitch::kWhenDrained);
    pb::Empty reply;
    return Call(options_.timeout, [&](auto* ctx) { return stub_->SetNodeMode(ctx, req, &reply); });
  }
  absl::Status Cordon(const std::string& name) override {
    pb::NameRequest req;
    req.set_name(name);
    pb::Empty reply;
    return Call(options_.timeout, [&](auto* ctx) { return stub_->Cordon(ctx, req, &reply); });
  }
  absl::Status Uncordon(const std::string& name) override {
    pb::NameRequest req;
    req.set_name(name);
    pb::Empty reply;
    return Call(options_.timeout, [&](auto* ctx) { return stub_->Uncordon(ctx, req, &reply); });
  }
  absl::Status Drain(const std::string& name, bool release) override {
    pb::DrainRequest req;
    req.set_name(name);
    req.set_release(release);
    pb::Empty reply;
    return Call(options_.timeout, [&](auto* ctx) { return stub_->Drain(ctx, req, &reply); });
  }
  absl::StatusOr<std::string> SetQuota(const std::string& user, const Quota& quota) override {
    pb::QuotaRequest req;
    req.set_user(user);
    ToProto(quota, req.mutable_quota());
    pb::NoteReply reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(options_.timeout, [&](auto* ctx) { return stub_->SetQuota(ctx, req, &reply); }));
    return reply.note();
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
    // A waiting call without a timeout has no deadline of its own.
    std::chrono::milliseconds deadline =
        !options.wait ? options_.timeout
        : options.timeout.count() > 0 ? options.timeout + options_.timeout
                                      : std::chrono::hours(24 * 365);
    DEEPNEX_RETURN_IF_ERROR(
        Call(deadline, [&](auto* ctx) { return stub_->Allocate(ctx, req, &reply); }));
    if (reply.allocations_size() == 0) {
      return absl::InternalError("deepnex-central granted no allocations");
    }
    std::vector<Allocation> out;
    for (const auto& a : reply.allocations()) out.push_back(FromProto(a));
    return out;
  }
  absl::Status Release(const std::string& id) override {
    pb::IdRequest req;
    req.set_id(id);
    pb::Empty reply;
    return Call(options_.timeout, [&](auto* ctx) { return stub_->Release(ctx, req, &reply); });
  }
  absl::StatusOr<Allocation> Renew(const std::string& id) override {
    pb::IdRequest req;
    req.set_id(id);
    pb::Allocation reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(options_.timeout, [&](auto* ctx) { return stub_->Renew(ctx, req, &reply); }));
    return FromProto(reply);
  }
  absl::StatusOr<std::vector<Allocation>> Allocations(const std::string& user) override {
    pb::AllocationsRequest req;
    req.set_user(user);
    pb::Allocations reply;
    DEEPNEX_RETURN_IF_ERROR(Call(
        options_.timeout, [&](auto* ctx) { return stub_->ListAllocations(ctx, req, &reply); }));
    std::vector<Allocation> out;
    for (const auto& a : reply.allocations()) out.push_back(FromProto(a));
    return out;
  }
  absl::StatusOr<std::vector<NodeInfo>> Nodes() override {
    pb::Empty req;
    pb::Nodes reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(options_.timeout, [&](auto* ctx) { return stub_->ListNodes(ctx, req, &reply); }));
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
        Call(options_.timeout, [&](auto* ctx) { return stub_->Metrics(ctx, req, &reply); }));
    return reply.text();
  }

 private:
  template <class Fn>
  absl::Status Call(std::chrono::milliseconds timeout, Fn fn) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    ctx.set_wait_for_ready(true);
    if (!token_.empty()) ctx.AddMetadata(kAuthorizationKey, BearerValue(token_));
    grpc::Status s = fn(&ctx);
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && s.error_message() == "Deadline Exceeded") {
      return absl::UnavailableError(absl::StrCat("deepnex-central at ", options_.address,
                                                 " did not answer within ", timeout.count(), "ms"));
    }
    return ToAbslStatus(s);
  }

  const CentralClientOptions options_;
  const std::string token_;
  std::unique_ptr<pb::Central::Stub> stub_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CentralClient>> CentralClient::Create(
    const CentralClientOptions& options) {
  if (options.address.empty()) return absl::InvalidArgumentError("address is empty");
  DEEPNEX_ASSIGN_OR_RETURN(std::string token,
                           ResolveClientToken(options.token, options.token_file));
  auto client = std::make_unique<CentralClientImpl>(options, std::move(token));
  DEEPNEX_RETURN_IF_ERROR(client->Connect());
  return std::unique_ptr<CentralClient>(std::move(client));
}

}  // namespace deepnex::gpu
