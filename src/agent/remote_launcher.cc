#include "agent/remote_launcher.h"

#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "agent/report.h"
#include "deepnex/units.h"
#include "gpu/central_convert.h"
#include "launch/central_wire.h"

namespace deepnex::agent {
namespace {

// How long a command may take on top of what it waits for itself (a
// start pulls nothing, but a busy node may be slow to fork).
constexpr std::chrono::milliseconds kCommandTimeout{30000};

class RemoteHandle final : public launch::Handle {
 public:
  RemoteHandle(Hub& hub, std::string node, launch::ContainerSpec spec)
      : hub_(hub), node_(std::move(node)), spec_(std::move(spec)) {}

  const launch::ContainerSpec& spec() const override { return spec_; }

  launch::ContainerStatus Status() override {
    auto r = hub_.Report(node_, spec_.name);
    if (r) return StatusOf(*r);
    launch::ContainerStatus st;
    st.name = spec_.name;
    return st;
  }

  absl::StatusOr<launch::ExitStatus> Wait(std::chrono::milliseconds timeout) override {
    timeout = CappedWait(timeout);
    auto r = hub_.WaitReport(node_, spec_.name, Ended, timeout);
    if (r && Ended(*r)) return ExitOf(*r);
    return absl::DeadlineExceededError(absl::StrCat("container \"", spec_.name, "\" on node ",
                                                    node_, " still runs after ",
                                                    timeout.count(), "ms"));
  }

  absl::Status Stop(std::chrono::milliseconds grace) override {
    grace = CappedWait(grace);
    proto::Command c;
    c.mutable_stop()->set_name(spec_.name);
    c.mutable_stop()->set_grace_ms(grace.count());
    return hub_.Call(node_, std::move(c), grace + kCommandTimeout).status();
  }

  absl::StatusOr<std::string> Logs() override {
    std::string all;
    uint64_t offset = 0;
    while (true) {
      DEEPNEX_ASSIGN_OR_RETURN(launch::LogChunk chunk, ReadLogs(offset, 1 << 20));
      if (chunk.data.empty()) return all;
      all += chunk.data;
      offset = chunk.next_offset;
    }
  }

  absl::StatusOr<launch::LogChunk> ReadLogs(uint64_t offset, uint64_t max_bytes) override {
    proto::Command c;
    c.mutable_logs()->set_name(spec_.name);
    c.mutable_logs()->set_offset(offset);
    c.mutable_logs()->set_max_bytes(max_bytes);
    DEEPNEX_ASSIGN_OR_RETURN(proto::Reply r, hub_.Call(node_, std::move(c), kCommandTimeout));
    return launch::LogChunk{r.data(), r.next_offset(), r.ended()};
  }

  absl::Status FollowLogs(const std::function<bool(const std::string&)>& sink) override {
    return FollowByReading(*this, sink, std::chrono::milliseconds(200));
  }

  absl::StatusOr<launch::Usage> Usage() override {
    auto r = hub_.Report(node_, spec_.name);
    if (!r) return launch::Usage{};
    return UsageOf(*r);
  }

 private:
  Hub& hub_;
  const std::string node_;
  const launch::ContainerSpec spec_;
};

class RemoteLauncher final : public launch::Launcher {
 public:
  RemoteLauncher(Hub& hub, std::string node, std::vector<std::string> allowed_mount_roots)
      : hub_(hub), node_(std::move(node)), allowed_mount_roots_(std::move(allowed_mount_roots)) {}

  // Asked each time: a launcher made while its agent was away (central
  // just restarted) kept "" for good, and `deepnex launch` printed "( PID)".
  std::string backend() const override {
    std::string backend = hub_.Backend(node_);
    return backend.empty() ? "agent" : backend;
  }
  const std::string& id() const override { return node_; }
  // Its one node is the agent's; central places on it by the allocation.
  absl::StatusOr<std::vector<gpu::Node>> Nodes() override { return std::vector<gpu::Node>{}; }

  absl::StatusOr<std::shared_ptr<launch::Handle>> Start(
      const launch::ContainerSpec& spec) override {
    proto::Command c;
    launch::SpecToProto(spec, c.mutable_start()->mutable_spec());
    if (spec.allocation) gpu::ToProto(*spec.allocation, c.mutable_start()->mutable_allocation());
    if (spec.run_as) {
      proto::RunAs* r = c.mutable_start()->mutable_run_as();
      r->set_uid(spec.run_as->uid);
      r->set_gid(spec.run_as->gid);
      r->set_user(spec.run_as->user);
      r->set_home(spec.run_as->home);
    }
    for (const std::string& root : allowed_mount_roots_) {
      c.mutable_start()->add_allowed_mount_roots(root);
    }
    DEEPNEX_RETURN_IF_ERROR(hub_.Call(node_, std::move(c), kCommandTimeout).status());
    auto h = std::make_shared<RemoteHandle>(hub_, node_, spec);
    std::lock_guard<std::mutex> lock(mu_);
    handles_[spec.name] = h;
    return h;
  }

  std::vector<std::shared_ptr<launch::Handle>> List() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<launch::Handle>> out;
    for (auto& [name, h] : handles_) out.push_back(h);
    return out;
  }

  absl::StatusOr<std::shared_ptr<launch::Handle>> Get(const std::string& name) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handles_.find(name);
    if (it == handles_.end()) {
      return absl::NotFoundError(
          absl::StrCat("container \"", name, "\" is not on node ", node_));
    }
    return it->second;
  }

  absl::Status Remove(const std::string& name) override {
    proto::Command c;
    c.mutable_remove()->set_name(name);
    DEEPNEX_RETURN_IF_ERROR(hub_.Call(node_, std::move(c), kCommandTimeout).status());
    hub_.Forget(node_, name);
    std::lock_guard<std::mutex> lock(mu_);
    handles_.erase(name);
    return absl::OkStatus();
  }

  // The agent sweeps its own node's leftovers.
  absl::StatusOr<int> Cleanup(const std::string&) override { return 0; }

 private:
  Hub& hub_;
  const std::string node_;
  const std::vector<std::string> allowed_mount_roots_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<launch::Handle>> handles_;
};

}  // namespace

std::unique_ptr<launch::Launcher> NewRemoteLauncher(
    Hub& hub, const std::string& node, const std::vector<std::string>& allowed_mount_roots) {
  return std::make_unique<RemoteLauncher>(hub, node, allowed_mount_roots);
}

std::shared_ptr<launch::Handle> NewRemoteHandle(Hub& hub, const std::string& node,
                                                const launch::ContainerSpec& spec) {
  return std::make_shared<RemoteHandle>(hub, node, spec);
}

}  // namespace deepnex::agent
