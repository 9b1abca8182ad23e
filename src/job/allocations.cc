#include "job/allocations.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "deepnex/gpu/discovery.h"

namespace deepnex::job {
namespace {

// How many of `workers` go to each of `nodes` nodes: as srun -N, as evenly as
// possible, the first ones one more.
std::vector<int> SpreadCounts(int workers, int nodes) {
  std::vector<int> counts(nodes, workers / nodes);
  for (int i = 0; i < workers % nodes; ++i) ++counts[i];
  return counts;
}

}  // namespace

gpu::CentralClientOptions CentralOptions(const JobOptions& o) {
  gpu::CentralClientOptions co;
  co.address = o.central;
  co.token = o.central_token;
  co.token_file = o.central_token_file;
  return co;
}

absl::StatusOr<std::unique_ptr<AllocationSource>> AllocationSource::Create(
    const JobOptions& o, const std::vector<gpu::Node>& nodes) {
  auto a = std::unique_ptr<AllocationSource>(new AllocationSource);
  if (o.central.empty()) {
    DEEPNEX_ASSIGN_OR_RETURN(a->local_, gpu::Allocator::Create());
    if (nodes.empty()) {
      DEEPNEX_ASSIGN_OR_RETURN(gpu::Node node, gpu::LocalNode("", o.gpu_mode));
      DEEPNEX_RETURN_IF_ERROR(a->local_->AddNode(node));
      a->local_memory_ = node.memory;
    }
    for (gpu::Node node : nodes) {
      node.mode = o.gpu_mode;
      // Slurm's GRES counts GPUs and says nothing of their memory: any
      // request's memory fits, so only the count limits here, and the
      // backend's scheduler holds the GPUs themselves.
      for (gpu::Gpu& g : node.gpus) {
        if (g.memory == 0) g.memory = uint64_t{1} << 50;
      }
      // A worker's default share is of the smallest node's memory.
      if (a->local_memory_ == 0 || node.memory < a->local_memory_) {
        a->local_memory_ = node.memory;
      }
      DEEPNEX_RETURN_IF_ERROR(a->local_->AddNode(node));
    }
  } else {
    DEEPNEX_ASSIGN_OR_RETURN(a->central_, gpu::CentralClient::Create(CentralOptions(o)));
    a->on_event_ = o.on_event;
  }
  return a;
}

absl::StatusOr<std::vector<gpu::Allocation>> AllocationSource::Gang(const gpu::Request& request) {
  if (local_ != nullptr) {
    gpu::AllocateOptions ao;
    ao.wait = false;
    return local_->AllocateGang(request, ao);
  }
  const auto deadline = std::chrono::steady_clock::now() + kCentralPatience;
  std::chrono::milliseconds backoff(200);
  for (;;) {
    absl::StatusOr<std::vector<gpu::Allocation>> got = Queued(request);
    if (!absl::IsUnavailable(got.status()) || std::chrono::steady_clock::now() >= deadline) {
      return Held(std::move(got));
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (cancelled_cv_.wait_for(lock, backoff, [this] { return cancelled_; })) {
        return absl::CancelledError(absl::StrCat(
            "the job was stopped while deepnex-central did not answer: ", got.status().message()));
      }
    }
    backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
    ReleaseLost(request.job);
  }
}

absl::StatusOr<std::vector<gpu::Allocation>> AllocationSource::Queued(const gpu::Request& request) {
  struct Answer {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<absl::StatusOr<std::vector<gpu::Allocation>>> value;
  };
  auto answer = std::make_shared<Answer>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cancelled_) return absl::CancelledError("the job was stopped");
  }
  const uint64_t ticket = central_->AllocateGangAsync(
      request, gpu::AllocateOptions{}, [answer](absl::StatusOr<std::vector<gpu::Allocation>> v) {
        std::lock_guard<std::mutex> lock(answer->mu);
        answer->value = std::move(v);
        answer->cv.notify_all();
      });
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cancelled_) {
      central_->Withdraw(ticket);
    } else {
      ticket_ = ticket;
    }
  }
  // A request central answers at once says nothing; one that waits says
  // where (the call itself does not learn its place in the queue).
  std::string shown;
  std::unique_lock<std::mutex> lock(answer->mu);
  while (!answer->cv.wait_for(lock, std::chrono::seconds(1),
                              [&answer] { return answer->value.has_value(); })) {
    lock.unlock();
    ShowPlace(request, &shown);
    lock.lock();
  }
  {
    std::lock_guard<std::mutex> held(mu_);
    ticket_ = 0;
  }
  return std::move(*answer->value);
}

void AllocationSource::ShowPlace(const gpu::Request& request, std::string* shown) {
  if (!on_event_ || request.job.empty()) return;
  absl::StatusOr<std::vector<gpu::PendingRequest>> pending = central_->Pending("");
  if (!pending.ok()) return;
  // A job's name is its own among central's jobs: its request is the one
  // of that job (an admin sees everyone's).
  for (const gpu::PendingRequest& p : *pending) {
    if (p.request.job != request.job || (!request.user.empty() && p.request.user != request.user)) {
      continue;
    }
    std::string place = absl::StrCat("queued at position ", p.position, ": ", p.reason);
    if (place != *shown) {
      *shown = place;
      on_event_(absl::StrCat("job ", request.job, ": ", place));
    }
    return;
  }
}

void AllocationSource::Cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_ = true;
  cancelled_cv_.notify_all();
  if (central_ != nullptr && ticket_ != 0) central_->Withdraw(ticket_);
}

absl::StatusOr<std::vector<gpu::Allocation>> AllocationSource::Held(
    absl::StatusOr<std::vector<gpu::Allocation>> got) {
  if (got.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const gpu::Allocation& a : *got) held_.insert(a.id);
  }
  return got;
}

// Gang runs at a job's start, before any Grow, so no grant of this source is
// in flight meanwhile.
void AllocationSource::ReleaseLost(const std::string& job) {
  // A call bounded by the client's timeout: it waits for central to answer.
  absl::StatusOr<std::vector<gpu::Allocation>> mine = central_->Allocations("");
  if (!mine.ok() || job.empty()) return;
  for (const gpu::Allocation& a : *mine) {
    bool lost;
    {
      std::lock_guard<std::mutex> lock(mu_);
      lost = a.job == job && held_.count(a.id) == 0;
    }
    if (lost) central_->Release(a.id).IgnoreError();
  }
}

absl::Status AllocationSource::Release(const std::string& id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    held_.erase(id);
  }
  return local_ != nullptr ? local_->Release(id) : central_->Release(id);
}

absl::StatusOr<std::vector<gpu::Allocation>> AllocationSource::Grow(
    const gpu::Request& request, std::chrono::milliseconds wait) {
  if (local_ != nullptr) return Gang(request);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cancelled_) return absl::CancelledError("the job was stopped");
  }
  gpu::AllocateOptions queued;
  queued.wait = true;
  queued.timeout = wait;
  return Held(central_->AllocateGang(request, queued));
}

absl::StatusOr<std::vector<gpu::NodeInfo>> AllocationSource::Nodes() {
  if (local_ != nullptr) return local_->Nodes();
  return central_->Nodes();
}

absl::StatusOr<std::vector<std::string>> AllocationSource::NodeNames() {
  DEEPNEX_ASSIGN_OR_RETURN(std::vector<gpu::NodeInfo> infos, Nodes());
  std::vector<std::string> names;
  for (const gpu::NodeInfo& n : infos) {
    if (!n.cordoned && !n.draining) names.push_back(n.node.name);
  }
  return names;
}

absl::StatusOr<std::string> AllocationSource::AgentAddress(const std::string& node) {
  if (central_ == nullptr) return std::string();
  DEEPNEX_ASSIGN_OR_RETURN(std::vector<gpu::NodeInfo> infos, central_->Nodes());
  for (const gpu::NodeInfo& n : infos) {
    if (n.node.name == node) return n.address;
  }
  return std::string();
}

absl::StatusOr<std::vector<gpu::Allocation>> AllocationSource::Spread(
    gpu::Request request, int nodes, std::vector<std::string>* used) {
  DEEPNEX_ASSIGN_OR_RETURN(std::vector<std::string> names, NodeNames());
  std::vector<gpu::Allocation> granted;
  auto release = [&] {
    for (const auto& a : granted) Release(a.id).IgnoreError();
  };
  size_t next = 0;
  for (int count : SpreadCounts(request.replicas, nodes)) {
    gpu::Request part = request;
    part.replicas = count;
    absl::StatusOr<std::vector<gpu::Allocation>> got = FirstThatTakes(part, names, &next);
    if (!got.ok()) {
      release();
      return absl::Status(got.status().code(), absl::StrCat(
          "nodes: ", nodes, ": no ", nodes, " of the ", names.size(), " nodes take ",
          request.replicas, " workers spread over them: ", got.status().message()));
    }
    granted.insert(granted.end(), got->begin(), got->end());
    used->push_back(got->front().node);
  }
  return granted;
}

absl::StatusOr<gpu::Allocation> AllocationSource::Now(const gpu::Request& request,
                                                       const std::string& preferred) {
  DEEPNEX_ASSIGN_OR_RETURN(std::vector<std::string> names, NodeNames());
  auto it = std::find(names.begin(), names.end(), preferred);
  if (it != names.end()) std::rotate(names.begin(), it, it + 1);
  size_t next = 0;
  DEEPNEX_ASSIGN_OR_RETURN(std::vector<gpu::Allocation> got,
                           FirstThatTakes(request, names, &next));
  return got.front();
}

absl::StatusOr<std::vector<gpu::Allocation>> AllocationSource::FirstThatTakes(
    gpu::Request request, const std::vector<std::string>& names, size_t* next) {
  absl::Status last = absl::ResourceExhaustedError("no node left");
  while (*next < names.size()) {
    request.node = names[(*next)++];
    // deepnex-central would queue a part that does not fit now: the next
    // node is tried instead, as with the local allocator.
    gpu::AllocateOptions now;
    now.wait = false;
    absl::StatusOr<std::vector<gpu::Allocation>> got =
        local_ != nullptr ? local_->AllocateGang(request, now)
                          : Held(central_->AllocateGang(request, now));
    if (got.ok()) return got;
    last = got.status();
  }
  return last;
}

}  // namespace deepnex::job
