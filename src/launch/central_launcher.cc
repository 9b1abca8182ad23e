// The "central" backend: a Launcher whose containers deepnex-central starts,
// each on its allocation's node through that node's deepnex-agent (or on
// central's own machine for a node without one). Status, exits and
// restarts come from central's records, polled; logs are read through
// central by offset.
//
// Restarts run where the container runs (the agent's supervisor), so that
// each stays on the container's allocation: central releases an allocation
// once its container ended for good, and a restart started from here would
// find it gone. Only a lost node (its containers end "lost") is handled
// here: the container is started again on a new allocation of the same
// shape, which central grants on a Ready node (a silent node takes no new
// grant).
#include <algorithm>
#include <csignal>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/random.h"
#include "deepnex/gpu/central.h"
#include "deepnex/launch/central.h"
#include "deepnex/units.h"
#include "launch/backend.h"
#include "launch/util.h"

namespace deepnex::launch {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// Reads of an ended container's log that may fail in a row before its
// follower gives up on the rest.
constexpr int kLogTries = 10;
// How long a container lost with its node waits for a new allocation.
constexpr std::chrono::milliseconds kReplaceWait{10000};

bool Ended(State s) { return s == State::kExited || s == State::kStopped; }

// The inverse of ExitStatus::ToString ("exited(3)", "signaled(SIGKILL)",
// "oom_killed", "lost", each maybe with " after N restarts"); anything else
// reads as lost: central said it ended, not how.
ExitStatus ParseExit(std::string text) {
  ExitStatus e;
  e.reason = ExitReason::kLost;
  const size_t after = text.find(" after ");
  if (after != std::string::npos) {
    // " after N restart(s)"
    absl::string_view n = absl::string_view(text).substr(after + 7);
    n = n.substr(0, n.find(' '));
    if (!absl::SimpleAtoi(n, &e.restarts)) e.restarts = 0;
    text.resize(after);
  }
  absl::string_view v = text;
  if (absl::ConsumePrefix(&v, "exited(") && absl::ConsumeSuffix(&v, ")") &&
      absl::SimpleAtoi(v, &e.code)) {
    e.reason = ExitReason::kExited;
  } else if (absl::ConsumePrefix(&v, "signaled(") && absl::ConsumeSuffix(&v, ")")) {
    for (int sig = 1; sig < NSIG; ++sig) {
      if (SignalName(sig) == v) {
        e.reason = ExitReason::kSignaled;
        e.signal = sig;
      }
    }
  } else if (text == ExitReasonName(ExitReason::kOomKilled)) {
    e.reason = ExitReason::kOomKilled;
    e.signal = SIGKILL;
  }
  return e;
}

// What the launcher's handles share: the clients of central's two services.
struct Central {
  CentralOptions options;
  std::unique_ptr<CentralClient> containers;
  std::unique_ptr<gpu::CentralClient> allocator;
};

// One container through central. Its record is read at most once per
// `poll`; a read also takes the decisions (restart events, a new
// allocation after a lost node). Thread-safe.
class CentralHandle final : public Handle {
 public:
  CentralHandle(std::shared_ptr<Central> central, ContainerSpec spec, CentralContainer first)
      : central_(std::move(central)), spec_(std::move(spec)), allocation_(*spec_.allocation),
        record_(std::move(first)) {}

  const ContainerSpec& spec() const override { return spec_; }

  ContainerStatus Status() override {
    std::lock_guard<std::mutex> lock(mu_);
    RefreshLocked();
    ContainerStatus st;
    st.name = spec_.name;
    st.id = record_.id;
    st.state = record_.state;
    st.restarts = base_restarts_ + record_.restarts;
    if (!record_.last_exit.empty()) {
      st.last_exit = ParseExit(record_.last_exit);
      st.last_exit->restarts += base_restarts_;
    }
    st.started_at = record_.started_at;
    return st;
  }

  absl::StatusOr<ExitStatus> Wait(milliseconds timeout) override {
    const auto deadline = Clock::now() + CappedWait(timeout);
    for (;;) {
      ContainerStatus st = Status();
      if (Ended(st.state)) {
        ExitStatus e = st.last_exit.value_or(ExitStatus{ExitReason::kLost});
        e.restarts = st.restarts;
        return e;
      }
      if (Clock::now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "container \"", spec_.name, "\" on node ", node(), " still runs after ",
            timeout.count(), "ms"));
      }
      std::this_thread::sleep_for(central_->options.poll);
    }
  }

  absl::Status Stop(milliseconds grace) override {
    grace = CappedWait(grace);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      // Central refuses nothing for an ended one, but a lost node's agent
      // cannot be asked.
      if (Ended(record_.state) && !Replaceable()) return absl::OkStatus();
    }
    absl::StatusOr<CentralContainer> c =
        central_->containers->StopContainer(spec_.name, grace);
    std::lock_guard<std::mutex> lock(mu_);
    if (c.ok()) {
      record_ = *std::move(c);
      read_at_ = Clock::now();
    }
    return c.status();
  }

  absl::StatusOr<std::string> Logs() override {
    std::string all;
    uint64_t offset = 0;
    for (;;) {
      DEEPNEX_ASSIGN_OR_RETURN(LogChunk chunk, central_->containers->ContainerLogs(spec_.name, offset));
      if (chunk.data.empty()) return all;
      all += chunk.data;
      offset = chunk.next_offset;
    }
  }

  absl::StatusOr<LogChunk> ReadLogs(uint64_t offset, uint64_t max_bytes) override {
    DEEPNEX_ASSIGN_OR_RETURN(LogChunk chunk,
                             central_->containers->ContainerLogs(spec_.name, offset));
    if (chunk.data.size() > max_bytes) {
      chunk.next_offset -= chunk.data.size() - max_bytes;
      chunk.data.resize(max_bytes);
      chunk.ended = false;
    }
    return chunk;
  }

  // Follows the current container's log; after a lost node, the log of the
  // container started in its place from its start (what the lost node held
  // is gone with it).
  absl::Status FollowLogs(const std::function<bool(const std::string&)>& sink) override {
    uint64_t offset = 0;
    FollowedLog followed(sink);
    int failures = 0;  // reads in a row that failed
    int generation = Generation();
    for (;;) {
      absl::StatusOr<LogChunk> chunk = central_->containers->ContainerLogs(spec_.name, offset);
      if (Generation() != generation) {
        generation = Generation();
        offset = 0;
        continue;
      }
      if (!chunk.ok()) {
        // Its node does not answer: it comes back, or its container ends
        // lost (and may be started elsewhere). The log of one that ended
        // otherwise is still there: a few more tries for its rest.
        ContainerStatus st = Status();
        if (Generation() != generation) continue;
        const bool lost = st.last_exit && st.last_exit->reason == ExitReason::kLost;
        if (StopAsked() || (Ended(st.state) && (lost || ++failures > kLogTries))) {
          return absl::OkStatus();
        }
        std::this_thread::sleep_for(central_->options.poll * 2);
        continue;
      }
      failures = 0;
      if (!followed.Take(offset, *chunk)) return absl::OkStatus();
      offset = chunk->next_offset;
      if (chunk->ended) return absl::OkStatus();
      if (chunk->data.empty()) std::this_thread::sleep_for(central_->options.poll * 2);
    }
  }

  absl::StatusOr<launch::Usage> Usage() override {
    std::lock_guard<std::mutex> lock(mu_);
    RefreshLocked();
    return record_.usage;
  }

  std::string node() {
    std::lock_guard<std::mutex> lock(mu_);
    return allocation_.node;
  }

  // Stop was asked, or no replacement is to come.
  bool StopAsked() {
    std::lock_guard<std::mutex> lock(mu_);
    return stopping_;
  }

 private:
  int Generation() {
    std::lock_guard<std::mutex> lock(mu_);
    return generation_;
  }

  // The container ended lost with its node, and its restart policy has a
  // restart left.
  bool Replaceable() const {
    if (stopping_ || record_.state != State::kExited) return false;
    if (ParseExit(record_.last_exit).reason != ExitReason::kLost) return false;
    const RestartPolicy& p = spec_.restart;
    const int done = base_restarts_ + record_.restarts;
    return p.kind != RestartPolicy::Kind::kNever && (p.max_restarts < 0 || done < p.max_restarts);
  }

  void RefreshLocked() {
    if (Clock::now() - read_at_ < central_->options.poll) return;
    absl::StatusOr<std::vector<CentralContainer>> all = central_->containers->ListContainers();
    read_at_ = Clock::now();
    // Central unreachable: the last record stands.
    if (!all.ok()) return;
    for (CentralContainer& c : *all) {
      if (c.name != spec_.name) continue;
      // The restarts the node's supervisor decided since the last read, told
      // as the launcher tells its own: a restarting record holds the exit of
      // the run before it (the agent reports each such end at once), which
      // counts the restarts before that run; the count itself goes up while
      // the record still says restarting.
      const int decided =
          c.state == State::kRestarting
              ? std::max(c.restarts, ParseExit(c.last_exit).restarts + 1)
              : c.restarts;
      for (; told_ < decided; ++told_) Tell(ParseExit(c.last_exit), base_restarts_ + told_ + 1);
      record_ = std::move(c);
      break;
    }
    if (Replaceable()) Replace();
  }

  void Tell(const ExitStatus& exit, int restart) {
    if (!spec_.on_restart) return;
    RestartEvent e;
    e.name = spec_.name;
    e.exit = exit;
    e.restart = restart;
    e.max_restarts = spec_.restart.max_restarts;
    spec_.on_restart(e);
  }

  // Starts the container again on a new allocation shaped as the lost one;
  // if none is granted within kReplaceWait (the handle's callers wait with
  // it), the lost record stands and the container has ended for good.
  void Replace() {
    const int restart = base_restarts_ + record_.restarts + 1;
    const ExitStatus lost = ParseExit(record_.last_exit);
    gpu::Request r;
    r.user = allocation_.user;
    r.job = allocation_.job;
    r.gpus = static_cast<int>(allocation_.gpus.size());
    if (!allocation_.gpus.empty() && !allocation_.gpus[0].exclusive) {
      r.mode = gpu::Mode::kShared;
      r.gpu_memory = allocation_.gpus[0].memory;
    }
    r.cpus = allocation_.cpus;
    r.memory = allocation_.memory;
    // Queued for a while: the node that would take it may be NotReady for a
    // moment (a loaded machine delays heartbeats).
    gpu::AllocateOptions queued;
    queued.wait = true;
    queued.timeout = kReplaceWait;
    // Central releases a lost container's allocation itself; this is for
    // one whose release has not come yet.
    central_->allocator->Release(allocation_.id).IgnoreError();
    absl::StatusOr<gpu::Allocation> a = central_->allocator->Allocate(r, queued);
    if (!a.ok()) {
      // Tried once: the container stays ended lost.
      stopping_ = true;
      return;
    }
    ContainerSpec remote = spec_;
    remote.allocation.reset();
    if (remote.restart.max_restarts >= 0) remote.restart.max_restarts -= restart;
    absl::StatusOr<CentralContainer> c = central_->containers->StartContainer(remote, a->id);
    if (!c.ok()) {
      central_->allocator->Release(a->id).IgnoreError();
      stopping_ = true;
      return;
    }
    Tell(lost, restart);
    base_restarts_ = restart;
    told_ = 0;
    allocation_ = *std::move(a);
    record_ = *std::move(c);
    ++generation_;
  }

  const std::shared_ptr<Central> central_;
  ContainerSpec spec_;
  std::mutex mu_;
  gpu::Allocation allocation_;   // the current container's
  CentralContainer record_;      // central's latest
  Clock::time_point read_at_{};  // of record_
  int base_restarts_ = 0;        // restarts of the containers before this one
  int told_ = 0;                 // this container's restarts told to on_restart
  int generation_ = 0;           // containers started in place of lost ones
  bool stopping_ = false;        // Stop was asked, or no replacement is to come
};

class CentralLauncher final : public Launcher {
 public:
  CentralLauncher(std::string id, std::shared_ptr<Central> central)
      : id_(std::move(id)), central_(std::move(central)) {}

  // Stops those not asked to stop yet: one asked is central's to stop (a
  // job's stop left one to its unreachable node, and this waited for that
  // node again).
  ~CentralLauncher() override {
    for (auto& h : List()) {
      auto& c = static_cast<CentralHandle&>(*h);
      if (!c.StopAsked()) c.Stop(milliseconds(1000)).IgnoreError();
    }
  }

  std::string backend() const override { return backend_; }
  const std::string& id() const override { return id_; }

  absl::StatusOr<std::shared_ptr<Handle>> Start(const ContainerSpec& spec) override {
    if (!spec.allocation) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.allocation: container \"", spec.name,
          "\" has none; the central backend starts containers on allocations of deepnex-central"));
    }
    ContainerSpec remote = spec;
    remote.allocation.reset();
    DEEPNEX_ASSIGN_OR_RETURN(CentralContainer c,
                             central_->containers->StartContainer(remote, spec.allocation->id));
    auto h = std::make_shared<CentralHandle>(central_, spec, std::move(c));
    std::lock_guard<std::mutex> lock(mu_);
    handles_[spec.name] = h;
    return h;
  }

  std::vector<std::shared_ptr<Handle>> List() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<Handle>> out;
    for (auto& [name, h] : handles_) out.push_back(h);
    return out;
  }

  absl::StatusOr<std::shared_ptr<Handle>> Get(const std::string& name) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handles_.find(name);
    if (it == handles_.end()) {
      return absl::NotFoundError(absl::StrCat("no container \"", name, "\" in launcher ", id_));
    }
    return it->second;
  }

  // Central keeps the record until the name is used again.
  absl::Status Remove(const std::string& name) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (handles_.erase(name) == 0) {
      return absl::NotFoundError(absl::StrCat("no container \"", name, "\" in launcher ", id_));
    }
    return absl::OkStatus();
  }

  // deepnex-central and its agents sweep what a crashed one left.
  absl::StatusOr<int> Cleanup(const std::string&) override { return 0; }

  // Central's nodes with an agent: those it places containers on.
  absl::StatusOr<std::vector<gpu::Node>> Nodes() override {
    DEEPNEX_ASSIGN_OR_RETURN(std::vector<gpu::NodeInfo> infos, central_->allocator->Nodes());
    std::vector<gpu::Node> nodes;
    for (const gpu::NodeInfo& n : infos) {
      if (n.last_heartbeat_ms != 0 || n.node.labels.count("deepnex.io/agent")) {
        nodes.push_back(n.node);
      }
    }
    return nodes;
  }

 private:
  const std::string backend_ = "central";
  const std::string id_;
  const std::shared_ptr<Central> central_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Handle>> handles_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Launcher>> MakeCentralLauncher(const LauncherOptions& options) {
  if (options.central.address.empty()) {
    return absl::InvalidArgumentError(
        "central.address: empty; the central backend needs deepnex-central's host:port");
  }
  if (options.central.poll.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("central.poll: ", options.central.poll.count(), " ms is not > 0"));
  }
  auto central = std::make_shared<Central>();
  central->options = options.central;
  gpu::CentralClientOptions co;
  co.address = options.central.address;
  co.token = options.central.token;
  co.token_file = options.central.token_file;
  co.tls_ca_file = options.central.tls_ca_file;
  DEEPNEX_ASSIGN_OR_RETURN(central->containers, CentralClient::Create(co));
  DEEPNEX_ASSIGN_OR_RETURN(central->allocator, gpu::CentralClient::Create(co));
  return std::unique_ptr<Launcher>(new CentralLauncher(
      options.id.empty() ? RandomHex(8) : options.id, std::move(central)));
}

}  // namespace deepnex::launch
