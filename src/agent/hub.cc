// The Agents service: one callback reactor per agent stream, so that a
// thousand agents hold no thread each; a monitor thread turns silence into
// NotReady and, later, lost containers.
#include "agent/hub.h"

#include <algorithm>
#include <iostream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "agent/report.h"
#include "core/grpc_stream.h"
#include "core/grpc_util.h"
#include "core/net.h"
#include "gpu/central_convert.h"
#include "launch/util.h"

namespace deepnex::agent {

namespace pb = ::deepnex::agent::proto;

// One agent's stream. Reads run one at a time on gRPC's threads; Send may be
// called from any thread. Deletes itself once gRPC is done with it.
class Stream final : public QueuedServerStream<pb::AgentMessage, pb::CentralMessage> {
 public:
  Stream(Hub* hub, absl::StatusOr<Identity> who) : hub_(hub) {
    if (!who.ok()) {
      Close(who.status());
      return;
    }
    // A user (not an admin, not a node) never acts as a node, nor does a
    // job's token, an admin's included: it makes no node change.
    if (who->role == AuthRole::kUser || !who->job.empty()) {
      Close(absl::PermissionDeniedError(absl::StrCat(
          who->job.empty() ? "user " : "the token of job " + who->job + " (",
          who->name, who->job.empty() ? "" : ")",
          " cannot register a node: it needs a node token (\"TOKEN NAME node\")")));
      return;
    }
    who_ = *who;
    bool stopping;
    {
      std::lock_guard<std::mutex> lock(hub_->mu_);
      stopping = hub_->stopping_;
      if (!stopping) hub_->streams_[this] = true;
    }
    if (stopping) {
      Close(absl::UnavailableError("deepnex-central is stopping"));
      return;
    }
    StartRead(&in_);
  }

  const std::string& node() const { return node_; }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Close(absl::OkStatus());
      return;
    }
    absl::Status s = Handle(in_);
    if (!s.ok()) {
      Close(s);
      return;
    }
    ReadUnlessClosed(&in_);
  }

  void OnCancel() override { Close(absl::CancelledError("the agent went away")); }

  void OnDone() override {
    hub_->OnGone(this);
    delete this;
  }

 private:
  absl::Status Handle(const pb::AgentMessage& m) {
    switch (m.msg_case()) {
      case pb::AgentMessage::kRegister: {
        if (!node_.empty()) {
          return absl::InvalidArgumentError(
              absl::StrCat("node ", node_, " registered twice on one stream"));
        }
        DEEPNEX_RETURN_IF_ERROR(hub_->OnRegister(this, who_, m.register_()));
        node_ = m.register_().node().name();
        return absl::OkStatus();
      }
      case pb::AgentMessage::kHeartbeat:
      case pb::AgentMessage::kReply:
        if (node_.empty()) {
          return absl::FailedPreconditionError("an agent's first message must be Register");
        }
        if (m.has_heartbeat()) {
          hub_->OnHeartbeat(this, m.heartbeat());
        } else {
          hub_->OnReply(this, m.reply());
        }
        return absl::OkStatus();
      default:
        return absl::InvalidArgumentError("empty agent message");
    }
  }

  Hub* const hub_;
  Identity who_;
  std::string node_;  // set by Register, on the read thread
  pb::AgentMessage in_;
};

grpc::ServerBidiReactor<pb::AgentMessage, pb::CentralMessage>* Hub::Service::Connect(
    grpc::CallbackServerContext* ctx) {
  return new Stream(hub_, AuthenticateCall(hub_->tokens_, *ctx, "", false, /*allow_node=*/true));
}

Hub::Hub(gpu::Allocator& alloc, const TokenTable& tokens, const HubOptions& options)
    : alloc_(alloc), tokens_(tokens), options_(options) {
  // The agents a previous central knew get node_timeout from now to come back.
  const auto now = std::chrono::steady_clock::now();
  for (const auto& n : alloc_.Nodes()) {
    if (n.node.labels.count(kAgentLabel) != 0) links_[n.node.name].heard = now;
  }
  monitor_ = std::thread([this] { Monitor(); });
}

Hub::~Hub() {
  Shutdown();
  // Streams delete themselves once the server has finished them.
}

void Hub::Shutdown() {
  {
    // Streams are closed under mu_: OnGone (which takes it) runs before a
    // stream is deleted, so none in streams_ is gone yet.
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& [s, unused] : streams_) {
      s->Close(absl::UnavailableError("deepnex-central is stopping"));
    }
    for (auto& [id, p] : pending_) p->done = true;
    cv_.notify_all();
  }
  if (monitor_.joinable()) monitor_.join();
}

bool Hub::HasAgent(const std::string& node) const {
  std::lock_guard<std::mutex> lock(mu_);
  return links_.count(node) != 0;
}

std::string Hub::Backend(const std::string& node) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = links_.find(node);
  return it == links_.end() ? "" : it->second.backend;
}

absl::StatusOr<pb::Reply> Hub::Call(const std::string& node, pb::Command command,
                                    std::chrono::milliseconds timeout) {
  Pending p;
  p.node = node;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock<std::mutex> lock(mu_);
  // An agent away within its node's grace (central restarted, or the agent
  // redials) is waited for, within the call's timeout: a job started just
  // after central's restart failed at once on a node granted to it (a new
  // user's probe). One past its grace (NotReady) fails now.
  auto away = [&] {
    auto it = links_.find(node);
    return it != links_.end() && it->second.stream == nullptr && it->second.ready && !stopping_;
  };
  while (away() && cv_.wait_until(lock, deadline) != std::cv_status::timeout) {
  }
  auto it = links_.find(node);
  if (it == links_.end() || it->second.stream == nullptr || stopping_) {
    return absl::UnavailableError(
        absl::StrCat("node ", node, ": its deepnex-agent is not connected"));
  }
  const uint64_t id = ++next_id_;
  command.set_id(id);
  pb::CentralMessage m;
  *m.mutable_command() = std::move(command);
  p.stream = it->second.stream;
  if (!it->second.stream->Send(std::move(m))) {
    return absl::UnavailableError(
        absl::StrCat("node ", node, ": its deepnex-agent is disconnecting"));
  }
  pending_[id] = &p;
  const bool answered = cv_.wait_until(lock, deadline, [&] { return p.done; });
  pending_.erase(id);
  if (!answered) {
    return absl::DeadlineExceededError(absl::StrCat(
        "node ", node, ": its deepnex-agent did not answer within ", timeout.count(), "ms"));
  }
  if (!p.reply.id()) {
    return absl::UnavailableError(
        absl::StrCat("node ", node, ": its deepnex-agent went away before it answered"));
  }
  if (p.reply.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(p.reply.code()),
                        absl::StrCat("node ", node, ": ", p.reply.message()));
  }
  return std::move(p.reply);
}

std::optional<pb::ContainerReport> Hub::Report(const std::string& node,
                                               const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = links_.find(node);
  if (it == links_.end()) return std::nullopt;
  auto c = it->second.containers.find(name);
  if (c == it->second.containers.end()) return std::nullopt;
  return c->second;
}

void Hub::Forget(const std::string& node, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = links_.find(node);
  if (it == links_.end()) return;
  it->second.containers.erase(name);
  it->second.forgotten.insert(name);
}

std::optional<pb::ContainerReport> Hub::WaitReport(
    const std::string& node, const std::string& name,
    const std::function<bool(const pb::ContainerReport&)>& done,
    std::chrono::milliseconds timeout) {
  std::optional<pb::ContainerReport> latest;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] {
    latest.reset();
    auto it = links_.find(node);
    if (it != links_.end()) {
      auto c = it->second.containers.find(name);
      if (c != it->second.containers.end()) latest = c->second;
    }
    return stopping_ || (latest && done(*latest));
  });
  return latest;
}

void Hub::Fill(gpu::NodeInfo* info) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = links_.find(info->node.name);
  if (it == links_.end()) return;
  info->last_heartbeat_ms = it->second.heard_ms;
  info->cpus_busy = it->second.usage.cpu_busy();
  info->memory_in_use = it->second.usage.memory_used();
  info->address = it->second.address;
  info->gpu_usage.clear();
  for (const auto& g : it->second.usage.gpus()) info->gpu_usage.push_back(gpu::FromProto(g));
}

std::string Hub::MetricsText(const std::function<void(MetricsRegistry&)>& more) const {
  MetricsRegistry now;
  const auto t = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  for (const auto& [node, link] : links_) {
    now.GetGauge("deepnex_node_ready", "1 while the node's agent is heard from, else 0.",
                 {{"node", node}})
        ->Set(link.ready ? 1 : 0);
    now.GetGauge("deepnex_node_heartbeat_age_seconds",
                 "Seconds since the node's agent was last heard from.", {{"node", node}})
        ->Set(std::chrono::duration<double>(t - link.heard).count());
    now.GetGauge("deepnex_node_cpus_busy", "Cores busy on the node, as its agent measures.",
                 {{"node", node}})
        ->Set(link.usage.cpu_busy());
    now.GetGauge("deepnex_node_memory_in_use_bytes",
                 "Memory in use on the node, as its agent measures.", {{"node", node}})
        ->Set(link.usage.memory_used());
    // Per GPU where the agent has NVML; none for made-up (--gpus) GPUs.
    for (const auto& g : link.usage.gpus()) {
      const Labels gpu{{"node", node}, {"gpu", std::to_string(g.index())}};
      now.GetGauge("deepnex_gpu_memory_in_use_bytes",
                   "GPU memory in use (every process's), as the node's agent measures.", gpu)
          ->Set(g.memory_used());
      // A ratio, Prometheus' base unit (NVML's is percent).
      now.GetGauge("deepnex_gpu_utilization_ratio",
                   "Share of time (0-1) a kernel ran on the GPU, as the node's agent measures.",
                   gpu)
          ->Set(g.utilization() / 100.0);
    }
    // Per container, as its agent last reported it, with its user.
    for (const auto& [name, c] : link.containers) {
      if (!Ended(c)) launch::ExportContainerUsage(now, node, c.user(), name, UsageOf(c));
    }
  }
  // Outside the hub's lock: `more` reads cgroups, and takes its own
  // locks, which are held where the hub is called.
  lock.unlock();
  if (more) more(now);
  return registry_.PrometheusText() + now.PrometheusText();
}

absl::Status Hub::OnRegister(Stream* s, const Identity& who, const pb::Register& reg) {
  const std::string& name = reg.node().name();
  if (who.role == AuthRole::kNode && who.name != name) {
    return absl::PermissionDeniedError(absl::StrCat("the token of node ", who.name,
                                                    " cannot act as node ", name));
  }
  if (!reg.address().empty()) {
    DEEPNEX_RETURN_IF_ERROR(ValidateAdvertiseHost("address", reg.address()));
  }
  DEEPNEX_ASSIGN_OR_RETURN(gpu::Node node, gpu::FromProto(reg.node()));
  node.labels[kAgentLabel] = "true";
  // A node an admin declared (or an earlier registration left in the
  // ledger) keeps what central holds for it.
  if (!alloc_.GetNode(name).ok()) {
    absl::Status added = alloc_.AddNode(node);
    if (!added.ok()) {
      return absl::Status(added.code(),
                          absl::StrCat("registering node ", name, ": ", added.message()));
    }
  }
  bool was_not_ready = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Link& link = links_[name];
    if (link.stream != nullptr && link.stream != s) {
      // Under mu_, so that it is not deleted meanwhile (see Shutdown).
      // AlreadyExists, which an agent takes as a refusal and exits on: a
      // connection is replaced only by another agent process (a restarted
      // one, or a second one given the same --node), never by the same
      // agent, which dials again only once its stream has ended. Two
      // agents redialling on Aborted took the node from each other for
      // ever.
      link.stream->Close(absl::AlreadyExistsError(absl::StrCat(
          "node ", name, ": replaced by a newer connection of an agent for node ", name,
          " (another deepnex-agent registered as this node)")));
      // Now, not once gRPC is done with the old stream: over a connection
      // a partition cut, that may take minutes.
      FailPendingLocked(link.stream);
    }
    link.stream = s;
    link.backend = reg.backend();
    link.address = reg.address();
    // What the agent reports now replaces what it reported before. A run
    // it no longer reports (restarted on another state directory, or its
    // records lost) is gone from its view: it counts as lost, so that its
    // waiters see it end and its grant goes back, instead of "starting" for
    // ever. One that had ended keeps its end.
    std::map<std::string, pb::ContainerReport> before = std::move(link.containers);
    link.containers.clear();
    link.forgotten.clear();
    for (const auto& c : reg.containers()) link.containers[c.name()] = c;
    for (auto& [name, c] : before) {
      if (link.containers.count(name) != 0) continue;
      if (!Ended(c)) {
        c.set_state("exited");
        c.set_has_exit(true);
        c.set_exit_reason("lost");
      }
      link.containers[name] = std::move(c);
    }
    was_not_ready = HeardLocked(link);
    cv_.notify_all();
  }
  std::cerr << "deepnex-central: node " << name << " registered by its agent ("
            << reg.node().gpus_size() << " GPUs, " << reg.containers_size()
            << " container(s) running)\n";
  if (was_not_ready) {
    SetReady(name, true, "its agent registered again");
  } else if (options_.on_node_state) {
    // Ready already, maybe only as a restarted central's start: the
    // notifier tells it when the admins last heard NotReady or lost.
    options_.on_node_state(name, "ready", "its agent registered again");
  }
  if (on_registered_) {
    on_registered_(name, std::vector<pb::ContainerReport>(reg.containers().begin(),
                                                          reg.containers().end()));
  }
  pb::CentralMessage m;
  m.mutable_registered()->set_heartbeat_ms(
      std::min(options_.heartbeat, options_.node_timeout / 3).count());
  s->Send(std::move(m));
  return absl::OkStatus();
}

bool Hub::HeardLocked(Link& link) {
  link.heard = std::chrono::steady_clock::now();
  link.heard_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  link.lost = false;
  return !link.ready;
}

void Hub::OnHeartbeat(Stream* s, const pb::Heartbeat& hb) {
  bool was_not_ready = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(s->node());
    if (it == links_.end() || it->second.stream != s) return;  // replaced
    // Merged, not replaced: a heartbeat built just before a start's reply
    // was written can arrive after it, without the new container. What the
    // agent no longer runs at all is settled when it registers.
    Link& link = it->second;
    std::set<std::string> forgotten;
    for (const auto& c : hb.containers()) {
      if (link.forgotten.count(c.name()) != 0) {
        forgotten.insert(c.name());
      } else {
        link.containers[c.name()] = c;
      }
    }
    // One no longer reported was removed before this heartbeat was built.
    link.forgotten = std::move(forgotten);
    link.usage = hb.usage();
    was_not_ready = HeardLocked(it->second);
    cv_.notify_all();
  }
  if (was_not_ready) SetReady(s->node(), true, "its agent is heard from again");
}

void Hub::OnReply(Stream* s, const pb::Reply& reply) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(reply.id());
  // A reply to another node's command is not this agent's to give.
  if (it == pending_.end() || it->second->node != s->node()) return;
  it->second->reply = reply;
  it->second->reply.set_id(reply.id() == 0 ? 1 : reply.id());
  it->second->done = true;
  auto link = links_.find(s->node());
  if (link != links_.end() && reply.has_container()) {
    link->second.forgotten.erase(reply.container().name());
    link->second.containers[reply.container().name()] = reply.container();
  }
  cv_.notify_all();
}

void Hub::OnGone(Stream* s) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.erase(s);
  for (auto& [node, link] : links_) {
    if (link.stream == s) link.stream = nullptr;
  }
  FailPendingLocked(s);
}

void Hub::FailPendingLocked(Stream* s) {
  // Its unanswered commands fail now rather than at their deadline, even
  // with a newer stream of the agent in place: one sent into a partition
  // never reached the agent, so none answers it, and a caller (a job's log
  // follower) would wait the whole deadline for nothing.
  for (auto& [id, p] : pending_) {
    if (p->stream == s) p->done = true;
  }
  cv_.notify_all();
}

void Hub::SetReady(const std::string& node, bool ready, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(node);
    if (it == links_.end() || it->second.ready == ready) return;
    it->second.ready = ready;
    cv_.notify_all();  // a Call waiting for its agent gives up
  }
  absl::Status s = alloc_.SetNodeReady(node, ready);
  std::cerr << "deepnex-central: node " << node << " is " << (ready ? "Ready" : "NotReady")
            << ": " << why << (s.ok() ? "" : absl::StrCat(" (", s.message(), ")")) << "\n";
  if (options_.on_node_state) options_.on_node_state(node, ready ? "ready" : "not_ready", why);
  if (!ready) {
    registry_
        .GetCounter("deepnex_node_not_ready_total",
                    "Times a node turned NotReady (its agent not heard from).", {{"node", node}})
        ->Add();
  }
}

void Hub::Monitor() {
  const auto tick = std::clamp<std::chrono::milliseconds>(options_.node_timeout / 5,
                                                          std::chrono::milliseconds(20),
                                                          std::chrono::milliseconds(1000));
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, tick, [this] { return stopping_; })) {
    const auto now = std::chrono::steady_clock::now();
    std::vector<std::pair<std::string, double>> silent;
    std::vector<std::string> lost;
    for (auto& [node, link] : links_) {
      const auto quiet = now - link.heard;
      if (link.ready && quiet > options_.node_timeout) {
        silent.emplace_back(node, std::chrono::duration<double>(quiet).count());
      }
      if (!link.lost && quiet > options_.node_lost_after) {
        // What ran there counts as lost: whoever waits for it sees it end.
        link.lost = true;
        for (auto& [name, c] : link.containers) {
          if (c.state() == "stopped" || c.state() == "exited") continue;
          c.set_state("exited");
          c.set_has_exit(true);
          c.set_exit_reason("lost");
        }
        cv_.notify_all();
        std::cerr << "deepnex-central: node " << node << " is lost: its containers count as lost\n";
        lost.push_back(node);
      }
    }
    lock.unlock();
    for (const auto& [node, quiet] : silent) {
      SetReady(node, false, absl::StrFormat("no heartbeat for %.1fs", quiet));
    }
    for (const std::string& node : lost) {
      if (options_.on_node_state) {
        options_.on_node_state(
            node, "lost",
            absl::StrFormat("no heartbeat for %.0fs: its containers count as lost",
                            std::chrono::duration<double>(options_.node_lost_after).count()));
      }
    }
    lock.lock();
  }
}

}  // namespace deepnex::agent
