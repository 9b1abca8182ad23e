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
#include "gpu/central_call.h"
#include "launch/central_wire.h"
#include "launch/session_client.h"

namespace deepnex::launch {
namespace {

namespace pb = ::deepnex::gpu::proto;

// A commit's time on top of the client's timeout: the node packs and
// pushes the container's changes.
constexpr std::chrono::minutes kCommitTime{30};

// Seconds since the epoch, as the wire carries times.
std::chrono::system_clock::time_point TimeFromSeconds(double seconds) {
  return std::chrono::system_clock::time_point(
      std::chrono::duration_cast<std::chrono::system_clock::duration>(
          std::chrono::duration<double>(seconds)));
}

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
  c.started_at = TimeFromSeconds(p.started_at());
  c.allocation_released = p.allocation_released();
  c.node = p.node();
  return c;
}

CentralImage ImageFromProto(const pb::CatalogImage& p) {
  CentralImage i;
  i.name = p.name();
  i.tag = p.tag();
  i.owner = p.owner();
  i.visibility = p.visibility();
  i.shared_with.assign(p.shared_with().begin(), p.shared_with().end());
  i.size = p.size();
  i.created = TimeFromSeconds(p.created());
  return i;
}

class CentralClientImpl final : public CentralClient {
 public:
  CentralClientImpl(const gpu::CentralClientOptions& options, gpu::CentralCaller caller)
      : options_(options),
        caller_(std::move(caller)),
        stub_(pb::Containers::NewStub(caller_.channel())),
        images_(pb::Images::NewStub(caller_.channel())) {}

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
        Call(req, [&](auto* ctx) { return stub_->StartContainer(ctx, req, &reply); }));
    return FromProto(reply);
  }

  absl::StatusOr<std::vector<CentralContainer>> ListContainers(const std::string& user) override {
    pb::ListContainersRequest req;
    req.set_user(user);
    pb::ContainerList reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(req, [&](auto* ctx) { return stub_->ListContainers(ctx, req, &reply); }));
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
        req, [&](auto* ctx) { return stub_->StopContainer(ctx, req, &reply); }, grace));
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
        Call(req, [&](auto* ctx) { return stub_->ContainerLogs(ctx, req, &reply); }));
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

  absl::StatusOr<std::vector<CentralImage>> ListImages() override {
    const pb::ListImagesRequest req;
    pb::ImageList reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(req, [&](auto* ctx) { return images_->ListImages(ctx, req, &reply); }));
    std::vector<CentralImage> out;
    for (const auto& i : reply.images()) out.push_back(ImageFromProto(i));
    return out;
  }

  absl::StatusOr<CentralImage> RegisterImage(const std::string& name, const std::string& source,
                                             const std::string& owner, bool force) override {
    pb::RegisterImageRequest req;
    req.set_name(name);
    req.set_source(source);
    req.set_owner(owner);
    req.set_force(force);
    pb::CatalogImage reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(req, [&](auto* ctx) { return images_->RegisterImage(ctx, req, &reply); }));
    return ImageFromProto(reply);
  }

  absl::StatusOr<CentralImage> ShareImage(const std::string& name,
                                          const std::vector<std::string>& users,
                                          bool make_public) override {
    pb::ShareImageRequest req = ShareRequest(name, users);
    req.set_public_(make_public);
    pb::CatalogImage reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(req, [&](auto* ctx) { return images_->ShareImage(ctx, req, &reply); }));
    return ImageFromProto(reply);
  }

  absl::StatusOr<CentralImage> UnshareImage(const std::string& name,
                                            const std::vector<std::string>& users) override {
    pb::ShareImageRequest req = ShareRequest(name, users);
    pb::CatalogImage reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(req, [&](auto* ctx) { return images_->UnshareImage(ctx, req, &reply); }));
    return ImageFromProto(reply);
  }

  absl::StatusOr<CentralImage> RemoveImage(const std::string& name) override {
    pb::RemoveImageRequest req;
    req.set_name(name);
    pb::CatalogImage reply;
    DEEPNEX_RETURN_IF_ERROR(
        Call(req, [&](auto* ctx) { return images_->RemoveImage(ctx, req, &reply); }));
    return ImageFromProto(reply);
  }

  absl::StatusOr<CentralImage> Commit(const std::string& container,
                                      const std::string& name) override {
    pb::CommitRequest req;
    req.set_container(container);
    req.set_name(name);
    pb::CatalogImage reply;
    DEEPNEX_RETURN_IF_ERROR(Call(req, [&](auto* ctx) { return images_->Commit(ctx, req, &reply); },
                                 kCommitTime));
    return ImageFromProto(reply);
  }

  absl::StatusOr<std::unique_ptr<Session>> OpenSession(const SessionOptions& options) override {
    return OpenCentralSession(caller_.channel(), caller_.token(), options);
  }

 private:
  static pb::ShareImageRequest ShareRequest(const std::string& name,
                                            const std::vector<std::string>& users) {
    pb::ShareImageRequest req;
    req.set_name(name);
    for (const auto& u : users) req.add_users(u);
    return req;
  }

  // `extra`: time the call may take on top of the client's timeout.
  template <class Fn>
  absl::Status Call(const google::protobuf::Message& request, Fn fn,
                    std::chrono::milliseconds extra = std::chrono::milliseconds(0)) {
    absl::Status s = caller_.Call(request, fn, extra);
    if (s.code() == absl::StatusCode::kUnimplemented) {
      return absl::FailedPreconditionError(absl::StrCat(
          "deepnex-central at ", options_.address, " has no launcher: ", s.message()));
    }
    return s;
  }

  const gpu::CentralClientOptions options_;
  const gpu::CentralCaller caller_;
  std::unique_ptr<pb::Containers::Stub> stub_;
  std::unique_ptr<pb::Images::Stub> images_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CentralClient>> CentralClient::Create(
    const gpu::CentralClientOptions& options) {
  DEEPNEX_ASSIGN_OR_RETURN(gpu::CentralCaller caller, gpu::CentralCaller::Connect(options));
  return std::unique_ptr<CentralClient>(
      std::make_unique<CentralClientImpl>(options, std::move(caller)));
}

}  // namespace deepnex::launch
