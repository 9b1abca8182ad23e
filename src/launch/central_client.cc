// CentralClient: the client of deepnex-central's Containers service, which
// central.cc serves. Split from central.cc: the service and its client share
// only the wire form (central_wire.h).
#include <algorithm>
#include <functional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/grpc_util.h"
#include "deepnex/auth.h"
#include "deepnex/central.grpc.pb.h"
#include "deepnex/launch/central.h"
#include "launch/central_wire.h"
#include "launch/session_client.h"

namespace deepnex::launch {
namespace {

namespace pb = ::deepnex::gpu::proto;

absl::StatusOr<CentralContainer> FromProto(const pb::ContainerInfo& p) {
  CentralContainer c;
  c.name = p.name();
  c.user = p.user();
  c.allocation_id = p.allocation_id();
  c.backend = p.backend();
  c.id = p.id();
  DEEPNEX_ASSIGN_OR_RETURN(c.state, ParseState(p.state()));
  c.restarts = p.restarts();
  c.last_exit = p.last_exit();
  c.gpus.assign(p.gpus().begin(), p.gpus().end());
  c.cpus = p.cpus();
  c.memory = p.memory();
  c.usage.cpu_seconds = p.usage().cpu_seconds();
  c.usage.memory = p.usage().memory();
  c.usage.memory_peak = p.usage().memory_peak();
  c.usage.pids = p.usage().pids();
  c.started_at = std::chrono::system_clock::time_point(
      std::chrono::duration_cast<std::chrono::system_clock::duration>(
          std::chrono::duration<double>(p.started_at())));
  c.allocation_released = p.allocation_released();
  c.node = p.node();
  return c;
}

class CentralClientImpl final : public CentralClient {
 public:
  CentralClientImpl(const gpu::CentralClientOptions& options, std::string token)
      : options_(options), token_(std::move(token)) {}

  absl::Status Connect() {
    DEEPNEX_ASSIGN_OR_RETURN(auto credentials, MakeChannelCredentials(options_.tls_ca_file));
    DEEPNEX_ASSIGN_OR_RETURN(auto channel, Dial("central", options_.address, credentials,
                                                std::min(options_.timeout, kConnectTimeout)));
    stub_ = pb::Containers::NewStub(channel);
    channel_ = channel;
    return absl::OkStatus();
  }

  absl::StatusOr<CentralContainer> StartContainer(const ContainerSpec& spec,
                                                  const std::string& allocation_id) override {
    if (spec.allocation) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.allocation: deepnex-central applies allocation ", allocation_id,
          "; leave the spec's empty"));
    }
    pb::StartContainerRequest req;
    SpecToProto(spec, req.mutable_spec());
    req.set_allocation_id(allocation_id);
    pb::ContainerInfo reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call([&](auto* ctx) { return stub_->StartContainer(ctx, req, &reply); }));
    return FromProto(reply);
  }

  absl::StatusOr<std::vector<CentralContainer>> ListContainers(const std::string& user) override {
    pb::ListContainersRequest req;
    req.set_user(user);
    pb::ContainerList reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call([&](auto* ctx) { return stub_->ListContainers(ctx, req, &reply); }));
    std::vector<CentralContainer> out;
    for (const auto& c : reply.containers()) {
      DEEPNEX_ASSIGN_OR_RETURN(CentralContainer x, FromProto(c));
      out.push_back(std::move(x));
    }
    return out;
  }

  absl::StatusOr<CentralContainer> StopContainer(const std::string& name,
                                                 std::chrono::milliseconds grace,
                                                 const std::string& user) override {
    pb::StopContainerRequest req;
    req.set_name(name);
    req.set_grace_ms(grace.count());
    req.set_user(user);
    pb::ContainerInfo reply;
    DEEPNEX_RETURN_IF_ERROR(Call(
        [&](auto* ctx) { return stub_->StopContainer(ctx, req, &reply); }, grace));
    return FromProto(reply);
  }

  absl::StatusOr<LogChunk> ContainerLogs(const std::string& name, uint64_t offset,
                                         const std::string& user) override {
    pb::ContainerLogsRequest req;
    req.set_name(name);
    req.set_offset(offset);
    req.set_user(user);
    pb::ContainerLogsReply reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call([&](auto* ctx) { return stub_->ContainerLogs(ctx, req, &reply); }));
    return LogChunk{reply.data(), reply.next_offset(), reply.ended()};
  }

  absl::Status FollowContainerLogs(const std::string& name,
                                   const std::function<bool(const std::string&)>& sink,
                                   std::chrono::milliseconds poll,
                                   const std::string& user) override {
    uint64_t offset = 0;
    while (true) {
      DEEPNEX_ASSIGN_OR_RETURN(LogChunk chunk, ContainerLogs(name, offset, user));
      offset = chunk.next_offset;
      if (!chunk.data.empty() && !sink(chunk.data)) return absl::OkStatus();
      if (chunk.ended) return absl::OkStatus();
      // A full chunk: more is there already.
      if (chunk.data.size() < kMaxLogChunk) std::this_thread::sleep_for(poll);
    }
  }

  absl::StatusOr<std::unique_ptr<Session>> OpenSession(const SessionOptions& options) override {
    return OpenCentralSession(channel_, token_, options);
  }

 private:
  // `extra`: time the call may take on top of the client's timeout.
  template <class Fn>
  absl::Status Call(Fn fn, std::chrono::milliseconds extra = std::chrono::milliseconds(0)) {
    DEEPNEX_RETURN_IF_ERROR(CheckForkSafe("central client"));
    const std::chrono::milliseconds timeout = options_.timeout + extra;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    ctx.set_wait_for_ready(true);
    if (!token_.empty()) ctx.AddMetadata(kAuthorizationKey, BearerValue(token_));
    grpc::Status s = fn(&ctx);
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
        s.error_message() == "Deadline Exceeded") {
      return absl::UnavailableError(absl::StrCat("deepnex-central at ", options_.address,
                                                 " did not answer within ", timeout.count(), "ms"));
    }
    if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      return absl::FailedPreconditionError(absl::StrCat(
          "deepnex-central at ", options_.address, " has no launcher: ", s.error_message()));
    }
    return ToAbslStatus(s);
  }

  const gpu::CentralClientOptions options_;
  const std::string token_;
  std::unique_ptr<pb::Containers::Stub> stub_;
  std::shared_ptr<grpc::Channel> channel_;  // for sessions
};

}  // namespace

absl::StatusOr<std::unique_ptr<CentralClient>> CentralClient::Create(
    const gpu::CentralClientOptions& options) {
  DEEPNEX_ASSIGN_OR_RETURN(std::string token,
                           ResolveClientToken(options.token, options.token_file));
  auto client = std::make_unique<CentralClientImpl>(options, std::move(token));
  DEEPNEX_RETURN_IF_ERROR(client->Connect());
  return std::unique_ptr<CentralClient>(std::move(client));
}

}  // namespace deepnex::launch
