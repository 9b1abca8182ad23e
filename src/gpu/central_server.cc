// deepnex-central's service: the Allocator behind token auth, on gRPC's
// callback API. Calls that may wait in the allocator's queue run on a thread
// of their own, so a waiting request holds no gRPC thread; every other call
// runs inline (it waits at most for its ledger fsync).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/grpc_util.h"
#include "deepnex/auth.h"
#include "deepnex/central.grpc.pb.h"
#include "deepnex/gpu/central.h"
#include "gpu/central_convert.h"
#include "gpu/central_server.h"

namespace deepnex::gpu {
namespace {

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

class Service final : public pb::Central::CallbackService {
 public:
  // `offload`: run grants and releases on threads of their own, so that
  // calls waiting for the ledger's fsync hold no gRPC thread and concurrent
  // calls share fsyncs (group commit).
  Service(std::unique_ptr<Allocator> alloc, TokenTable tokens, bool offload)
      : alloc_(std::move(alloc)), tokens_(std::move(tokens)), offload_(offload) {}

  Allocator& allocator() { return *alloc_; }
  const TokenTable& tokens() const { return tokens_; }

  // Waits for the threads of waiting Allocate calls; the allocator's
  // destructor (after this) fails any that still wait.
  void Shutdown() {
    std::unique_lock<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.wait(lock, [this] { return waiting_ == 0; });
  }

  std::string MetricsText() const {
    std::string out;
    auto gauge = [&](const char* name, const char* help) {
      absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " gauge\n");
    };
    std::vector<NodeInfo> nodes = alloc_->Nodes();
    gauge("deepnex_gpu_memory_allocated_bytes", "GPU memory granted, per GPU.");
    for (const auto& n : nodes) {
      for (size_t i = 0; i < n.node.gpus.size(); ++i) {
        absl::StrAppend(&out, "deepnex_gpu_memory_allocated_bytes{node=\"", n.node.name,
                        "\",gpu=\"", n.node.gpus[i].index, "\",mode=\"", ModeName(n.mode),
                        "\"} ", n.gpu_memory_used[i], "\n");
      }
    }
    gauge("deepnex_gpu_memory_free_bytes", "GPU memory not granted, per GPU.");
    for (const auto& n : nodes) {
      for (size_t i = 0; i < n.node.gpus.size(); ++i) {
        absl::StrAppend(&out, "deepnex_gpu_memory_free_bytes{node=\"", n.node.name, "\",gpu=\"",
                        n.node.gpus[i].index, "\",mode=\"", ModeName(n.mode), "\"} ",
                        n.node.gpus[i].memory - n.gpu_memory_used[i], "\n");
      }
    }
    gauge("deepnex_node_gpus", "GPUs per node by mode and state (used: holding an allocation).");
    for (const auto& n : nodes) {
      int free = n.gpus_free();
      absl::StrAppend(&out, "deepnex_node_gpus{node=\"", n.node.name, "\",mode=\"",
                      ModeName(n.mode), "\",state=\"used\"} ",
                      static_cast<int>(n.node.gpus.size()) - free, "\n");
      absl::StrAppend(&out, "deepnex_node_gpus{node=\"", n.node.name, "\",mode=\"",
                      ModeName(n.mode), "\",state=\"free\"} ", free, "\n");
    }
    gauge("deepnex_queue_length", "Requests waiting for capacity.");
    absl::StrAppend(&out, "deepnex_queue_length ", alloc_->QueueLength(), "\n");
    auto counter = [&](const char* name, const char* help, uint64_t v) {
      absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " counter\n", name,
                      " ", v, "\n");
    };
    counter("deepnex_grants_total", "Allocations granted.", grants_.load());
    counter("deepnex_releases_total", "Release calls that succeeded.", releases_.load());
    counter("deepnex_refusals_total", "Allocate calls refused (quota, capacity, bad input).",
            refusals_.load());
    return out;
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

  grpc::ServerUnaryReactor* Allocate(grpc::CallbackServerContext* ctx, const pb::Request* req,
                                     pb::Allocations* reply) override {
    auto who = Who(*ctx);
    if (!who.ok()) return Reply(ctx, who.status());
    AllocateOptions options;
    auto request = FromProto(*req, &options);
    if (!request.ok()) return Reply(ctx, request.status());
    if (request->user.empty()) request->user = who->name;
    if (who->role != AuthRole::kAdmin && request->user != who->name) {
      return Reply(ctx, absl::PermissionDeniedError(
                            absl::StrCat("user ", who->name, " cannot allocate for user ",
                                         request->user)));
    }
    if (!options.wait && !offload_) {
      return Reply(ctx, Grant(*request, options, reply));
    }
    return Offload(ctx, [this, r = *request, options, reply] { return Grant(r, options, reply); });
  }

  // Runs `fn` on a thread of its own and finishes the call with its status.
  template <class Fn>
  grpc::ServerUnaryReactor* Offload(grpc::CallbackServerContext* ctx, Fn fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return Reply(ctx, absl::UnavailableError("deepnex-central is stopping"));
      ++waiting_;
    }
    auto* reactor = ctx->DefaultReactor();
    std::thread([this, reactor, fn = std::move(fn)]() mutable {
      absl::Status s = fn();
      reactor->Finish(ToGrpcStatus(s));
      std::lock_guard<std::mutex> lock(mu_);
      --waiting_;
      cv_.notify_all();
    }).detach();
    return reactor;
  }

  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx, const pb::IdRequest* req,
                                    pb::Empty*) override {
    absl::Status s = Owner(*ctx, req->id(), "release");
    if (!s.ok()) return Reply(ctx, s);
    auto release = [this, id = req->id()] {
      absl::Status r = alloc_->Release(id);
      if (r.ok()) ++releases_;
      return r;
    };
    return offload_ ? Offload(ctx, release) : Reply(ctx, release());
  }

  grpc::ServerUnaryReactor* Renew(grpc::CallbackServerContext* ctx, const pb::IdRequest* req,
                                  pb::Allocation* reply) override {
    absl::Status s = Owner(*ctx, req->id(), "renew");
    if (s.ok()) {
      auto a = alloc_->Renew(req->id());
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
                              "user ", who->name, " cannot list the allocations of ", user)));
      }
      user = who->name;
    }
    for (const auto& a : alloc_->Allocations(user)) ToProto(a, reply->add_allocations());
    return Reply(ctx, absl::OkStatus());
  }

  grpc::ServerUnaryReactor* ListNodes(grpc::CallbackServerContext* ctx, const pb::Empty*,
                                      pb::Nodes* reply) override {
    auto who = Who(*ctx);
    if (!who.ok()) return Reply(ctx, who.status());
    for (const auto& n : alloc_->Nodes()) ToProto(n, reply->add_nodes());
    return Reply(ctx, absl::OkStatus());
  }

  grpc::ServerUnaryReactor* Metrics(grpc::CallbackServerContext* ctx, const pb::Empty*,
                                    pb::MetricsReply* reply) override {
    auto who = Who(*ctx);
    if (!who.ok()) return Reply(ctx, who.status());
    reply->set_text(MetricsText());
    return Reply(ctx, absl::OkStatus());
  }

 private:
  // Without tokens every caller is an administrator.
  absl::StatusOr<Identity> Who(const grpc::ServerContextBase& ctx) const {
    return AuthenticateCall(tokens_, ctx);
  }

  absl::Status Admin(const grpc::ServerContextBase& ctx) const {
    return AuthenticateCall(tokens_, ctx, "", /*require_admin=*/true).status();
  }

  // A user may act only on their own allocations (an admin on any).
  absl::Status Owner(const grpc::ServerContextBase& ctx, const std::string& id,
                     const char* what) const {
    DEEPNEX_ASSIGN_OR_RETURN(Identity who, Who(ctx));
    if (who.role == AuthRole::kAdmin) return absl::OkStatus();
    auto a = alloc_->GetAllocation(id);
    if (a.ok() && a->user != who.name) {
      return absl::PermissionDeniedError(absl::StrCat("user ", who.name, " cannot ", what, " ",
                                                      id, ": it belongs to ", a->user));
    }
    // A gang id: every part must be the caller's.
    if (!a.ok() && !id.empty() && id[0] == 'g') {
      for (const auto& x : alloc_->Allocations()) {
        if (x.gang == id && x.user != who.name) {
          return absl::PermissionDeniedError(absl::StrCat(
              "user ", who.name, " cannot ", what, " ", id, ": it belongs to ", x.user));
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Grant(const Request& r, const AllocateOptions& o, pb::Allocations* reply) {
    auto parts = alloc_->AllocateGang(r, o);
    if (!parts.ok()) {
      ++refusals_;
      return parts.status();
    }
    grants_ += parts->size();
    for (const auto& a : *parts) ToProto(a, reply->add_allocations());
    return absl::OkStatus();
  }

  std::unique_ptr<Allocator> alloc_;
  const TokenTable tokens_;
  const bool offload_;
  std::atomic<uint64_t> grants_{0}, releases_{0}, refusals_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  int waiting_ = 0;
  bool stopping_ = false;
};

// GET /metrics over HTTP/1.1 (one request per connection) on a thread of
// its own, for Prometheus scrapers.
class MetricsHttp {
 public:
  explicit MetricsHttp(std::function<std::string()> text) : text_(std::move(text)) {}
  ~MetricsHttp() { Stop(); }

  absl::Status Start(const std::string& address) {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics_address \"", address, "\": expected HOST:PORT"));
    }
    std::string host = address.substr(0, colon);
    if (host == "localhost") host = "127.0.0.1";
    if (host.empty() || host == "*") host = "0.0.0.0";
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    int port = 0;
    try {
      port = std::stoi(address.substr(colon + 1));
    } catch (...) {
      port = -1;
    }
    if (port < 0 || port > 65535 || inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics_address \"", address, "\": expected IPv4HOST:PORT"));
    }
    addr.sin_port = htons(static_cast<uint16_t>(port));
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (fd_ < 0 || bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        listen(fd_, 16) != 0) {
      return absl::UnavailableError(absl::StrCat("metrics: cannot listen on \"", address, "\""));
    }
    socklen_t len = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Run(); });
    return absl::OkStatus();
  }
  int port() const { return port_; }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  void Run() {
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      int c = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      timeval tv{2, 0};
      setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      std::string req;
      char buf[2048];
      while (req.find("\r\n\r\n") == std::string::npos && req.size() < 16384) {
        ssize_t n = recv(c, buf, sizeof(buf), 0);
        if (n <= 0) break;
        req.append(buf, static_cast<size_t>(n));
      }
      std::string body, status = "200 OK";
      if (req.rfind("GET /metrics", 0) == 0) {
        body = text_();
      } else {
        status = "404 Not Found";
        body = "GET /metrics\n";
      }
      std::string resp = absl::StrCat("HTTP/1.1 ", status,
                                      "\r\nContent-Type: text/plain; version=0.0.4\r\n"
                                      "Content-Length: ", body.size(),
                                      "\r\nConnection: close\r\n\r\n", body);
      const char* q = resp.data();
      size_t left = resp.size();
      while (left > 0) {
        ssize_t w = send(c, q, left, MSG_NOSIGNAL);
        if (w <= 0) break;
        q += w;
        left -= static_cast<size_t>(w);
      }
      close(c);
    }
  }

  std::function<std::string()> text_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class CentralServerImpl final : public CentralServer {
 public:
  explicit CentralServerImpl(std::unique_ptr<Service> service) : service_(std::move(service)) {}
  ~CentralServerImpl() override { Stop(); }

  absl::Status Start(const CentralServerOptions& options,
                     const CentralExtensionFactory& extension) {
    DEEPNEX_ASSIGN_OR_RETURN(auto credentials,
                             MakeServerCredentials(options.tls_cert_file, options.tls_key_file));
    grpc::ServerBuilder builder;
    builder.AddListeningPort(options.address, credentials, &port_);
    builder.RegisterService(service_.get());
    if (extension) {
      DEEPNEX_ASSIGN_OR_RETURN(extension_,
                               extension(service_->allocator(), service_->tokens()));
      builder.RegisterService(extension_->service());
    }
    server_ = builder.BuildAndStart();
    if (!server_ || port_ == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on \"", options.address, "\""));
    }
    host_ = options.address.substr(0, options.address.rfind(':'));
    if (!options.metrics_address.empty()) {
      metrics_ = std::make_unique<MetricsHttp>([this] { return service_->MetricsText(); });
      DEEPNEX_RETURN_IF_ERROR(metrics_->Start(options.metrics_address));
    }
    return absl::OkStatus();
  }

  int metrics_port() const override { return metrics_ ? metrics_->port() : 0; }
  std::string address() const override { return absl::StrCat(host_, ":", port_); }
  int port() const override { return port_; }
  Allocator& allocator() override { return service_->allocator(); }
  std::string MetricsText() const override { return service_->MetricsText(); }

  void Stop() override {
    std::call_once(stop_once_, [this] {
      if (extension_) extension_->Shutdown();
      if (metrics_) metrics_->Stop();
      // Waiting allocations fail with Cancelled and finish their calls
      // before gRPC shuts down (which waits for every open call).
      service_->allocator().Shutdown();
      service_->Shutdown();
      if (server_) {
        server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
        server_->Wait();
      }
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
  std::unique_ptr<Service> service_;
  // After service_: it uses the service's allocator and tokens.
  std::unique_ptr<CentralExtension> extension_;
  std::unique_ptr<MetricsHttp> metrics_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string host_;
  std::once_flag stop_once_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopped_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CentralServer>> CentralServer::Create(
    const CentralServerOptions& options) {
  return CreateCentralServer(options, nullptr);
}

absl::StatusOr<std::unique_ptr<CentralServer>> CreateCentralServer(
    const CentralServerOptions& options, const CentralExtensionFactory& extension) {
  if (options.address.empty()) return absl::InvalidArgumentError("address is empty");
  DEEPNEX_ASSIGN_OR_RETURN(TokenTable tokens,
                           TokenTable::FromOptions(options.token, options.token_file));
  if (!options.token.empty()) {
    // A single token is the administrator's.
    tokens = TokenTable::Single(options.token, "admin", AuthRole::kAdmin);
  }
  DEEPNEX_ASSIGN_OR_RETURN(auto alloc, Allocator::Create(options.allocator));
  auto server = std::make_unique<CentralServerImpl>(
      std::make_unique<Service>(std::move(alloc), std::move(tokens),
                                /*offload=*/!options.allocator.state_dir.empty()));
  DEEPNEX_RETURN_IF_ERROR(server->Start(options, extension));
  return std::unique_ptr<CentralServer>(std::move(server));
}

}  // namespace deepnex::gpu
