// Where a job's allocations come from: a local allocator over this machine
// (or over the launch backend's nodes), or deepnex-central. Private to
// libdeepnex.
#ifndef DEEPNEX_JOB_ALLOCATIONS_H_
#define DEEPNEX_JOB_ALLOCATIONS_H_

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "deepnex/gpu/allocator.h"
#include "deepnex/gpu/central.h"
#include "deepnex/job/job.h"

namespace deepnex::job {

// The job's deepnex-central address and token, as its clients take them.
gpu::CentralClientOptions CentralOptions(const JobOptions& o);

class AllocationSource {
 public:
  // How long Gang waits for a deepnex-central that went away to answer again.
  static constexpr std::chrono::minutes kCentralPatience{5};

  // `nodes`: the launch backend's nodes (Launcher::Nodes); empty: the local
  // allocator hands out this machine.
  static absl::StatusOr<std::unique_ptr<AllocationSource>> Create(
      const JobOptions& o, const std::vector<gpu::Node>& nodes);

  // All of the gang or nothing. The local allocator refuses what does not
  // fit now (nothing else would free it); deepnex-central queues it, and a
  // restart of central while it waits (which drops its queue) is ridden
  // out: asked again once central answers, for up to kCentralPatience.
  // While it waits in central's queue, the options' on_event hears where
  // and why ("queued at position 2: ..."), and again whenever that changes.
  absl::StatusOr<std::vector<gpu::Allocation>> Gang(const gpu::Request& request);
  // Makes a Gang that waits (in central's queue, or for central to answer
  // again) return Cancelled now, its request withdrawn, and every later
  // Gang or Grow at once. A grant that crossed the withdrawal is returned
  // (and held) as usual. Any thread.
  void Cancel();
  absl::Status Release(const std::string& id);

  // The memory a worker asks for when the job names none: a grant of none
  // starts no container, so locally an equal share of this machine's;
  // deepnex-central grants only what is asked (0, and the start says so).
  uint64_t DefaultMemory(int workers) const { return local_memory_ / std::max(1, workers); }

  // One more of `request` (an elastic job's growth): the local allocator
  // grants what fits now; deepnex-central queues it at its priority for up
  // to `wait` (DeadlineExceeded after), so that it takes its turn there.
  absl::StatusOr<std::vector<gpu::Allocation>> Grow(const gpu::Request& request,
                                                    std::chrono::milliseconds wait);

  // Every node and its state, in the allocator's order.
  absl::StatusOr<std::vector<gpu::NodeInfo>> Nodes();
  // The nodes that take allocations now, in the allocator's order.
  absl::StatusOr<std::vector<std::string>> NodeNames();

  // The host that peers dial on `node`: the address its deepnex-agent
  // advertises; empty for a node without one (its name is all there is).
  absl::StatusOr<std::string> AgentAddress(const std::string& node);

  // `request` (a gang of `request.replicas`) spread over `nodes` nodes as
  // srun -N does (as evenly as possible, the first ones one more): one gang
  // per node, on the first nodes that take it, in rank order; all of it or
  // nothing. Fills `used` with the nodes taken.
  absl::StatusOr<std::vector<gpu::Allocation>> Spread(gpu::Request request, int nodes,
                                                      std::vector<std::string>* used);
  // One of `request` on the first node that takes it now, `preferred`
  // first; never queued. A job's parameter servers, asked for once its
  // workers hold their grants, would otherwise wait in central's queue
  // behind those very grants (on a node the workers fill, for ever).
  absl::StatusOr<gpu::Allocation> Now(const gpu::Request& request, const std::string& preferred);

 private:
  AllocationSource() = default;
  // `got`, its ids noted as the job's.
  absl::StatusOr<std::vector<gpu::Allocation>> Held(
      absl::StatusOr<std::vector<gpu::Allocation>> got);
  // Releases the allocations central holds for `job` that this source never
  // handed out: grants whose replies were lost with a central that died.
  void ReleaseLost(const std::string& job);
  // The gang of `request` on the first of names[*next...] that takes it
  // now (moving *next past the nodes tried), else the last refusal.
  absl::StatusOr<std::vector<gpu::Allocation>> FirstThatTakes(
      gpu::Request request, const std::vector<std::string>& names, size_t* next);
  // One waiting AllocateGang at central that Cancel withdraws; says where it
  // waits meanwhile.
  absl::StatusOr<std::vector<gpu::Allocation>> Queued(const gpu::Request& request);
  // Says where `request` waits in central's queue, when that is not `*shown`.
  void ShowPlace(const gpu::Request& request, std::string* shown);
  std::function<void(const std::string&)> on_event_;
  std::mutex mu_;
  std::condition_variable cancelled_cv_;
  // Guarded by mu_: the grants handed out, Cancel's call, and the ticket of
  // the request waiting at central (0: none).
  std::set<std::string> held_;
  bool cancelled_ = false;
  uint64_t ticket_ = 0;
  uint64_t local_memory_ = 0;
  std::unique_ptr<gpu::Allocator> local_;
  std::unique_ptr<gpu::CentralClient> central_;
};

}  // namespace deepnex::job

#endif  // DEEPNEX_JOB_ALLOCATIONS_H_
