// deepnex-central's Containers service (its client: central_client.cc). It is a
// gpu::CentralExtension: gpu serves it beside the allocator without knowing
// about launch. One watcher thread per container waits for its end for good
// and then releases its allocation, unless another container still runs on
// it; a reaper stops containers whose allocation went away under them. Calls
// that may block (Start, Stop, Logs) run off gRPC's threads, on threads kept
// for the next such call.
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/call_pool.h"
#include "core/file_util.h"
#include "core/grpc_util.h"
#include "core/text.h"
#include "deepnex/central.grpc.pb.h"
#include "deepnex/launch/central.h"
#include "deepnex/units.h"
#include "agent/hub.h"
#include "agent/remote_launcher.h"
#include "agent/report.h"
#include "gpu/central_server.h"
#include "launch/central_wire.h"
#include "launch/images.h"
#include "launch/images_service.h"
#include "launch/record.h"
#include "launch/session_service.h"
#include "launch/spec.h"
#include "launch/util.h"

namespace deepnex::launch {
namespace {

namespace pb = ::deepnex::gpu::proto;

constexpr size_t kMaxNameLength = 63;
// How long a watcher waits for a container's end: for good.
constexpr std::chrono::milliseconds kForever = std::chrono::hours(24 * 365 * 10);
// Stopping every container when the service shuts down.
constexpr std::chrono::milliseconds kShutdownGrace{1000};
// How often running containers' allocations are checked, and the grace of
// those stopped because theirs is gone.
constexpr std::chrono::milliseconds kReapEvery{500};
constexpr std::chrono::milliseconds kReapGrace{5000};
// How long a thread of Offload's waits for the next call before it ends.
constexpr std::chrono::seconds kIdleWorker{60};
// ListContainers' user for every user's containers (admins only); asked
// for by name, so that a user's `ps --all` is refused, not narrowed.
constexpr char kEveryUser[] = "*";

// "x" and lowercase hex digits in pairs: what LauncherName makes of a user
// name that is not plain.
bool LooksEncoded(const std::string& user) {
  if (user.size() < 3 || user.size() % 2 == 0 || user[0] != 'x') return false;
  return std::all_of(user.begin() + 1, user.end(), [](char c) {
    return absl::ascii_isdigit(static_cast<unsigned char>(c)) || (c >= 'a' && c <= 'f');
  });
}

// Letters, digits, '_' and '-', and not what an encoded name looks like.
bool PlainUserName(const std::string& user) {
  if (user.empty() || LooksEncoded(user)) return false;
  for (char c : user) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') return false;
  }
  return true;
}

// The launcher's name for `user`'s container `name`: "<user>.<name>" (a
// plain user name has no '.', so two users' names never meet); other user
// names are hex-encoded, as is a plain one that looks encoded (user
// "x6a6f686e2e736d697468" would otherwise take the names of john.smith's).
std::string LauncherName(const std::string& user, const std::string& name) {
  return absl::StrCat(PlainUserName(user) ? user : absl::StrCat("x", absl::BytesToHexString(user)),
                      ".", name);
}

class ContainersService final : public pb::Containers::CallbackService,
                                public gpu::CentralExtension {
 public:
  // `mount_roots`: the launcher's allowed_mount_roots, which it enforces
  // and agents enforce on their nodes (they had none, and took any host
  // path: probe); without, deepnex-central refuses every mount.
  // `catalog`: the images users may run, served here too.
  ContainersService(gpu::Allocator& alloc, const TokenTable& tokens, agent::Hub& hub,
                    std::unique_ptr<Launcher> launcher, std::vector<std::string> mount_roots,
                    std::unique_ptr<ImageCatalog> catalog, ContainerPolicy policy)
      : alloc_(alloc), tokens_(tokens), hub_(hub), launcher_(std::move(launcher)),
        mount_roots_(std::move(mount_roots)), catalog_(std::move(catalog)),
        policy_(std::move(policy)), reaper_([this] { Reap(); }) {
    hub_.OnRegistered([this](const std::string& node,
                             const std::vector<agent::proto::ContainerReport>& running) {
      Adopt(node, running);
    });
    SessionResolver targets = [this](const grpc::ServerContextBase& ctx, const std::string& user,
                                     const std::string& name) {
      return SessionTargetOf(ctx, user, name);
    };
    sessions_ = NewSessionServices(tokens_, hub_, targets);
    images_service_ = NewImagesService(*catalog_, tokens_, policy_.registry, hub_, targets);
  }
  ~ContainersService() override { Shutdown(); }

  grpc::Service* service() override { return this; }
  std::vector<grpc::Service*> more_services() override {
    std::vector<grpc::Service*> services = sessions_->services();
    services.push_back(images_service_.get());
    return services;
  }

  void Shutdown() override {
    sessions_->Shutdown();
    std::vector<std::shared_ptr<Entry>> entries;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
      cv_.notify_all();
    }
    calls_.Shutdown();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [key, e] : entries_) entries.push_back(e);
    }
    reaper_.join();
    // All at once, so N containers take one grace period, not N.
    std::vector<std::thread> stops;
    for (auto& e : entries) {
      if (e->handle) stops.emplace_back([h = e->handle] { h->Stop(kShutdownGrace).IgnoreError(); });
    }
    for (auto& t : stops) t.join();
    for (auto& e : entries) {
      if (e->watcher.joinable()) e->watcher.join();
    }
  }

  grpc::ServerUnaryReactor* StartContainer(grpc::CallbackServerContext* ctx,
                                           const pb::StartContainerRequest* req,
                                           pb::ContainerInfo* reply) override {
    return Offload(ctx, [this, ctx, req, reply] { return Start(*ctx, *req, reply); });
  }

  grpc::ServerUnaryReactor* ListContainers(grpc::CallbackServerContext* ctx,
                                           const pb::ListContainersRequest* req,
                                           pb::ContainerList* reply) override {
    absl::Status s = [&]() -> absl::Status {
      DEEPNEX_ASSIGN_OR_RETURN(Identity who, AuthenticateCall(tokens_, *ctx));
      std::string user = req->user();
      if (who.role != AuthRole::kAdmin) {
        if (user == kEveryUser) {
          return absl::PermissionDeniedError(absl::StrCat(
              "user ", who.name, " cannot list every user's containers: that is for admins"));
        }
        if (!user.empty() && user != who.name) {
          return absl::PermissionDeniedError(absl::StrCat(
              "user ", who.name, " cannot list the containers of ", user));
        }
        user = who.name;
      }
      if (user == kEveryUser) user.clear();
      std::vector<std::shared_ptr<Entry>> entries;
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& [key, e] : entries_) {
          if (e->handle && (user.empty() || key.first == user) && who.Reaches(e->job)) {
            entries.push_back(e);
          }
        }
      }
      for (auto& e : entries) Describe(*e, reply->add_containers());
      return absl::OkStatus();
    }();
    return Reply(ctx, s);
  }

  grpc::ServerUnaryReactor* StopContainer(grpc::CallbackServerContext* ctx,
                                          const pb::StopContainerRequest* req,
                                          pb::ContainerInfo* reply) override {
    return Offload(ctx, [this, ctx, req, reply]() -> absl::Status {
      DEEPNEX_ASSIGN_OR_RETURN(auto e, Find(*ctx, req->user(), req->name()));
      auto grace = std::chrono::milliseconds(std::max<int64_t>(0, req->grace_ms()));
      DEEPNEX_RETURN_IF_ERROR(e->handle->Stop(grace));
      // An agent's container has ended once its node reports so, which may
      // come after the stop command's reply; the reply says how it ended.
      e->handle->Wait(grace + std::chrono::seconds(10)).IgnoreError();
      // The reply shows the allocation as the watcher leaves it.
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return e->watched; });
      lock.unlock();
      Describe(*e, reply);
      return absl::OkStatus();
    });
  }

  grpc::ServerUnaryReactor* ContainerLogs(grpc::CallbackServerContext* ctx,
                                          const pb::ContainerLogsRequest* req,
                                          pb::ContainerLogsReply* reply) override {
    // Offloaded: an agent's container's log is a command to its node, and
    // a gRPC thread blocked on the answer may be the one that would read it
    // (a few followers at once held central for the command's timeout).
    return Offload(ctx, [this, ctx, req, reply]() -> absl::Status {
      DEEPNEX_ASSIGN_OR_RETURN(auto e, Find(*ctx, req->user(), req->name()));
      // By offset, so that a big log never sits whole in central's memory.
      DEEPNEX_ASSIGN_OR_RETURN(LogChunk chunk, e->handle->ReadLogs(req->offset(), kMaxLogChunk));
      reply->set_data(std::move(chunk.data));
      reply->set_next_offset(chunk.next_offset);
      reply->set_ended(chunk.ended);
      return absl::OkStatus();
    });
  }

 private:
  struct Entry {
    std::string user, name, allocation_id;
    std::string job;  // the allocation's
    // What it holds of its allocation's CPUs and memory until it ends.
    double cpus = 0;
    uint64_t memory = 0;
    std::shared_ptr<Handle> handle;  // null while it starts
    std::string node;     // the allocation's
    Launcher* launcher = nullptr;  // where it runs: launcher_ or an agent's (remote_)
    std::thread watcher;
    bool ended = false;              // for good; set by the watcher
    uint64_t ended_seq = 0;          // the order it ended in, for pruning
    bool allocation_released = false;
    bool watched = false;            // the watcher is done (after the release)
  };
  using Key = std::pair<std::string, std::string>;  // (user, name)

  static grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx,
                                         const absl::Status& status) {
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(ToGrpcStatus(status));
    return reactor;
  }

  // Runs `fn` off gRPC's threads (it may block, e.g. on an agent's answer,
  // which a gRPC thread reads) and finishes the call with its status.
  template <class Fn>
  grpc::ServerUnaryReactor* Offload(grpc::CallbackServerContext* ctx, Fn fn) {
    auto* reactor = ctx->DefaultReactor();
    if (!calls_.Run([reactor, fn = std::move(fn)]() mutable {
          reactor->Finish(ToGrpcStatus(fn()));
        })) {
      return Reply(ctx, absl::UnavailableError("deepnex-central is stopping"));
    }
    return reactor;
  }

  // The container `name` of `user` (admins) or of the caller. Another
  // user's is NotFound, as if it did not exist.
  absl::StatusOr<std::shared_ptr<Entry>> Find(const grpc::ServerContextBase& ctx,
                                              const std::string& user, const std::string& name) {
    DEEPNEX_ASSIGN_OR_RETURN(Identity who, AuthenticateCall(tokens_, ctx));
    std::string owner = who.name;
    if (!user.empty() && user != who.name) {
      if (who.role != AuthRole::kAdmin) {
        return absl::PermissionDeniedError(
            absl::StrCat("user ", who.name, " cannot act on the containers of ", user));
      }
      owner = user;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(Key{owner, name});
    if (it == entries_.end() || !it->second->handle) {
      return absl::NotFoundError(
          absl::StrCat("no container \"", name, "\" of user ", owner));
    }
    DEEPNEX_RETURN_IF_ERROR(
        CheckJob(who, it->second->job, absl::StrCat("container \"", name, "\"")));
    return it->second;
  }

  // Where a session's container runs: here, or on its node's agent.
  absl::StatusOr<SessionTarget> SessionTargetOf(const grpc::ServerContextBase& ctx,
                                                const std::string& user, const std::string& name) {
    DEEPNEX_ASSIGN_OR_RETURN(auto e, Find(ctx, user, name));
    SessionTarget t;
    if (e->launcher == launcher_.get()) t.local = e->handle;
    t.backend = e->launcher->backend();
    t.node = e->node;
    t.name = LauncherName(e->user, e->name);
    t.user = e->user;
    return t;
  }

  absl::Status Start(const grpc::ServerContextBase& ctx, const pb::StartContainerRequest& req,
                     pb::ContainerInfo* reply) {
    DEEPNEX_ASSIGN_OR_RETURN(Identity who, AuthenticateCall(tokens_, ctx));
    if (req.allocation_id().empty()) {
      return absl::InvalidArgumentError("allocation_id is empty");
    }
    DEEPNEX_ASSIGN_OR_RETURN(gpu::Allocation a, alloc_.GetAllocation(req.allocation_id()));
    if (who.role != AuthRole::kAdmin && a.user != who.name) {
      // Not whose: a user may not list another's allocations either.
      return absl::PermissionDeniedError(absl::StrCat(
          "user ", who.name, " cannot start a container on allocation ", a.id,
          ": it is another user's"));
    }
    DEEPNEX_RETURN_IF_ERROR(CheckJob(who, a.job, "allocation " + a.id));
    DEEPNEX_ASSIGN_OR_RETURN(ContainerSpec spec, SpecFromProto(req.spec()));
    if (!spec.mounts.empty() && mount_roots_.empty()) {
      return absl::PermissionDeniedError(absl::StrCat(
          "spec.mounts[0].source: ", QuotedPath(spec.mounts[0].source),
          ": this deepnex-central allows no mounts (its --allow-mount is not set)"));
    }
    const std::string image_name = spec.image;  // the catalog's name, as the user gave it
    DEEPNEX_RETURN_IF_ERROR(ApplyPolicy(a.user, &spec));
    const std::string name = spec.name;
    const std::string launcher_name = LauncherName(a.user, name);
    // The launcher checks "<user>.<name>", whose first character is the
    // user's: the name's own first one is checked here ("..", ".x", "-x").
    DEEPNEX_RETURN_IF_ERROR(CheckName("spec.name", name, kMaxNameLength));
    if (launcher_name.size() > kMaxNameLength) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.name: \"", name, "\" must be 1 to ",
          kMaxNameLength - (launcher_name.size() - name.size()),
          " characters for user ", a.user));
    }
    // Another user's name was dropped without a word (probe), the
    // container running as the allocation's user.
    if (!spec.user.empty()) DEEPNEX_RETURN_IF_ERROR(CheckSpecUser(spec.user, a));
    spec.name = launcher_name;
    spec.user = a.user;
    spec.allocation = a;
    spec.labels["deepnex.user"] = a.user;

    auto entry = std::make_shared<Entry>();
    entry->user = a.user;
    entry->name = name;
    entry->allocation_id = a.id;
    entry->job = a.job;
    // As the launcher resolves them: no limit takes the grant's whole.
    entry->cpus = spec.cpus != 0 ? spec.cpus : a.cpus;
    entry->memory = spec.memory != 0 ? spec.memory : a.memory;
    std::shared_ptr<Entry> previous;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pruning_.count(Key{a.user, name})) {
        return absl::UnavailableError(absl::StrCat(
            "spec.name: container \"", name, "\" of user ", a.user,
            " ended long ago and its files are being removed; start it again in a moment"));
      }
      auto it = entries_.find(Key{a.user, name});
      if (it != entries_.end()) {
        if (!it->second->ended) {
          return absl::AlreadyExistsError(absl::StrCat(
              "spec.name: container \"", name, "\" of user ", a.user, " exists and has not ended"));
        }
        previous = it->second;
      }
      DEEPNEX_RETURN_IF_ERROR(FitsGrantLocked(a, spec, *entry));
      entries_[Key{a.user, name}] = entry;
    }
    // Where it runs: on its allocation's node, through that node's agent
    // when it has one; otherwise here.
    Launcher& launcher = LauncherFor(a.node);
    entry->launcher = &launcher;
    entry->node = a.node;
    if (previous) {
      previous->watcher.join();
      previous->launcher->Remove(launcher_name).IgnoreError();
    }
    auto handle = launcher.Start(spec);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!handle.ok()) {
        entries_.erase(Key{a.user, name});
        // Named as its user named them: the container, and a catalog image,
        // whose source on the admin's host is none of the user's (probe).
        return AsNamed(handle.status(),
                       {{absl::StrCat("\"", launcher_name, "\""), absl::StrCat("\"", name, "\"")},
                        {absl::StartsWith(spec.image, "/") ? spec.image : "", image_name}});
      }
      entry->handle = *handle;
      entry->watcher = std::thread([this, entry] { Watch(entry); });
    }
    Describe(*entry, reply, /*usage=*/false);
    return absl::OkStatus();
  }

  // The grant's CPUs and memory bound the sum over its containers that have
  // not ended for good (starting, running or restarting), `e` included.
  // A spec over the grant on its own is left to the launcher's message.
  absl::Status FitsGrantLocked(const gpu::Allocation& a, const ContainerSpec& spec,
                               const Entry& e) {
    double cpus = e.cpus;
    uint64_t memory = e.memory;
    for (const auto& [key, other] : entries_) {
      if (other->allocation_id == a.id && !other->ended) {
        cpus += other->cpus;
        memory += other->memory;
      }
    }
    // Why a second container without limits does not fit.
    auto whole = [](bool unlimited, const std::string& what) {
      return unlimited ? absl::StrCat(" (without ", what, " a container takes the grant's whole)")
                       : std::string();
    };
    // Slack for sums of fractional cores (0.1 ten times).
    constexpr double kSlack = 1e-9;
    if (e.cpus <= a.cpus && cpus > a.cpus + kSlack) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "spec.cpus: allocation \"", a.id, "\" grants ", a.cpus,
          " CPUs; its running containers would use ", cpus, whole(spec.cpus == 0, "spec.cpus")));
    }
    if (e.memory <= a.memory && memory > a.memory) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "spec.memory: allocation \"", a.id, "\" grants ", FormatByteSize(a.memory),
          "; its running containers would use ", FormatByteSize(memory),
          whole(spec.memory == 0, "spec.memory")));
    }
    return absl::OkStatus();
  }

  // Runs `user`'s `spec` as their mapped identity, with an image from the
  // catalog and the host network only where the policy allows them.
  absl::Status ApplyPolicy(const std::string& user, ContainerSpec* spec) const {
    auto identity = policy_.users.find(user);
    if (identity == policy_.users.end()) {
      return absl::PermissionDeniedError(absl::StrCat(
          "user ", user, " has no uid on this deepnex-central (its --user or --users-file), "
          "so their containers cannot run"));
    }
    spec->run_as = identity->second;
    const bool host_on_process = launcher_->backend() == "process" && spec->image == "host";
    if (!host_on_process) {
      // The catalog's source, never the user's text: a user names no path.
      const ImageCaller caller{user};
      auto image = catalog_->Resolve(caller, spec->image);
      if (!image.ok()) {
        std::vector<std::string> names;
        for (const CatalogImage& i : catalog_->List(caller)) {
          names.push_back(absl::StrCat(ImageCatalog::DisplayName(caller, i),
                                       i.tag == kDefaultTag ? "" : ":" + i.tag));
        }
        // A directory image is named by its path (the whole message is
        // cut at 2 KiB on the wire).
        return absl::PermissionDeniedError(absl::StrCat(
            "spec.image: ", QuotedPath(spec->image), " is not an image that user ", user,
            " may run [",
            absl::StrJoin(names, ", "), "] (deepnex images)"));
      }
      spec->image = image->source;
    }
    if (spec->host_network && !policy_.host_network_users.count("*") &&
        !policy_.host_network_users.count(user)) {
      return absl::PermissionDeniedError(absl::StrCat(
          "spec.host_network: user ", user,
          " may not use the host's network on this deepnex-central (its --allow-host-network)"));
    }
    return absl::OkStatus();
  }

  // Waits for the container's end for good, then releases its allocation
  // unless another container still runs on it.
  void Watch(const std::shared_ptr<Entry>& e) {
    // Only an agent's container fails to wait, when central stops: it runs
    // on, and keeps its allocation.
    const bool ended = e->handle->Wait(kForever).ok();
    std::unique_lock<std::mutex> lock(mu_);
    if (!ended) {
      e->watched = true;
      cv_.notify_all();
      return;
    }
    e->ended = true;
    bool shared = false;
    for (auto& [key, other] : entries_) {
      if (other != e && other->allocation_id == e->allocation_id && !other->ended) shared = true;
    }
    if (!shared) {
      lock.unlock();
      absl::Status s = alloc_.Release(e->allocation_id);
      lock.lock();
      // NotFound: its user released it already.
      e->allocation_released = s.ok() || absl::IsNotFound(s);
    }
    e->watched = true;
    e->ended_seq = ++ended_seq_;
    std::vector<std::shared_ptr<Entry>> pruned = PruneEndedLocked(e->user);
    cv_.notify_all();
    lock.unlock();
    for (const std::shared_ptr<Entry>& p : pruned) {
      p->watcher.join();
      p->launcher->Remove(LauncherName(p->user, p->name)).IgnoreError();
      std::lock_guard<std::mutex> relock(mu_);
      pruning_.erase(Key{p->user, p->name});
    }
  }

  // Takes `user`'s oldest ended containers past
  // ContainerPolicy::ended_kept_per_user out of
  // entries_ (their names held in pruning_ until their files are gone);
  // the caller joins and removes them. REQUIRES: mu_ held.
  std::vector<std::shared_ptr<Entry>> PruneEndedLocked(const std::string& user) {
    std::vector<std::shared_ptr<Entry>> ended;
    for (auto it = entries_.lower_bound(Key{user, ""});
         it != entries_.end() && it->first.first == user; ++it) {
      if (it->second->ended && it->second->watched) ended.push_back(it->second);
    }
    // Unbounded, one user held 70 KB of central's memory per ended container
    // and up to 128 MiB of logs per name, for good.
    const size_t keep = std::max<size_t>(1, policy_.ended_kept_per_user);
    if (ended.size() <= keep) return {};
    std::sort(ended.begin(), ended.end(),
              [](const auto& a, const auto& b) { return a->ended_seq < b->ended_seq; });
    ended.resize(ended.size() - keep);
    for (const std::shared_ptr<Entry>& p : ended) {
      entries_.erase(Key{p->user, p->name});
      pruning_.insert(Key{p->user, p->name});
    }
    return ended;
  }

  // Stops the containers whose allocation is gone (released by its user or
  // an admin, or its lease expired), so that they hold no GPU that the
  // allocator may grant again.
  void Reap() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, kReapEvery, [this] { return stopping_; })) {
      // With whether it ended: one counted lost with its node (its grant
      // released) runs again when a partition heals.
      std::vector<std::pair<std::shared_ptr<Entry>, bool>> held;
      for (auto& [key, e] : entries_) {
        if (e->handle) held.emplace_back(e, e->ended);
      }
      lock.unlock();
      for (auto& [e, ended] : held) {
        if (ended && e->handle->Status().state != State::kRunning) continue;
        if (absl::IsNotFound(alloc_.GetAllocation(e->allocation_id).status())) {
          e->handle->Stop(kReapGrace).IgnoreError();
        }
      }
      lock.lock();
    }
  }

  // Reads the handle outside mu_: Usage may read cgroups or ask an engine.
  // Without `usage` (a container that just started has used nothing yet,
  // and an agent's start answer carries none), its usage is left zero.
  void Describe(Entry& e, pb::ContainerInfo* p, bool usage = true) {
    // Read before the status: released only once it ended (Watch), so that
    // a record that says released also says how it ended. Read after, the
    // two could straddle the end (CI: released, and no last_exit).
    bool released;
    {
      std::lock_guard<std::mutex> lock(mu_);
      released = e.allocation_released;
    }
    const ContainerSpec& spec = e.handle->spec();
    ContainerStatus st = e.handle->Status();
    p->set_name(e.name);
    p->set_user(e.user);
    p->set_allocation_id(e.allocation_id);
    p->set_backend(e.launcher->backend());
    p->set_node(e.node);
    p->set_id(st.id);
    p->set_state(StateName(st.state));
    p->set_restarts(st.restarts);
    if (st.last_exit) p->set_last_exit(st.last_exit->ToString());
    if (spec.allocation) {
      for (const auto& g : spec.allocation->gpus) p->add_gpus(g.index);
    }
    // The limits it runs under: a spec without them takes its grant's.
    p->set_cpus(e.cpus);
    p->set_memory(e.memory);
    if (absl::StatusOr<Usage> u = usage ? e.handle->Usage() : Usage{}; u.ok()) {
      p->mutable_usage()->set_cpu_seconds(u->cpu_seconds);
      p->mutable_usage()->set_memory(u->memory);
      p->mutable_usage()->set_memory_peak(u->memory_peak);
      p->mutable_usage()->set_pids(u->pids);
    }
    p->set_started_at(std::chrono::duration<double>(st.started_at.time_since_epoch()).count());
    p->set_allocation_released(released);
  }

  // Central's own launcher's containers that run, as the hub exports an
  // agent's (whose are the hub's). Usage is read outside mu_ (Describe).
  void ExportMetrics(MetricsRegistry& registry) override {
    std::vector<std::shared_ptr<Entry>> own;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [key, e] : entries_) {
        if (e->launcher == launcher_.get() && e->handle != nullptr && !e->ended) own.push_back(e);
      }
    }
    for (const std::shared_ptr<Entry>& e : own) {
      absl::StatusOr<Usage> u = e->handle->Usage();
      if (!u.ok()) continue;
      ExportContainerUsage(registry, e->node, e->user, LauncherName(e->user, e->name), *u);
    }
  }

  // A restarted central takes back what an agent reports running on its
  // node (the records are the agent's, so none is lost with central). One
  // whose allocation is gone is stopped by Reap; one known already is left.
  void Adopt(const std::string& node, const std::vector<agent::proto::ContainerReport>& running) {
    for (const auto& r : running) {
      if (agent::Ended(r) || r.user().empty()) continue;
      const std::string prefix = LauncherName(r.user(), "");
      if (r.name().rfind(prefix, 0) != 0) continue;
      auto a = alloc_.GetAllocation(r.allocation_id());
      // A node token acts only as its node: a report of a grant on another
      // node, or of another user's, is not taken (nor would its end release
      // that grant). One whose grant is gone is taken, and Reap stops it.
      if (a.ok() && (a->node != node || a->user != r.user())) continue;
      ContainerSpec spec;
      spec.name = r.name();
      spec.user = r.user();
      spec.cpus = r.cpus();
      spec.memory = r.memory();
      if (a.ok()) spec.allocation = *a;
      auto entry = std::make_shared<Entry>();
      entry->user = r.user();
      entry->name = r.name().substr(prefix.size());
      entry->allocation_id = r.allocation_id();
      entry->job = a.ok() ? a->job : "";
      entry->cpus = r.cpus();
      entry->memory = r.memory();
      entry->node = node;
      entry->launcher = &LauncherFor(node);
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) continue;
      auto known = entries_.find(Key{entry->user, entry->name});
      if (known != entries_.end()) {
        // Placed again on another node while this one was lost (a partition
        // that healed since): this run is the duplicate. Stopped off the
        // agent's stream, whose reads wait for this callback.
        if (known->second->node != node) {
          calls_.Run([h = agent::NewRemoteHandle(hub_, node, spec)] {
            h->Stop(kReapGrace).IgnoreError();
          });
        }
        continue;
      }
      entry->handle = agent::NewRemoteHandle(hub_, node, spec);
      entries_[Key{entry->user, entry->name}] = entry;
      entry->watcher = std::thread([this, entry] { Watch(entry); });
    }
  }

  // The launcher of `node`: an agent's, or this central's own.
  Launcher& LauncherFor(const std::string& node) {
    if (!hub_.HasAgent(node)) return *launcher_;
    std::lock_guard<std::mutex> lock(mu_);
    auto& remote = remote_[node];
    if (!remote) remote = agent::NewRemoteLauncher(hub_, node, mount_roots_);
    return *remote;
  }

  gpu::Allocator& alloc_;
  const TokenTable& tokens_;
  agent::Hub& hub_;
  const std::unique_ptr<Launcher> launcher_;
  std::map<std::string, std::unique_ptr<Launcher>> remote_;  // by node; guarded by mu_
  const std::vector<std::string> mount_roots_;
  const std::unique_ptr<ImageCatalog> catalog_;
  std::unique_ptr<grpc::Service> images_service_;  // set in the constructor
  const ContainerPolicy policy_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, std::shared_ptr<Entry>> entries_;
  std::set<Key> pruning_;  // taken out of entries_, files being removed
  uint64_t ended_seq_ = 0;
  bool stopping_ = false;
  std::unique_ptr<SessionServices> sessions_;
  CallPool calls_{kIdleWorker};  // Offload's
  std::thread reaper_;  // last: it uses the members above
};

// The file in the launch state_dir naming the launcher that last served
// from it: its containers are swept even where their records are damaged.
constexpr char kLastLauncherFile[] = "launcher_id";

// See CreateCentralServer. `launcher` holds the state_dir's lock, so the
// launcher of every other record there is gone, whatever its pid shows (a
// killed central not yet reaped is a zombie; a pid is reused).
absl::Status SweepOrphans(Launcher& launcher, gpu::Allocator& alloc, const std::string& state_dir,
                          std::vector<std::string>* swept) {
  struct Orphan {
    std::string dir, allocation;
  };
  std::map<std::string, std::vector<Orphan>> by_launcher;
  std::vector<std::string> unrecorded;  // container directories without a readable record
  const std::string last_file = state_dir + "/" + kLastLauncherFile;
  if (auto last = ReadWholeFile(last_file, "launcher id"); last.ok()) {
    const std::string id(absl::StripAsciiWhitespace(*last));
    if (CheckName("launcher_id", id, 32).ok()) {
      by_launcher[id];
    } else if (swept != nullptr) {
      swept->push_back(absl::StrCat(last_file, " is damaged; the launcher before went unswept"));
    }
  }
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(state_dir + "/containers", ec)) {
    if (!entry.is_directory(ec)) continue;
    auto text = ReadWholeFile(entry.path().string() + "/" + kRecordFile, "container record");
    nlohmann::json r = text.ok() ? nlohmann::json::parse(*text, nullptr, false) : nullptr;
    const std::string id = r.is_object() ? r.value("launcher_id", "") : "";
    if (id.empty()) {
      unrecorded.push_back(entry.path().string());
    } else if (id != launcher.id()) {
      by_launcher[id].push_back({entry.path().string(), r.value("allocation", "")});
    }
  }
  for (const auto& [id, orphans] : by_launcher) {
    DEEPNEX_ASSIGN_OR_RETURN(int objects, launcher.Cleanup(id));
    std::vector<std::string> released;
    for (const Orphan& o : orphans) {
      if (!o.allocation.empty() && alloc.GetAllocation(o.allocation).ok()) {
        DEEPNEX_RETURN_IF_ERROR(alloc.Release(o.allocation));
        released.push_back(o.allocation);
      }
      std::filesystem::remove_all(o.dir, ec);
    }
    if (swept != nullptr && (objects > 0 || !orphans.empty())) {
      swept->push_back(absl::StrCat(
          "swept ", orphans.size(), " container(s) of launcher ", id, " (no longer running; ",
          objects, " process(es) or engine object(s) removed)",
          released.empty() ? "" : absl::StrCat(", released ", absl::StrJoin(released, ", "))));
    }
  }
  // Their launcher's objects went above, where its id was known; their
  // grants, unnamed, stay held until their users release them.
  for (const std::string& dir : unrecorded) {
    std::filesystem::remove_all(dir, ec);
    if (swept != nullptr) {
      swept->push_back(absl::StrCat("removed ", dir,
                                    ": no readable container record; its allocation, if any, "
                                    "stays held until released"));
    }
  }
  return WriteFileAtomically(last_file, launcher.id() + "\n");
}

}  // namespace

absl::StatusOr<std::unique_ptr<gpu::CentralServer>> CreateCentralServer(
    const gpu::CentralServerOptions& options, const LauncherOptions& launcher,
    const ContainerPolicy& policy, std::vector<std::string>* swept) {
  for (const auto& [user, r] : policy.users) {
    // Root's groups reach what the daemon itself holds.
    if (r.uid == 0 || r.gid == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "users: ", user, " maps to uid ", r.uid, " gid ", r.gid,
          "; containers never run as root or in its group"));
    }
    if (geteuid() != 0 && (r.uid != geteuid() || r.gid != getegid())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "users: ", user, " maps to uid ", r.uid, " gid ", r.gid,
          ", but deepnex-central runs as uid ", geteuid(), " gid ", getegid(),
          " and only root can run containers as another user"));
    }
  }
  DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<Launcher> l, Launcher::Create(launcher));
  // The factory runs once, inside the call below, before the server serves.
  auto extension = [&](gpu::Allocator& alloc, const TokenTable& tokens, agent::Hub& hub)
      -> absl::StatusOr<std::unique_ptr<gpu::CentralExtension>> {
    // In the allocator's state directory, so that it lives as long, and
    // opened after the allocator locked it: a second central is refused
    // naming that directory.
    DEEPNEX_ASSIGN_OR_RETURN(
        std::unique_ptr<ImageCatalog> catalog,
        ImageCatalog::Open(options.allocator.state_dir.empty()
                               ? ""
                               : options.allocator.state_dir + "/images"));
    // The --image flags are presets, run by the launcher's name for them (an
    // agent maps the name on its node); one in the catalog already keeps its
    // creation time.
    for (const auto& [name, dir] : launcher.images) {
      CatalogImage preset;
      preset.name = name;
      preset.source = name;
      preset.size = DirectorySize(dir);
      absl::Status s = catalog->Put(preset, /*force=*/false);
      if (!s.ok() && !absl::IsAlreadyExists(s)) return s;
    }
    if (!launcher.state_dir.empty()) {
      DEEPNEX_RETURN_IF_ERROR(SweepOrphans(*l, alloc, launcher.state_dir, swept));
    }
    return std::make_unique<ContainersService>(alloc, tokens, hub, std::move(l),
                                               launcher.allowed_mount_roots,
                                               std::move(catalog), policy);
  };
  return gpu::CreateCentralServer(options, extension);
}

}  // namespace deepnex::launch
