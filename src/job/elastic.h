// The runner side of an elastic job (JobOptions::min_workers): which workers
// are members in which generation, their publication to the job's store, and
// the thread that grows the job as allocations are granted and shrinks it as
// workers fail or are lost. The training side reads the store keys below
// (/work/briefs/elastic_contract.md; deepnex.torch, deepnex.data.Sharder).
// Private to libdeepnex.
#ifndef DEEPNEX_JOB_ELASTIC_H_
#define DEEPNEX_JOB_ELASTIC_H_

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "deepnex/collective/store.h"
#include "deepnex/gpu/types.h"
#include "deepnex/job/job.h"
#include "deepnex/launch/launcher.h"

namespace deepnex::job {

// The store keys, written only by the runner: the members of generation G
// (comma-separated worker ids in rank order) first, then the generation.
inline constexpr char kElasticMembersPrefix[] = "elastic/members/";
inline constexpr char kElasticGenerationKey[] = "elastic/generation";
// Written by a worker whose collective failed in generation G, as
// "elastic/waiting/G/<its id>" (the error in the value), before it waits
// for generation G + 1: the runner's news of a member that is alive to the
// launcher and deaf to its peers (stopped, hung).
inline constexpr char kElasticWaitingPrefix[] = "elastic/waiting/";
// Written by a worker whose training function returned (its id): the
// training is over, the job grows no more, and a worker that has not yet
// joined exits 0.
inline constexpr char kElasticDoneKey[] = "elastic/done";

// InvalidArgument naming the field and value: min_workers is 0 (not
// elastic) or 1..workers, and an elastic job places each worker where it
// fits (no `nodes`).
absl::Status ValidateElastic(const JobOptions& o);
// min_workers given and below workers.
bool IsElastic(const JobOptions& o);

// One worker to start: "w<id>" with its rank in the generation it is started
// for, the nodes of that generation's members by rank (their count is the
// world size), and its allocation. generation 0: not an elastic job.
struct WorkerStart {
  int id = 0;
  int rank = 0;
  int generation = 0;
  std::vector<std::string> nodes;
  gpu::Allocation allocation;
};

struct ElasticOptions {
  int min_workers = 1;
  int max_workers = 1;
  // Applies when a worker's end would leave fewer than min_workers: a
  // replacement (a new id) is asked for at normal priority, up to
  // max_restarts times, and the members left are published with it, not
  // before (the job does not train below min_workers); above min_workers a
  // failed worker is not replaced but dropped.
  launch::RestartPolicy restart;
  // Whose restart_backoff_* pace what follows a failed worker, its
  // replacement or the growth back, as they pace a restart in place
  // (launch::RestartBackoff): each worker that fails within
  // restart_backoff_reset of its start is one more step of the doubling,
  // so that one failing at once, again and again, is not replaced every
  // second for as long as the job runs.
  launch::LauncherOptions launcher;
  // A member whose node central has held NotReady this long is taken as
  // lost (stopped where it can be, dropped), before central itself declares
  // the node lost (--node-lost-after, 5 min by default).
  // Default: 10 s
  std::chrono::milliseconds not_ready_after{10000};
  // The workers' collective timeout (DEEPNEX_ELASTIC_TIMEOUT). The members
  // of the current generation that report no failed collective this long
  // after the first one did are stalled: stopped and dropped as a failed
  // worker is (its peers wait for the next generation, which would never
  // come). When every member reports, the same members form the next one.
  // Default: 120 s
  std::chrono::milliseconds stalled_after{120000};
  // How often the members are looked at.
  std::chrono::milliseconds poll{200};
  // How long a grant waits before its worker starts, so that the members'
  // statuses (polled by a launcher like central's every 200 ms) catch up
  // first: the grant may be the capacity of a member that just ended,
  // and a job whose members are finishing must not grow.
  std::chrono::milliseconds settle{600};
  // The job's store, where the membership is published.
  collective::StoreClientOptions store;
  // One worker's allocation at `priority` (normal 0 to make up min_workers,
  // -1 to grow). ResourceExhausted or DeadlineExceeded: none for now.
  std::function<absl::StatusOr<gpu::Allocation>(int priority)> grant;
  // Starts a worker; its handle.
  std::function<absl::StatusOr<std::shared_ptr<launch::Handle>>(const WorkerStart&)> start;
  std::function<void(const gpu::Allocation&)> release;
  // The nodes' states (central's agents), or null where there are none.
  std::function<absl::StatusOr<std::vector<gpu::NodeInfo>>()> nodes;
  // "resized from 1 to 2: worker w1 joined on node h3", and such.
  std::function<void(const std::string&)> on_event;
  // After each resize (the job's record has news for central).
  std::function<void()> on_resize;
};

// Runs an elastic job's membership from Start to Stop. Thread-safe: the
// readers may be called from any thread while its own thread works.
class Elastic {
 public:
  // Publishes generation 1 with a worker on each of `first` (min_workers
  // allocations, granted at normal priority), starts them, then grows and
  // shrinks on a thread of its own. On an error the caller stops what was
  // started (Workers()) and releases `first`.
  static absl::StatusOr<std::unique_ptr<Elastic>> Start(ElasticOptions options,
                                                        std::vector<gpu::Allocation> first);
  ~Elastic();

  // Stops growing and watching (joins the thread); the workers keep running.
  // Idempotent.
  void Stop();

  // The job has ended: every member exited 0, or one failed with fewer than
  // min_workers left and no restart left (`failure`: its exit).
  struct Outcome {
    bool ended = false;
    std::optional<launch::ExitStatus> failure;
  };
  Outcome outcome() const;
  // Every worker started over the job's life, by id.
  std::vector<std::shared_ptr<launch::Handle>> Workers() const;
  // The current members' allocations, by rank.
  std::vector<gpu::Allocation> Allocations() const;
  // Stops, then hands the members' allocations to the caller to release:
  // Allocations() is empty from then on.
  std::vector<gpu::Allocation> TakeAllocations();
  int size() const;
  int generation() const;
  // Resizes so far and why the last one happened (the job's record).
  int resizes() const;
  std::string last_resize() const;
  // Replacements started under the restart policy.
  int restarts() const;

 private:
  struct Member {
    int id = 0;
    std::shared_ptr<launch::Handle> handle;
    gpu::Allocation allocation;
    // Made just before its worker starts.
    std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  };

  explicit Elastic(ElasticOptions options) : o_(std::move(options)) {}
  // Writes the members as generation `generation_ + 1`, then the generation.
  absl::Status Publish(const std::vector<Member>& members);
  // Publish for a running job: a failure is told as an event, and the
  // workers go on waiting for the generation. True when published.
  bool Republish(const std::vector<Member>& members);
  // The next failure's step of the crash-loop backoff, from 1 again after
  // a `healthy` run; no start before the delay it gives (next_start_).
  std::chrono::milliseconds BackoffLocked(bool healthy);
  void Loop();
  // One look at the members: drops (or fails on) the ended ones.
  void Watch();
  // Drops the members at `gone` (stopped where still running, released),
  // or fails the job with `exit` when too few would be left and no restart
  // is; `why` says why they go.
  void Drop(const std::vector<Member>& members, const std::vector<size_t>& gone,
            const std::string& why, const launch::ExitStatus& exit);
  // The workers' reports: kElasticDoneKey ends the growth (done_); the
  // failed collectives (kElasticWaitingPrefix) drop the stalled members or
  // re-form them. True when it did either.
  bool Reported(const std::vector<Member>& members);
  // Asks for one more worker, and starts it when granted.
  void Grow();
  // Why member `m` is to go ("worker w1 exited(1)"); empty: it stays.
  std::string Gone(const Member& m, const launch::ContainerStatus& st,
                   std::map<std::string, bool>* ready_now);
  // `published`: the new members are generation_ (else they wait below
  // MIN for a replacement).
  void Resized(int from, int to, const std::string& why, bool published);

  const ElasticOptions o_;
  std::unique_ptr<collective::StoreClient> store_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::vector<Member> members_;  // by rank
  std::vector<std::shared_ptr<launch::Handle>> all_;
  int next_id_ = 0;
  int generation_ = 0;
  int resizes_ = 0;
  std::string last_resize_;
  int restarts_ = 0;
  // The crash-loop backoff: failures since a member last ran
  // restart_backoff_reset, and no start before next_start_.
  int backoff_step_ = 0;
  std::chrono::steady_clock::time_point next_start_;
  bool done_ = false;  // a member exited 0 or wrote kElasticDoneKey: no growth
  bool completed_ = false;  // every member exited 0
  bool taken_ = false;      // TakeAllocations
  std::optional<launch::ExitStatus> failure_;
  // When the current generation was published, and when a report of a
  // failed collective in it was first seen (the loop's own).
  std::chrono::steady_clock::time_point formed_;
  std::optional<std::chrono::steady_clock::time_point> first_report_;
  // Since when each node has been NotReady (the loop's own).
  std::map<std::string, std::chrono::steady_clock::time_point> not_ready_since_;
  std::thread thread_;
};

}  // namespace deepnex::job

#endif  // DEEPNEX_JOB_ELASTIC_H_
