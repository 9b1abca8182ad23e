// deepnex-agent's library: a connection loop (one stream to central at a
// time, redialled with backoff), a heartbeat thread, and a thread per
// command, since a Start or a Stop with a grace period may block.
#include "deepnex/agent/agent.h"

#include <unistd.h>

#include <condition_variable>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "agent/adopt.h"
#include "agent/report.h"
#include "agent/session.h"
#include "core/grpc_util.h"
#include "core/net.h"
#include "deepnex/agent.grpc.pb.h"
#include "deepnex/auth.h"
#include "deepnex/gpu/discovery.h"
#include "deepnex/metrics.h"
#include "deepnex/units.h"
#include "gpu/central_convert.h"
#include "launch/central_wire.h"
#include "launch/spec.h"
#include "launch/util.h"

namespace deepnex::agent {
namespace {

namespace pb = ::deepnex::agent::proto;

constexpr std::chrono::milliseconds kFirstBackoff{100};
constexpr std::chrono::milliseconds kMaxBackoff{2000};
constexpr uint64_t kMaxLogChunk = 1 << 20;
constexpr std::chrono::milliseconds kStopGrace{1000};
constexpr std::chrono::milliseconds kFinalReportWait{2000};
constexpr int kMaxGpus = 1024;
// How long the stream to central may go without an answered ping. Central
// learns of a lost agent by heartbeat silence, but the agent would learn of
// a lost central only from a reset, which a partition never delivers: its
// stream would wait for good, and /healthz say healthy. Pinging every 2 s
// (answered within 2 s) notices a partition within about 4 s, under
// central's default --node-timeout of 10 s.
constexpr std::chrono::milliseconds kKeepalive{2000};

bool Refusal(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAUTHENTICATED ||
         code == grpc::StatusCode::PERMISSION_DENIED ||
         code == grpc::StatusCode::INVALID_ARGUMENT || code == grpc::StatusCode::ALREADY_EXISTS;
}

class AgentImpl final : public Agent {
 public:
  AgentImpl(const AgentOptions& options, gpu::Node node, std::string address,
            std::string token, TokenTable metrics_tokens,
            std::unique_ptr<launch::Launcher> launcher,
            std::vector<std::shared_ptr<launch::Handle>> adopted)
      : options_(options), node_(std::move(node)), address_(std::move(address)),
        token_(std::move(token)), metrics_tokens_(std::move(metrics_tokens)),
        launcher_(std::move(launcher)) {
    for (auto& h : adopted) adopted_[h->spec().name] = h;
  }
  ~AgentImpl() override { Stop(); }

  absl::Status Start() {
    DEEPNEX_RETURN_IF_ERROR(CheckForkSafe("deepnex-agent"));
    DEEPNEX_ASSIGN_OR_RETURN(auto credentials, MakeChannelCredentials(options_.tls_ca_file));
    auto channel = MakeChannel(options_.central, credentials, kKeepalive);
    stub_ = pb::Agents::NewStub(channel);
    sessions_ = std::make_unique<AgentSessions>(channel, token_);
    if (!options_.listen.empty()) {
      auto http = MetricsHttpServer::Create(
          [this] { return MetricsText(); }, options_.listen, [this] { return Health(); },
          [this](const std::string& authorization) { return AuthorizeMetrics(authorization); });
      if (!http.ok()) {
        return absl::Status(http.status().code(),
                            absl::StrCat("listen: ", http.status().message()));
      }
      http_ = std::move(*http);
    }
    started_ = true;
    for (auto& [name, h] : adopted_) Watch(h);
    loop_ = std::thread([this] { Loop(); });
    beat_ = std::thread([this] { Beat(); });
    return absl::OkStatus();
  }

  const gpu::Node& node() const override { return node_; }
  const std::string& address() const override { return address_; }

  std::string http_address() const override {
    if (http_ == nullptr) return "";
    const std::string host = HostOf(options_.listen);
    return JoinHostPort(IsWildcardHost(host) ? address_ : host, http_->port());
  }

  absl::Status WaitRegistered(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [this] { return registered_ || done_; })) {
      return absl::DeadlineExceededError(absl::StrCat(
          "node ", node_.name, ": deepnex-central at ", options_.central,
          " did not accept the agent within ", timeout.count(), "ms"));
    }
    return registered_ ? absl::OkStatus() : final_;
  }

  void Stop() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return;
      stopped_ = true;
    }
    // Kept past the cancel below, which ends a write central does not read.
    std::future<bool> report;
    if (started_) report = StopContainersAndReport();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!done_) {
        done_ = true;
        final_ = absl::OkStatus();
      }
      if (ctx_) ctx_->TryCancel();
      cv_.notify_all();
    }
    if (http_ != nullptr) http_->Stop();
    if (loop_.joinable()) loop_.join();
    if (beat_.joinable()) beat_.join();
    if (sessions_) sessions_->Stop();
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return commands_ == 0; });
    }
    // An agent that failed to start took nothing over: what it adopted runs
    // on for the next one.
    if (!started_) return;
    // StopContainersAndReport stopped every container, adopted ones
    // included; this stops any a command started since.
    launcher_.reset();
    for (auto& w : watchers_) w.join();
  }

  absl::Status Wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    return final_;
  }

 private:
  // Dials, registers and serves commands until the stream breaks; again
  // until Stop or a refusal.
  void Loop() {
    std::chrono::milliseconds backoff = kFirstBackoff;
    while (true) {
      auto ctx = std::make_shared<grpc::ClientContext>();
      if (!token_.empty()) ctx->AddMetadata(kAuthorizationKey, BearerValue(token_));
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (done_) return;
        ctx_ = ctx;
      }
      auto stream = stub_->Connect(ctx.get());
      {
        std::lock_guard<std::mutex> lock(write_mu_);
        stream_ = stream.get();
      }
      pb::AgentMessage hello;
      pb::Register* reg = hello.mutable_register_();
      gpu::ToProto(node_, reg->mutable_node());
      reg->set_backend(launcher_->backend());
      reg->set_address(address_);
      for (auto& h : Containers()) *reg->add_containers() = ReportOf(*h);
      Write(hello);
      pb::CentralMessage in;
      while (stream->Read(&in)) {
        if (in.has_registered()) {
          std::lock_guard<std::mutex> lock(mu_);
          registered_ = true;
          heartbeat_ = std::chrono::milliseconds(std::max<int64_t>(10, in.registered().heartbeat_ms()));
          kicked_ = true;  // Beat waits on the old interval: wake it
          backoff = kFirstBackoff;
          last_failure_.clear();
          cv_.notify_all();
        } else if (in.has_command()) {
          Dispatch(in.command());
        }
      }
      {
        std::lock_guard<std::mutex> lock(write_mu_);
        stream_ = nullptr;
      }
      grpc::Status status = stream->Finish();
      std::unique_lock<std::mutex> lock(mu_);
      registered_ = false;
      if (done_) return;
      if (Refusal(status.error_code())) {
        done_ = true;
        final_ = ToAbslStatus(status);
        cv_.notify_all();
        return;
      }
      // Once per kind of failure, not once per redial.
      if (status.error_message() != last_failure_) {
        last_failure_ = status.error_message();
        std::cerr << "deepnex-agent: node " << node_.name << ": the stream to deepnex-central at "
                  << options_.central << " ended (" << last_failure_ << "); dialling again\n";
      }
      cv_.wait_for(lock, backoff, [this] { return done_; });
      backoff = std::min(backoff * 2, kMaxBackoff);
    }
  }

  // On an orderly stop (SIGTERM), the containers end first and central
  // hears how, on the stream still open: it showed them running and held
  // their allocations until the node was lost, 300 s later (probe). The
  // report waits at most kFinalReportWait for a central that does not read;
  // the caller's cancel of the stream then ends it.
  std::future<bool> StopContainersAndReport() {
    std::vector<std::thread> stops;
    for (auto& h : Containers()) {
      stops.emplace_back([h] { h->Stop(kStopGrace).IgnoreError(); });
    }
    for (auto& t : stops) t.join();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!registered_) return {};
    }
    std::future<bool> sent = std::async(std::launch::async,
                                        [this, m = HeartbeatMessage()] { return Write(m); });
    sent.wait_for(kFinalReportWait);
    return sent;
  }

  // A heartbeat reporting every container (set even with none).
  pb::AgentMessage HeartbeatMessage() {
    pb::AgentMessage m;
    pb::Heartbeat* beat = m.mutable_heartbeat();
    for (auto& h : Containers()) *beat->add_containers() = ReportOf(*h);
    return m;
  }

  // Every heartbeat interval, and at once when a container ended.
  void Beat() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!done_) {
      cv_.wait_for(lock, heartbeat_, [this] { return done_ || kicked_; });
      kicked_ = false;
      if (done_) return;
      if (!registered_) continue;
      lock.unlock();
      pb::AgentMessage m = HeartbeatMessage();
      pb::Heartbeat* beat = m.mutable_heartbeat();
      MeasureNode(beat->mutable_usage());
      Write(m);
      lock.lock();
      usage_ = beat->usage();
    }
  }

  // /healthz: healthy while central has accepted the agent on the stream
  // open now, as kubelet's is while it can reach its API server; else why
  // not, with the stream's last error (e.g. "keepalive watchdog timeout"
  // behind a partition).
  absl::Status Health() {
    std::lock_guard<std::mutex> lock(mu_);
    if (registered_) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat(
        "node ", node_.name, ": not registered with deepnex-central at ", options_.central,
        last_failure_.empty() ? "" : " (", last_failure_, last_failure_.empty() ? "" : ")"));
  }

  // Who may read /metrics (AgentOptions::metrics_token_file).
  absl::Status AuthorizeMetrics(const std::string& authorization) const {
    if (metrics_tokens_.enabled()) {
      return AuthenticateHttp(metrics_tokens_, authorization,
                              "a token of the agent's --metrics-token-file", "",
                              /*require_admin=*/false, /*allow_node=*/true)
          .status();
    }
    if (token_.empty()) return absl::OkStatus();  // central without tokens
    return absl::PermissionDeniedError(
        "this agent was started without --metrics-token-file: its /metrics names every "
        "user's containers, and no token may read it");
  }

  // /metrics: the node's usage as the last heartbeat measured it, and each
  // live container's now (the names central exports per node).
  std::string MetricsText() {
    MetricsRegistry now;
    const Labels node{{"node", node_.name}};
    {
      std::lock_guard<std::mutex> lock(mu_);
      now.GetGauge("deepnex_agent_registered",
                   "1 while deepnex-central has accepted this agent, else 0.", node)
          ->Set(registered_ ? 1 : 0);
      now.GetGauge("deepnex_node_cpus_busy", "Cores busy on the node.", node)
          ->Set(usage_.cpu_busy());
      now.GetGauge("deepnex_node_memory_in_use_bytes", "Memory in use on the node.", node)
          ->Set(static_cast<double>(usage_.memory_used()));
    }
    for (auto& h : Containers()) {
      const pb::ContainerReport r = ReportOf(*h);
      if (Ended(r)) continue;
      launch::ExportContainerUsage(now, node_.name, r.user(), r.name(), UsageOf(r));
    }
    return now.PrometheusText();
  }

  // The node's busy cores since the last call (from /proc/stat) and memory
  // in use (from /proc/meminfo), and its GPUs' through NVML. Called from
  // Beat only.
  void MeasureNode(pb::NodeUsage* u) {
    std::ifstream stat("/proc/stat");
    std::string cpu;
    uint64_t v = 0, total = 0, idle = 0;
    stat >> cpu;
    for (int i = 0; i < 8 && stat >> v; ++i) {
      total += v;
      if (i == 3 || i == 4) idle += v;  // idle, iowait
    }
    const auto now = std::chrono::steady_clock::now();
    if (cpu_total_ > 0 && total > cpu_total_) {
      const double busy = static_cast<double>((total - cpu_total_) - (idle - cpu_idle_)) /
                          static_cast<double>(sysconf(_SC_CLK_TCK));
      u->set_cpu_busy(busy / std::chrono::duration<double>(now - cpu_at_).count());
    }
    cpu_total_ = total;
    cpu_idle_ = idle;
    cpu_at_ = now;
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    uint64_t kib = 0, mem_total = 0, available = 0;
    std::string unit;
    while (meminfo >> key >> kib) {
      std::getline(meminfo, unit);
      if (key == "MemTotal:") mem_total = kib;
      if (key == "MemAvailable:") available = kib;
    }
    if (mem_total >= available) u->set_memory_used((mem_total - available) << 10);
    // --gpus GPUs are made up: NVML's figures would be another GPU's.
    if (!options_.gpus) {
      for (const gpu::GpuUsage& g : gpu::MeasureLocalGpus()) gpu::ToProto(g, u->add_gpus());
    }
  }

  // The launcher's containers and those adopted from the agent before.
  std::vector<std::shared_ptr<launch::Handle>> Containers() {
    std::vector<std::shared_ptr<launch::Handle>> all = launcher_->List();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [name, h] : adopted_) all.push_back(h);
    return all;
  }

  absl::StatusOr<std::shared_ptr<launch::Handle>> Get(const std::string& name) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = adopted_.find(name);
      if (it != adopted_.end()) return it->second;
    }
    return launcher_->Get(name);
  }

  // Its end is told at once, not at the next heartbeat.
  void Watch(std::shared_ptr<launch::Handle> h) {
    std::lock_guard<std::mutex> lock(mu_);
    watchers_.emplace_back([this, h] {
      h->Wait(std::chrono::hours(24 * 365 * 10)).IgnoreError();
      std::lock_guard<std::mutex> lock(mu_);
      kicked_ = true;
      cv_.notify_all();
    });
  }

  bool Write(const pb::AgentMessage& m) {
    std::lock_guard<std::mutex> lock(write_mu_);
    return stream_ != nullptr && stream_->Write(m);
  }

  void Dispatch(const pb::Command& command) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++commands_;
    }
    std::thread([this, command] {
      pb::AgentMessage m;
      pb::Reply* reply = m.mutable_reply();
      absl::Status s = Execute(command, reply);
      reply->set_id(command.id());
      reply->set_code(static_cast<int>(s.code()));
      reply->set_message(std::string(s.message()));
      Write(m);
      std::lock_guard<std::mutex> lock(mu_);
      --commands_;
      cv_.notify_all();
    }).detach();
  }

  absl::Status Execute(const pb::Command& c, pb::Reply* reply) {
    switch (c.op_case()) {
      case pb::Command::kStart: {
        DEEPNEX_ASSIGN_OR_RETURN(launch::ContainerSpec spec,
                                 launch::SpecFromProto(c.start().spec()));
        // A user's container runs as the uid central maps them to; run as
        // the agent's own (root), it would own the node.
        if (!c.start().has_run_as()) {
          return absl::PermissionDeniedError(absl::StrCat(
              "container \"", spec.name,
              "\" came without the uid to run it as; deepnex-agent never runs a container "
              "as its own"));
        }
        const pb::RunAs& r = c.start().run_as();
        spec.run_as = launch::RunAs{r.uid(), r.gid(), r.user(), r.home()};
        if (c.start().has_allocation()) {
          spec.allocation = gpu::FromProto(c.start().allocation());
          spec.user = spec.allocation->user;
          if (spec.allocation->node != node_.name) {
            return absl::InvalidArgumentError(
                absl::StrCat("allocation ", spec.allocation->id, " is on node ",
                             spec.allocation->node, ", not on node ", node_.name));
          }
        }
        // Central's mount roots, checked here where the paths are (this
        // node's launcher has none, and took any host path).
        const auto& roots = c.start().allowed_mount_roots();
        DEEPNEX_RETURN_IF_ERROR(
            launch::CheckMounts(std::vector<std::string>(roots.begin(), roots.end()), spec));
        // A run's end that a restart follows is told at once too, so that
        // central's record (and a job following it) sees each run's exit.
        spec.on_restart = [this](const launch::RestartEvent&) {
          std::lock_guard<std::mutex> lock(mu_);
          kicked_ = true;
          cv_.notify_all();
        };
        DEEPNEX_ASSIGN_OR_RETURN(auto h, launcher_->Start(spec));
        *reply->mutable_container() = ReportOf(*h, /*usage=*/false);
        Watch(h);
        return absl::OkStatus();
      }
      case pb::Command::kStop: {
        DEEPNEX_ASSIGN_OR_RETURN(auto h, Get(c.stop().name()));
        DEEPNEX_RETURN_IF_ERROR(
            h->Stop(std::chrono::milliseconds(std::max<int64_t>(0, c.stop().grace_ms()))));
        *reply->mutable_container() = ReportOf(*h);
        return absl::OkStatus();
      }
      case pb::Command::kLogs: {
        DEEPNEX_ASSIGN_OR_RETURN(auto h, Get(c.logs().name()));
        DEEPNEX_ASSIGN_OR_RETURN(
            launch::LogChunk chunk,
            h->ReadLogs(c.logs().offset(), std::min(c.logs().max_bytes(), kMaxLogChunk)));
        reply->set_data(std::move(chunk.data));
        reply->set_next_offset(chunk.next_offset);
        reply->set_ended(chunk.ended);
        return absl::OkStatus();
      }
      case pb::Command::kRemove: {
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (adopted_.erase(c.remove().name()) != 0) return absl::OkStatus();
        }
        absl::Status s = launcher_->Remove(c.remove().name());
        return absl::IsNotFound(s) ? absl::OkStatus() : s;
      }
      case pb::Command::kSession: {
        if (c.session().end()) {
          sessions_->End(c.session().session_id());
          return absl::OkStatus();
        }
        DEEPNEX_ASSIGN_OR_RETURN(auto h, Get(c.session().name()));
        return sessions_->Start(h, launcher_->backend(), c.session().session_id());
      }
      case pb::Command::kCommit: {
        DEEPNEX_ASSIGN_OR_RETURN(auto h, Get(c.commit().name()));
        DEEPNEX_ASSIGN_OR_RETURN(uint64_t size, h->Commit(c.commit().image()));
        reply->set_size(size);
        return absl::OkStatus();
      }
      default:
        return absl::InvalidArgumentError("empty command");
    }
  }

  const AgentOptions options_;
  const gpu::Node node_;
  const std::string address_;
  const std::string token_;
  const TokenTable metrics_tokens_;
  std::unique_ptr<launch::Launcher> launcher_;
  std::unique_ptr<pb::Agents::Stub> stub_;
  std::unique_ptr<AgentSessions> sessions_;  // set by Start

  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<grpc::ClientContext> ctx_;  // of the stream open now
  bool registered_ = false;
  bool kicked_ = false;
  bool done_ = false;
  bool stopped_ = false;
  bool started_ = false;  // set by Start before its threads
  std::string last_failure_;  // the stream's last error, logged once
  absl::Status final_;
  std::chrono::milliseconds heartbeat_{2000};
  int commands_ = 0;
  std::vector<std::thread> watchers_;
  std::map<std::string, std::shared_ptr<launch::Handle>> adopted_;
  // MeasureNode's last /proc/stat reading.
  uint64_t cpu_total_ = 0, cpu_idle_ = 0;
  std::chrono::steady_clock::time_point cpu_at_;
  pb::NodeUsage usage_;  // the last heartbeat's, for /metrics

  std::unique_ptr<MetricsHttpServer> http_;  // --listen's, or none

  std::mutex write_mu_;  // one writer at a time on the stream
  grpc::ClientReaderWriter<pb::AgentMessage, pb::CentralMessage>* stream_ = nullptr;

  std::thread loop_;
  std::thread beat_;
};

}  // namespace

absl::StatusOr<std::vector<gpu::Gpu>> ParseGpus(const std::string& text,
                                               const std::string& field) {
  if (text == "0") return std::vector<gpu::Gpu>{};
  const size_t x = text.find('x');
  int count = 0;
  if (x == std::string::npos || !absl::SimpleAtoi(text.substr(0, x), &count) || count < 1 ||
      count > kMaxGpus) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": \"", text, "\" is not NxSIZE with N from 1 to ", kMaxGpus, " (e.g. 2x16GiB)"));
  }
  DEEPNEX_ASSIGN_OR_RETURN(uint64_t memory, ParseByteSize(text.substr(x + 1), field));
  if (memory == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": \"", text, "\": a GPU needs memory"));
  }
  std::vector<gpu::Gpu> gpus(count);
  for (auto& g : gpus) g.memory = memory;
  return gpus;
}

absl::StatusOr<std::unique_ptr<Agent>> Agent::Create(const AgentOptions& options) {
  DEEPNEX_RETURN_IF_ERROR(ValidateAddress("central address", options.central));
  if (options.node.empty()) return absl::InvalidArgumentError("node: the node needs a name");
  DEEPNEX_ASSIGN_OR_RETURN(std::string token,
                           ResolveClientToken(options.token, options.token_file));
  TokenTable metrics_tokens;
  if (!options.metrics_token_file.empty()) {
    auto table = TokenTable::FromFile(options.metrics_token_file);
    if (!table.ok()) {
      return absl::Status(table.status().code(),
                          absl::StrCat("metrics token file: ", table.status().message()));
    }
    metrics_tokens = std::move(*table);
  }
  gpu::Node node;
  node.name = options.node;
  node.gpus = options.gpus ? *options.gpus : gpu::DiscoverLocalGpus().gpus;
  node.cpus = options.cpus;
  if (node.cpus == 0) node.cpus = static_cast<int>(std::thread::hardware_concurrency());
  node.memory = options.memory;
  if (node.memory == 0) {
    node.memory = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                  static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  }
  if (node.cpus < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cpus: ", options.cpus, " is negative"));
  }
  node.labels = options.labels;
  std::string address = options.advertise;
  if (address.empty()) {
    address = PrimaryAddress(HostOf(options.central));
  } else {
    DEEPNEX_RETURN_IF_ERROR(ValidateAdvertiseHost("advertise", address));
  }
  // Other users' containers: never without their limits and device rules.
  launch::LauncherOptions launcher_options = options.launcher;
  launcher_options.require_cgroups = true;
  DEEPNEX_ASSIGN_OR_RETURN(auto launcher, launch::Launcher::Create(launcher_options));
  // A killed agent before this one stopped nothing: its containers run on.
  std::vector<std::shared_ptr<launch::Handle>> adopted;
  adopted = AdoptOrphans(options.launcher, launcher->id());
  auto agent = std::make_unique<AgentImpl>(options, std::move(node), std::move(address),
                                           std::move(token), std::move(metrics_tokens),
                                           std::move(launcher),
                                           std::move(adopted));
  DEEPNEX_RETURN_IF_ERROR(agent->Start());
  return std::unique_ptr<Agent>(std::move(agent));
}

}  // namespace deepnex::agent
