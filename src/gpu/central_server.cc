// deepnex-central's service: the Allocator behind token auth, on gRPC's
// callback API. Allocate and Release use the allocator's asynchronous forms,
// so no gRPC thread waits for a ledger fsync or the queue, and calls in
// flight together share fsyncs; every other call runs inline.
#include <atomic>
#include <functional>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "agent/hub.h"
#include "core/grpc_util.h"
#include "core/net.h"
#include "core/text.h"
#include "deepnex/auth.h"
#include "deepnex/central.grpc.pb.h"
#include "deepnex/gpu/central.h"
#include "deepnex/metrics.h"
#include "deepnex/units.h"
#include "gpu/central_convert.h"
#include "gpu/central_server.h"
#include "gpu/jobs_store.h"

namespace deepnex::gpu {
namespace {

class Service;

// One Allocate or Batch call: its ops run through the allocator's
// asynchronous forms and the call finishes with the last answer. A cancel
// from the client (gone, or past its deadline) withdraws the ops still
// waiting in the queue -- a strict queue must not wait for the dead -- and a
// grant that crosses the cancel is released, since nobody would learn its id.
class OpsReactor final : public grpc::ServerUnaryReactor {
 public:
  // `ops`: how many ops the call starts; Started() once they all have.
  OpsReactor(Service* service, grpc::CallbackServerContext* ctx, int ops)
      : service_(service), ctx_(ctx), left_(ops + 1) {}

  using AllocateReply = std::function<void(const absl::StatusOr<std::vector<Allocation>>&)>;
  using ReleaseReply = std::function<void(const absl::Status&)>;
  void Allocate(const Identity& who, const pb::Request& req, AllocateReply reply);
  void Release(const Identity& who, const std::string& id, ReleaseReply reply);
  // An op answered without the allocator.
  void Skip() { OneDone(); }
  void Started() { OneDone(); }
  // The call's status (a batch's is OK: each op has its own).
  void set_status(const absl::Status& s) { status_ = ToGrpcStatus(s); }

  void OnCancel() override;
  void OnDone() override { delete this; }

 private:
  void OneDone() {
    if (left_.fetch_sub(1) == 1) Finish(status_);
  }
  bool cancelled() {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_ || ctx_->IsCancelled();
  }

  Service* const service_;
  grpc::CallbackServerContext* const ctx_;
  std::atomic<int> left_;  // ops unanswered, +1 until Started()
  grpc::Status status_;
  std::mutex mu_;
  bool cancelled_ = false;
  std::vector<uint64_t> tickets_;  // ops waiting in the allocator's queue
};

class Service final : public pb::Central::CallbackService {
 public:
  friend class OpsReactor;

  Service(std::unique_ptr<Allocator> alloc, TokenTable tokens, const agent::HubOptions& hub,
          std::function<std::string()> more_metrics)
      : more_metrics_(std::move(more_metrics)),
        alloc_(std::move(alloc)),
        tokens_(std::move(tokens)),
        hub_(*alloc_, tokens_, hub),
        grants_(registry_.GetCounter("deepnex_grants_total", "Allocations granted.")),
        releases_(registry_.GetCounter("deepnex_releases_total",
                                       "Release calls that succeeded.")),
        refusals_(registry_.GetCounter("deepnex_refusals_total",
                                       "Allocate calls refused (quota, capacity, bad input).")) {
    const LedgerReport ledger = alloc_->Recovered();
    const char* recovered_help =
        "Ledger records replayed at start, from the snapshot and from the log.";
    registry_.GetGauge("deepnex_ledger_recovered_records", recovered_help, {{"source", "snapshot"}})
        ->Set(ledger.snapshot_records);
    registry_.GetGauge("deepnex_ledger_recovered_records", recovered_help, {{"source", "log"}})
        ->Set(ledger.log_records);
    registry_
        .GetGauge("deepnex_ledger_torn_records",
                  "Records dropped at start from a torn tail of the newest log file (never "
                  "acknowledged).")
        ->Set(ledger.torn_records);
    registry_.GetGauge("deepnex_ledger_torn_bytes", "Bytes of that torn tail.")
        ->Set(ledger.torn_bytes);
  }

  Allocator& allocator() { return *alloc_; }
  const TokenTable& tokens() const { return tokens_; }
  agent::Hub& hub() { return hub_; }
  // Set once, before serving.
  void SetExtension(CentralExtension* extension) { extension_ = extension; }

  std::string MetricsText() const {
    // The allocator's state goes into a registry made per scrape: a node
    // removed, or moved to another mode, leaves no series behind.
    MetricsRegistry now;
    for (const auto& n : alloc_->Nodes()) {
      const std::string mode = ModeName(n.mode);
      for (size_t i = 0; i < n.node.gpus.size(); ++i) {
        const Labels gpu{{"node", n.node.name},
                         {"gpu", std::to_string(n.node.gpus[i].index)},
                         {"mode", mode}};
        now.GetGauge("deepnex_gpu_memory_allocated_bytes", "GPU memory granted, per GPU.", gpu)
            ->Set(n.gpu_memory_used[i]);
        now.GetGauge("deepnex_gpu_memory_free_bytes", "GPU memory not granted, per GPU.", gpu)
            ->Set(n.node.gpus[i].memory - n.gpu_memory_used[i]);
      }
      const char* gpus_help = "GPUs per node by mode and state (used: holding an allocation).";
      const int free = n.gpus_free();
      now.GetGauge("deepnex_node_gpus", gpus_help,
                   {{"node", n.node.name}, {"mode", mode}, {"state", "used"}})
          ->Set(static_cast<int>(n.node.gpus.size()) - free);
      now.GetGauge("deepnex_node_gpus", gpus_help,
                   {{"node", n.node.name}, {"mode", mode}, {"state", "free"}})
          ->Set(free);
    }
    now.GetGauge("deepnex_queue_length", "Requests waiting for capacity.")
        ->Set(alloc_->QueueLength());
    return registry_.PrometheusText() + now.PrometheusText() +
           hub_.MetricsText([this](MetricsRegistry& containers) {
             if (extension_ != nullptr) extension_->ExportMetrics(containers);
           }) +
           (more_metrics_ ? more_metrics_() : "");
  }

  // ---- admin

  grpc::ServerUnaryReactor* AddNode(grpc::CallbackServerContext* ctx, const pb::Node* req,
                                    pb::Empty*) override {
    absl::Status s = Admin(*ctx);
    if (s.ok()) {
      auto node = FromProto(*req);
      s = node.ok() ? alloc_->AddNode(*node) : node.status();
    }
    return Reply(ctx, s);
  }
  grpc::ServerUnaryReactor* RemoveNode(grpc::CallbackServerContext* ctx,
                                       const pb::NameRequest* req, pb::Empty*) override {
    absl::Status s = Admin(*ctx);
    return Reply(ctx, s.ok() ? alloc_->RemoveNode(req->name()) : s);
  }
  grpc::ServerUnaryReactor* SetNodeMode(grpc::CallbackServerContext* ctx,
                                        const pb::ModeRequest* req, pb::Empty*) override {
    absl::Status s = Admin(*ctx);
    if (s.ok()) {
      auto mode = ParseMode(req->mode(), "mode");
      s = mode.ok() ? alloc_->SetNodeMode(req->name(), *mode,
                                          req->when_drained() ? ModeSwitch::kWhenDrained
                                                              : ModeSwitch::kRefuse)
                    : mode.status();
    }
    return Reply(ctx, s);
  }
  grpc::ServerUnaryReactor* Cordon(grpc::CallbackServerContext* ctx, const pb::NameRequest* req,
                                   pb::Empty*) override {
    absl::Status s = Admin(*ctx);
    return Reply(ctx, s.ok() ? alloc_->Cordon(req->name()) : s);
  }
  grpc::ServerUnaryReactor* Uncordon(grpc::CallbackServerContext* ctx,
                                     const pb::NameRequest* req, pb::Empty*) override {
    absl::Status s = Admin(*ctx);
    return Reply(ctx, s.ok() ? alloc_->Uncordon(req->name()) : s);
  }
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* ctx, const pb::DrainRequest* req,
                                  pb::Empty*) override {
    absl::Status s = Admin(*ctx);
    return Reply(ctx, s.ok() ? alloc_->Drain(req->name(), req->release()) : s);
  }
  grpc::ServerUnaryReactor* SetQuota(grpc::CallbackServerContext* ctx,
                                     const pb::QuotaRequest* req, pb::NoteReply* reply) override {
    absl::Status s = Admin(*ctx);
    if (s.ok()) {
      Quota q = FromProto(req->quota());
      auto note = req->user().empty() ? alloc_->SetDefaultQuota(q)
                                       : alloc_->SetQuota(req->user(), q);
      if (note.ok()) reply->set_note(*note);
      s = note.status();
    }
    return Reply(ctx, s);
  }

  // ---- users

  grpc::ServerUnaryReactor* GetQuotas(grpc::CallbackServerContext* ctx,
                                      const pb::QuotasRequest* req, pb::Quotas* reply) override {
    auto user = Whose(*ctx, req->user(), "see the quota of");
    if (!user.ok()) return Reply(ctx, user.status());
    for (const auto& q : alloc_->Quotas(*user)) ToProto(q, reply->add_quotas());
    return Reply(ctx, absl::OkStatus());
  }

  grpc::ServerUnaryReactor* ListPending(grpc::CallbackServerContext* ctx,
                                        const pb::PendingRequestsRequest* req,
                                        pb::PendingRequests* reply) override {
    auto who = Who(*ctx);
    if (!who.ok()) return Reply(ctx, who.status());
    auto user = Whose(*ctx, req->user(), "list the waiting requests of");
    if (!user.ok()) return Reply(ctx, user.status());
    for (const auto& p : alloc_->Pending(*user)) {
      if (who->Reaches(p.request.job)) ToProto(p, reply->add_pending());
    }
    return Reply(ctx, absl::OkStatus());
  }

  grpc::ServerUnaryReactor* Allocate(grpc::CallbackServerContext* ctx, const pb::Request* req,
                                     pb::Allocations* reply) override {
    auto who = Who(*ctx);
    if (!who.ok()) return Reply(ctx, who.status());
    auto* ops = new OpsReactor(this, ctx, 1);
    ops->Allocate(*who, *req, [ops, reply](const absl::StatusOr<std::vector<Allocation>>& parts) {
      if (parts.ok()) {
        for (const auto& a : *parts) ToProto(a, reply->add_allocations());
      }
      ops->set_status(parts.status());
    });
    ops->Started();
    return ops;
  }

  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx, const pb::IdRequest* req,
                                    pb::Empty*) override {
    auto who = Who(*ctx);
    if (!who.ok()) return Reply(ctx, who.status());
    auto* reactor = ctx->DefaultReactor();
    ReleaseFor(*who, req->id(), [reactor](absl::Status s) { reactor->Finish(ToGrpcStatus(s)); });
    return reactor;
  }

  // Each op as if it came alone; the call ends with the last one.
  grpc::ServerUnaryReactor* Batch(grpc::CallbackServerContext* ctx, const pb::BatchRequest* req,
                                  pb::BatchReply* reply) override {
    auto who = Who(*ctx);
    if (!who.ok()) return Reply(ctx, who.status());
    const int n = req->ops_size();
    for (int i = 0; i < n; ++i) reply->add_results();
    auto* ops = new OpsReactor(this, ctx, n);
    // Answers arrive on different threads, each to its own result.
    auto result = [reply](int i, const absl::Status& s) {
      pb::BatchResult* r = reply->mutable_results(i);
      r->set_code(static_cast<int>(s.code()));
      r->set_message(std::string(s.message()));
      return r;
    };
    for (int i = 0; i < n; ++i) {
      const pb::BatchOp& op = req->ops(i);
      if (op.has_allocate()) {
        ops->Allocate(*who, op.allocate(),
                      [result, i](const absl::StatusOr<std::vector<Allocation>>& parts) {
                        pb::BatchResult* r = result(i, parts.status());
                        if (!parts.ok()) return;
                        for (const auto& a : *parts) ToProto(a, r->add_allocations());
                      });
      } else if (op.op_case() == pb::BatchOp::kRelease) {
        ops->Release(*who, op.release(), [result, i](const absl::Status& s) { result(i, s); });
      } else {
        result(i, absl::InvalidArgumentError(absl::StrCat("batch op ", i, " is empty")));
        ops->Skip();
      }
    }
    ops->Started();
    return ops;
  }

  grpc::ServerUnaryReactor* Renew(grpc::CallbackServerContext* ctx, const pb::IdRequest* req,
                                  pb::Allocation* reply) override {
    auto who = Who(*ctx);
    absl::Status s = who.status();
    if (s.ok()) {
      auto a = alloc_->Renew(req->id(), Owner(*who, req->id(), "renew"));
      if (a.ok()) ToProto(*a, reply);
      s = a.status();
    }
    return Reply(ctx, s);
  }

  grpc::ServerUnaryReactor* ListAllocations(grpc::CallbackServerContext* ctx,
                                            const pb::AllocationsRequest* req,
                                            pb::Allocations* reply) override {
    auto who = Who(*ctx);
    if (!who.ok()) return Reply(ctx, who.status());
    std::string user = req->user();
    if (who->role != AuthRole::kAdmin) {
      if (!user.empty() && user != who->name) {
        return Reply(ctx, absl::PermissionDeniedError(absl::StrCat(
                              "user ", who->name, " cannot list the allocations of ",
                              Quoted(user))));
      }
      user = who->name;
    }
    for (const auto& a : alloc_->Allocations(user)) {
      if (who->Reaches(a.job)) ToProto(a, reply->add_allocations());
    }
    return Reply(ctx, absl::OkStatus());
  }

  grpc::ServerUnaryReactor* ListNodes(grpc::CallbackServerContext* ctx, const pb::Empty*,
                                      pb::Nodes* reply) override {
    auto who = Who(*ctx);
    if (!who.ok()) return Reply(ctx, who.status());
    for (auto& n : alloc_->Nodes()) {
      hub_.Fill(&n);
      ToProto(n, reply->add_nodes());
    }
    return Reply(ctx, absl::OkStatus());
  }

  grpc::ServerUnaryReactor* Metrics(grpc::CallbackServerContext* ctx, const pb::Empty*,
                                    pb::MetricsReply* reply) override {
    auto who = Who(*ctx);
    if (!who.ok()) return Reply(ctx, who.status());
    reply->set_text(who->role == AuthRole::kAdmin && who->job.empty()
                        ? MetricsText()
                        : OwnSeries(MetricsText(), *who));
    return Reply(ctx, absl::OkStatus());
  }

 private:
  // `text` without the series of users other than `who` (a user="..."
  // label): a user sees their own containers' usage and the nodes', as
  // ListContainers shows them only their own. A job-scoped token (an
  // admin's too) sees no user's: the series name no job, and its user's
  // other jobs, as ListContainers, are not its to see.
  static std::string OwnSeries(const std::string& text, const Identity& who) {
    const std::string own =
        who.job.empty() ? absl::StrCat("user=\"", who.name, "\"") : std::string();
    std::string out;
    for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
      const size_t brace = line.find('{');
      const absl::string_view labels =
          brace == absl::string_view::npos || line[0] == '#' ? "" : line.substr(brace);
      const size_t at = labels.find("user=\"");
      // Names are plain (ValidName), so the label's value needs no unescaping.
      if (at != absl::string_view::npos && (at == 1 || labels[at - 1] == ',') &&
          (own.empty() || labels.substr(at, own.size()) != own)) {
        continue;
      }
      absl::StrAppend(&out, line, "\n");
    }
    return out;
  }

  // Without tokens every caller is an administrator.
  absl::StatusOr<Identity> Who(const grpc::ServerContextBase& ctx) const {
    return AuthenticateCall(tokens_, ctx);
  }

  // The user whose records a view call may read: `user` for an admin ("":
  // everyone); a user reads only their own.
  absl::StatusOr<std::string> Whose(const grpc::ServerContextBase& ctx, const std::string& user,
                                    const char* what) const {
    DEEPNEX_ASSIGN_OR_RETURN(Identity who, Who(ctx));
    if (who.role == AuthRole::kAdmin) return user;
    if (!user.empty() && user != who.name) {
      return absl::PermissionDeniedError(
          absl::StrCat("user ", who.name, " cannot ", what, " ", Quoted(user)));
    }
    return who.name;
  }

  // A job's token reaches only its job, never the nodes or quotas.
  absl::Status Admin(const grpc::ServerContextBase& ctx) const {
    DEEPNEX_ASSIGN_OR_RETURN(Identity who,
                             AuthenticateCall(tokens_, ctx, "", /*require_admin=*/true));
    if (!who.job.empty()) {
      return absl::PermissionDeniedError(absl::StrCat(
          "the token of \"", who.name, "\" is for job \"", who.job,
          "\"; node and quota calls need a token without a job"));
    }
    return absl::OkStatus();
  }

  // A user may act only on their own allocations (an admin on any), and a
  // job's token only on that job's: each part that `id` names, checked by
  // the allocator as it acts (checked before, of what was durable, a grant
  // not yet durable passed, and another user's release took it; probe).
  static Allocator::Permit Owner(const Identity& who, const std::string& id, const char* what) {
    return [who, id, what](const Allocation& a) -> absl::Status {
      DEEPNEX_RETURN_IF_ERROR(CheckJob(
          who, a.job, a.id == id ? "allocation " + id : "allocation " + a.id + " of gang " + id));
      if (who.role == AuthRole::kAdmin || a.user == who.name) return absl::OkStatus();
      // Not whose: a user may not list another's allocations either.
      return absl::PermissionDeniedError(
          absl::StrCat("user ", who.name, " cannot ", what, " ", id, ": it is another user's"));
    };
  }

  // Allocate for `who` (a user allocates for themselves only). Returns the
  // allocator's ticket of a request left waiting in the queue, else 0.
  uint64_t AllocateFor(const Identity& who, const pb::Request& req, Allocator::AllocateDone done) {
    AllocateOptions options;
    auto request = FromProto(req, &options);
    if (!request.ok()) {
      done(request.status());
      return 0;
    }
    if (request->user.empty()) request->user = who.name;
    if (who.role != AuthRole::kAdmin && request->user != who.name) {
      done(absl::PermissionDeniedError(
          absl::StrCat("user ", who.name, " cannot allocate for user ", Quoted(request->user))));
      return 0;
    }
    // A job's token allocates for its job only.
    if (request->job.empty()) request->job = who.job;
    if (absl::Status s = CheckJob(who, request->job, "the request"); !s.ok()) {
      done(s);
      return 0;
    }
    return alloc_->AllocateGangAsync(
        *request, options,
        [this, done = std::move(done)](absl::StatusOr<std::vector<Allocation>> parts) {
          if (parts.ok()) {
            grants_->Add(parts->size());
          } else {
            refusals_->Add();
          }
          done(std::move(parts));
        });
  }

  void ReleaseFor(const Identity& who, const std::string& id, Allocator::Done done) {
    alloc_->ReleaseAsync(
        id,
        [this, done = std::move(done)](absl::Status s) {
          if (s.ok()) releases_->Add();
          done(s);
        },
        Owner(who, id, "release"));
  }

  const std::function<std::string()> more_metrics_;
  CentralExtension* extension_ = nullptr;
  std::unique_ptr<Allocator> alloc_;
  const TokenTable tokens_;
  agent::Hub hub_;
  // Counts calls, and holds what the ledger recovered at start.
  MetricsRegistry registry_;
  Counter* const grants_;
  Counter* const releases_;
  Counter* const refusals_;
};

void OpsReactor::Allocate(const Identity& who, const pb::Request& req, AllocateReply reply) {
  const uint64_t ticket = service_->AllocateFor(
      who, req, [this, reply = std::move(reply)](absl::StatusOr<std::vector<Allocation>> parts) {
        if (parts.ok() && cancelled()) {
          for (const auto& a : *parts) service_->allocator().ReleaseAsync(a.id, [](absl::Status) {});
          parts = absl::CancelledError("the call was cancelled; its grant is released");
        }
        reply(parts);
        OneDone();
      });
  if (ticket == 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!cancelled_) {
      tickets_.push_back(ticket);
      return;
    }
  }
  service_->allocator().Withdraw(ticket);  // OnCancel came first
}

void OpsReactor::Release(const Identity& who, const std::string& id, ReleaseReply reply) {
  service_->ReleaseFor(who, id, [this, reply = std::move(reply)](absl::Status s) {
    reply(s);
    OneDone();
  });
}

void OpsReactor::OnCancel() {
  std::vector<uint64_t> tickets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    tickets.swap(tickets_);
  }
  for (uint64_t t : tickets) service_->allocator().Withdraw(t);
}

class CentralServerImpl final : public CentralServer {
 public:
  CentralServerImpl(std::unique_ptr<Service> service, std::unique_ptr<JobStore> jobs)
      : service_(std::move(service)),
        jobs_(std::move(jobs)),
        jobs_service_(jobs_->MakeService(service_->tokens())) {}
  ~CentralServerImpl() override { Stop(); }

  absl::Status Start(const CentralServerOptions& options,
                     const CentralExtensionFactory& extension) {
    std::vector<grpc::Service*> services = {service_.get(), service_->hub().service(),
                                            jobs_service_.get()};
    if (extension) {
      DEEPNEX_ASSIGN_OR_RETURN(
          extension_, extension(service_->allocator(), service_->tokens(), service_->hub()));
      service_->SetExtension(extension_.get());
      services.push_back(extension_->service());
      for (grpc::Service* more : extension_->more_services()) services.push_back(more);
    }
    ServerHostOptions host;
    host.what = "central server";
    host.address = options.address;
    host.advertise = options.advertise;
    host.tls_cert_file = options.tls_cert_file;
    host.tls_key_file = options.tls_key_file;
    DEEPNEX_ASSIGN_OR_RETURN(host_, ServerHost::Start(host, services));
    if (!options.metrics_address.empty()) {
      DEEPNEX_ASSIGN_OR_RETURN(
          metrics_, MetricsHttpServer::Create(
                        [this] { return service_->MetricsText(); }, options.metrics_address,
                        nullptr, [this](const std::string& authorization) {
                          // Every user's series: an admin's alone, and not a
                          // job's (a user reads their own with `deepnex metrics`).
                          DEEPNEX_ASSIGN_OR_RETURN(
                              Identity who,
                              AuthenticateHttp(service_->tokens(), authorization,
                                               "an admin's token of central's --token-file",
                                               "", /*require_admin=*/true));
                          if (who.job.empty()) return absl::OkStatus();
                          return absl::PermissionDeniedError(absl::StrCat(
                              "the token of ", Quoted(who.name), " is for job ", Quoted(who.job),
                              "; /metrics carries every job's series: it needs an admin's "
                              "token without a job"));
                        }));
    }
    return absl::OkStatus();
  }

  void StartWatchingJobs() { jobs_->StartWatching(); }

  int metrics_port() const override { return metrics_ ? metrics_->port() : 0; }
  std::string address() const override { return host_->address(); }
  int port() const override { return host_->port(); }
  Allocator& allocator() override { return service_->allocator(); }
  std::string MetricsText() const override { return service_->MetricsText(); }

  void Stop() override {
    if (InForkedChild()) return;  // the parent's server (see ServerHost::Stop)
    std::call_once(stop_once_, [this] {
      // First: the containers on agents' nodes run on without central, and
      // their watchers (in the extension) wake up.
      service_->hub().Shutdown();
      if (extension_) extension_->Shutdown();
      if (metrics_) metrics_->Stop();
      // Waiting allocations fail with Cancelled and finish their calls
      // before gRPC shuts down (which waits for every open call).
      service_->allocator().Shutdown();
      if (host_) host_->Stop();
    });
  }

  void Wait() override { host_->Wait(); }

 private:
  std::unique_ptr<Service> service_;
  std::unique_ptr<JobStore> jobs_;  // releases through service_'s allocator
  std::unique_ptr<grpc::Service> jobs_service_;
  // After service_: it uses the service's allocator and tokens.
  std::unique_ptr<CentralExtension> extension_;
  std::unique_ptr<MetricsHttpServer> metrics_;
  std::unique_ptr<ServerHost> host_;
  std::once_flag stop_once_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CentralServer>> CentralServer::Create(
    const CentralServerOptions& options) {
  return CreateCentralServer(options, nullptr);
}

absl::StatusOr<std::unique_ptr<CentralServer>> CreateCentralServer(
    const CentralServerOptions& options, const CentralExtensionFactory& extension) {
  if (options.address.empty()) return absl::InvalidArgumentError("address is empty");
  DEEPNEX_RETURN_IF_ERROR(ValidateAdvertiseHost("advertise", options.advertise));
  DEEPNEX_ASSIGN_OR_RETURN(TokenTable tokens,
                           TokenTable::FromOptions(options.token, options.token_file));
  if (!options.token.empty()) {
    // A single token is the administrator's.
    tokens = TokenTable::Single(options.token, "admin", AuthRole::kAdmin);
  }
  DEEPNEX_RETURN_IF_ERROR(CheckMillis(options.node_timeout, "node_timeout"));
  DEEPNEX_RETURN_IF_ERROR(CheckMillis(options.node_lost_after, "node_lost_after"));
  if (options.node_lost_after < options.node_timeout) {
    return absl::InvalidArgumentError(
        absl::StrCat("node_lost_after=", options.node_lost_after.count(),
                     "ms must be at least node_timeout=", options.node_timeout.count(), "ms"));
  }
  DEEPNEX_RETURN_IF_ERROR(CheckMillis(options.agent_heartbeat, "agent_heartbeat"));
  DEEPNEX_ASSIGN_OR_RETURN(auto alloc, Allocator::Create(options.allocator));
  agent::HubOptions hub;
  hub.node_timeout = options.node_timeout;
  hub.node_lost_after = options.node_lost_after;
  hub.heartbeat = options.agent_heartbeat;
  hub.on_node_state = options.on_node_state;
  JobStoreOptions jobs;
  if (!options.allocator.state_dir.empty()) jobs.dir = options.allocator.state_dir + "/jobs";
  jobs.fsync = options.allocator.fsync;
  jobs.history = options.job_history;
  jobs.on_event = options.on_job_event;
  jobs.check_notify_url = options.check_job_notify_url;
  DEEPNEX_ASSIGN_OR_RETURN(auto job_store, JobStore::Open(jobs, *alloc));
  auto server = std::make_unique<CentralServerImpl>(
      std::make_unique<Service>(std::move(alloc), std::move(tokens), hub, options.more_metrics),
      std::move(job_store));
  DEEPNEX_RETURN_IF_ERROR(server->Start(options, extension));
  server->StartWatchingJobs();
  return std::unique_ptr<CentralServer>(std::move(server));
}

}  // namespace deepnex::gpu
