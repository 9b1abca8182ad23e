#include "launch/images_service.h"

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/call_pool.h"
#include "core/grpc_util.h"
#include "deepnex/agent.pb.h"
#include "deepnex/central.grpc.pb.h"
#include "launch/images_registry.h"

namespace deepnex::launch {
namespace {

namespace pb = ::deepnex::gpu::proto;

void ToProto(const ImageCaller& caller, const CatalogImage& i, pb::CatalogImage* p) {
  p->set_name(ImageCatalog::DisplayName(caller, i));
  p->set_tag(i.tag);
  p->set_owner(i.owner);
  p->set_visibility(i.visibility());
  // Whom it is shared with is the owner's business.
  if (caller.admin || caller.user == i.owner) {
    for (const auto& u : i.shared_with) p->add_shared_with(u);
  }
  p->set_size(i.size);
  p->set_created(i.created);
}

// OWNER/NAME:TAG, or NAME:TAG for a preset.
std::string RefOf(const CatalogImage& i) {
  return absl::StrCat(i.owner.empty() ? "" : i.owner + "/", i.name, ":", i.tag);
}

// The registry repository of an owner's image: OWNER/NAME, and the presets
// (no owner) under library/NAME. A user named "library" would share the
// presets' repositories and could push over one that every user runs, so
// that user cannot push at all.
absl::StatusOr<std::string> RepositoryOf(const std::string& owner, const std::string& name) {
  if (owner.empty()) return "library/" + name;
  if (owner == "library") {
    return absl::PermissionDeniedError(
        "user \"library\": the registry's library/ repositories hold the presets; a user of "
        "that name cannot store images there");
  }
  return owner + "/" + name;
}

// How long a node may take to pack and push a container's changes.
constexpr std::chrono::minutes kCommitTimeout{30};

class ImagesService final : public pb::Images::CallbackService {
 public:
  ImagesService(ImageCatalog& catalog, const TokenTable& tokens, std::string registry,
                agent::Hub& hub, SessionResolver containers)
      : catalog_(catalog), tokens_(tokens), registry_(std::move(registry)), hub_(hub),
        containers_(std::move(containers)) {}

  grpc::ServerUnaryReactor* ListImages(grpc::CallbackServerContext* ctx,
                                       const pb::ListImagesRequest*,
                                       pb::ImageList* reply) override {
    return Run(ctx, [&]() -> absl::Status {
      DEEPNEX_ASSIGN_OR_RETURN(ImageCaller caller, Caller(*ctx));
      for (const CatalogImage& i : catalog_.List(caller)) ToProto(caller, i, reply->add_images());
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* RegisterImage(grpc::CallbackServerContext* ctx,
                                          const pb::RegisterImageRequest* req,
                                          pb::CatalogImage* reply) override {
    return Run(ctx, [&]() -> absl::Status {
      DEEPNEX_ASSIGN_OR_RETURN(ImageCaller caller, Caller(*ctx));
      if (!caller.admin) {
        return absl::PermissionDeniedError(
            absl::StrCat("user ", caller.user, " cannot register images (admins only)"));
      }
      DEEPNEX_ASSIGN_OR_RETURN(ImageRef ref, ImageRef::Parse(req->name(), "name"));
      if (!ref.owner.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "name: \"", req->name(), "\" has an owner; give it as owner instead"));
      }
      const std::string& source = req->source();
      std::error_code ec;
      if (source != "host" &&
          (source.empty() || source[0] != '/' || !std::filesystem::is_directory(source, ec))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "source: \"", source, "\" is not an absolute directory on deepnex-central's host "
            "or \"host\""));
      }
      CatalogImage i;
      i.name = ref.name;
      i.tag = ref.tag;
      i.owner = req->owner();
      i.source = source;
      i.size = DirectorySize(source);
      // An OCI image layout goes to the registry, where every node can
      // pull it; a rootfs directory stays on central's host.
      if (!registry_.empty() && std::filesystem::exists(source + "/oci-layout", ec)) {
        if (!req->force() && catalog_.Resolve(caller, RefOf(i)).ok()) {
          return absl::AlreadyExistsError(
              absl::StrCat("image \"", RefOf(i), "\" exists (force replaces it)"));
        }
        DEEPNEX_ASSIGN_OR_RETURN(std::string repository, RepositoryOf(i.owner, i.name));
        RegistryRef ref{registry_, repository, i.tag, ""};
        DEEPNEX_RETURN_IF_ERROR(PushLayout(source, "", ref));
        // Pinned to what was pushed, as a commit is: a site's registry
        // takes pushes from whoever reaches it (a user's process on a
        // node), and one pushed over library/NAME:TAG, so that every
        // user's next start of the preset ran that user's files (probe).
        DEEPNEX_ASSIGN_OR_RETURN(ref.digest, RegistryDigest(ref));
        i.source = ref.ToString();
      }
      DEEPNEX_RETURN_IF_ERROR(catalog_.Put(i, req->force()));
      DEEPNEX_ASSIGN_OR_RETURN(i, catalog_.Resolve(caller, RefOf(i)));
      ToProto(caller, i, reply);
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* ShareImage(grpc::CallbackServerContext* ctx,
                                       const pb::ShareImageRequest* req,
                                       pb::CatalogImage* reply) override {
    return Change(ctx, reply, [&](const ImageCaller& caller) {
      return catalog_.Share(caller, req->name(), {req->users().begin(), req->users().end()},
                            req->public_());
    });
  }

  grpc::ServerUnaryReactor* UnshareImage(grpc::CallbackServerContext* ctx,
                                         const pb::ShareImageRequest* req,
                                         pb::CatalogImage* reply) override {
    return Change(ctx, reply, [&](const ImageCaller& caller) {
      return catalog_.Unshare(caller, req->name(), {req->users().begin(), req->users().end()});
    });
  }

  // Packing and pushing the changes takes a while: off gRPC's threads.
  grpc::ServerUnaryReactor* Commit(grpc::CallbackServerContext* ctx, const pb::CommitRequest* req,
                                   pb::CatalogImage* reply) override {
    auto* reactor = ctx->DefaultReactor();
    auto commit = [this, ctx, req, reply, reactor] {
      reactor->Finish(ToGrpcStatus(DoCommit(*ctx, *req, reply)));
    };
    if (!calls_.Run(commit)) {
      reactor->Finish(ToGrpcStatus(absl::UnavailableError("deepnex-central is stopping")));
    }
    return reactor;
  }

  grpc::ServerUnaryReactor* RemoveImage(grpc::CallbackServerContext* ctx,
                                        const pb::RemoveImageRequest* req,
                                        pb::CatalogImage* reply) override {
    return Change(ctx, reply,
                  [&](const ImageCaller& caller) { return catalog_.Remove(caller, req->name()); });
  }

 private:
  template <class Fn>
  static grpc::ServerUnaryReactor* Run(grpc::CallbackServerContext* ctx, Fn fn) {
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(ToGrpcStatus(fn()));
    return reactor;
  }

  // A change of one image by the caller: `fn(caller)` returns the image
  // as it is now (or was, removed), which is the reply.
  template <class Fn>
  grpc::ServerUnaryReactor* Change(grpc::CallbackServerContext* ctx, pb::CatalogImage* reply,
                                   Fn fn) {
    return Run(ctx, [&]() -> absl::Status {
      DEEPNEX_ASSIGN_OR_RETURN(ImageCaller caller, Caller(*ctx));
      DEEPNEX_ASSIGN_OR_RETURN(CatalogImage i, fn(caller));
      ToProto(caller, i, reply);
      return absl::OkStatus();
    });
  }

  absl::Status DoCommit(const grpc::ServerContextBase& ctx, const pb::CommitRequest& req,
                        pb::CatalogImage* reply) {
    DEEPNEX_ASSIGN_OR_RETURN(ImageCaller caller, Caller(ctx));
    DEEPNEX_ASSIGN_OR_RETURN(ImageRef ref, ImageRef::Parse(req.name(), "name"));
    if (!ref.owner.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "name: \"", req.name(), "\" has an owner; a commit is the caller's own NAME[:TAG]"));
    }
    CatalogImage i;
    i.name = ref.name;
    i.tag = ref.tag;
    i.owner = caller.user;
    // Held until the image is recorded (or the commit fails): a second
    // commit of the name fails now rather than pushing over this one's tag.
    DEEPNEX_ASSIGN_OR_RETURN(ImageCatalog::Reservation held,
                             catalog_.Reserve(i.owner, i.name, i.tag));
    // The caller's own only: another user's container is NotFound.
    DEEPNEX_ASSIGN_OR_RETURN(SessionTarget target, containers_(ctx, "", req.container()));
    if (target.backend != "oci") {
      return absl::FailedPreconditionError(absl::StrCat(
          "container \"", req.container(), "\" runs on the ", target.backend,
          " backend: only oci containers have a layer of changes to commit"));
    }
    if (registry_.empty()) {
      return absl::FailedPreconditionError(
          "this deepnex-central has no --registry to store committed images in");
    }
    // Per owner in the registry too: users' names do not collide.
    DEEPNEX_ASSIGN_OR_RETURN(std::string repository, RepositoryOf(i.owner, i.name));
    RegistryRef pushed{registry_, repository, i.tag, ""};
    i.source = pushed.ToString();
    if (target.local) {
      DEEPNEX_ASSIGN_OR_RETURN(i.size, target.local->Commit(i.source));
    } else {
      agent::proto::Command c;
      c.mutable_commit()->set_name(target.name);
      c.mutable_commit()->set_image(i.source);
      DEEPNEX_ASSIGN_OR_RETURN(agent::proto::Reply r, hub_.Call(target.node, c, kCommitTimeout));
      i.size = r.size();
    }
    // Pinned to what was pushed: the reservation keeps other commits off
    // the tag until this is read.
    DEEPNEX_ASSIGN_OR_RETURN(pushed.digest, RegistryDigest(pushed));
    i.source = pushed.ToString();
    DEEPNEX_RETURN_IF_ERROR(held.Fill(i));
    DEEPNEX_ASSIGN_OR_RETURN(i, catalog_.Resolve(caller, RefOf(i)));
    ToProto(caller, i, reply);
    return absl::OkStatus();
  }

  absl::StatusOr<ImageCaller> Caller(const grpc::ServerContextBase& ctx) const {
    DEEPNEX_ASSIGN_OR_RETURN(Identity who, AuthenticateCall(tokens_, ctx));
    return ImageCaller{who.name, who.role == AuthRole::kAdmin};
  }

  ImageCatalog& catalog_;
  const TokenTable& tokens_;
  const std::string registry_;
  agent::Hub& hub_;
  const SessionResolver containers_;
  CallPool calls_{std::chrono::seconds(60)};  // last: its calls use the above
};

}  // namespace

std::unique_ptr<grpc::Service> NewImagesService(ImageCatalog& catalog, const TokenTable& tokens,
                                                std::string registry, agent::Hub& hub,
                                                SessionResolver containers) {
  return std::make_unique<ImagesService>(catalog, tokens, std::move(registry), hub,
                                         std::move(containers));
}

}  // namespace deepnex::launch
