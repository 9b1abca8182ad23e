// deepnex-central's job store and its Jobs service (include/deepnex/gpu/jobs.h).
// Private to libdeepnex.
//
// It lives in gpu, beside the allocator, because deepnex-central's gpu
// server serves it: it shares the server's token table, releases a
// cancelled job's allocations through the allocator, and keeps its history
// in a Ledger (ledger.h) in the allocator's state directory; a part above
// gpu could reach none of them without gpu depending on it.
//
// Records: each change of a job is a ledger record holding the whole job
// (JobRecord.put), and a job pruned from the history a JobRecord.drop; a
// snapshot holds every job, so the log stays short. A job's record also
// holds its events not yet published (Job.unsent), taken off by a
// JobRecord.sent once the observer has them: a restart publishes the rest.
#ifndef DEEPNEX_GPU_JOBS_STORE_H_
#define DEEPNEX_GPU_JOBS_STORE_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "deepnex/auth.h"
#include "deepnex/gpu/allocator.h"
#include "deepnex/gpu/jobs.h"
#include "deepnex/jobs.pb.h"
#include "deepnex/status.h"

namespace deepnex::gpu {

class Ledger;

namespace pb = ::deepnex::gpu::proto;

// The wire form, both ways (the client's too).
void ToProto(const JobRecord& job, pb::Job* p);
absl::StatusOr<JobRecord> FromProto(const pb::Job& p);

struct JobStoreOptions {
  // Where the history lives (a Ledger directory); empty: in memory only.
  std::string dir;
  bool fsync = true;
  JobHistoryOptions history;
  JobObserver on_event;
  // Checks each notify URL of a job of `user` as it is first reported (its first run
  // or a new one); an error refuses the job with it. Empty: none.
  std::function<absl::Status(const std::string& user, const std::string& url)> check_notify_url;
};

// Thread-safe. Each call acts as `who`: a user on their own jobs, an admin
// on anyone's, a job's token on that job only.
class JobStore {
 public:
  // Replays `options.dir`, then prunes the history, and fails as lost the
  // jobs not heard from for history.runner_timeout from now on. `allocator`
  // outlives the store.
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const JobStoreOptions& options,
                                                        Allocator& allocator);
  ~JobStore();
  // Starts the thread that publishes the events an earlier central made
  // durable but did not publish, and then fails silent runners. Called once
  // the server is up: the publisher may wait for central's notifier, which
  // opens only then, and a start that failed before would have waited on it
  // for ever (in this store's destructor).
  void StartWatching();

  absl::StatusOr<pb::Job> Report(const Identity& who, const pb::Job& job);
  absl::StatusOr<std::vector<pb::Job>> List(const Identity& who, const pb::JobsRequest& req);
  absl::StatusOr<pb::Job> Get(const Identity& who, const std::string& name);
  absl::StatusOr<pb::Job> Cancel(const Identity& who, const std::string& name) {
    return Cancel(who, name, "", /*lost_only=*/false);
  }

  // Serves the store behind `tokens`, which outlive it.
  std::unique_ptr<grpc::Service> MakeService(const TokenTable& tokens);

 private:
  JobStore(JobStoreOptions options, Allocator& allocator);
  absl::Status Apply(const std::string& record);
  // Under mu_: records `job` (and the drops of Prune) in the ledger, setting
  // last_ticket_.
  void PutLocked(const pb::Job& job);
  void PruneLocked(int64_t now_ms);
  // Under mu_: appends `r` to the ledger, setting last_ticket_.
  void AppendLocked(const pb::JobRecord& r);
  // Under mu_: after `j` got a new report, the job.progress event that its
  // notify_every or `when` (its notify_when) asks for, if any.
  void ProgressLocked(pb::Job* j, const std::optional<MetricThreshold>& when, int64_t now_ms,
                      std::vector<JobEvent>* events);
  void SnapshotIfDueLocked();
  // Under mu_, after the records that made them (so under last_ticket_):
  // `events` wait in made_ for a Commit.
  void QueueLocked(std::vector<JobEvent> events);
  // Makes record `ticket` durable, then tells the observer unpublished_ and
  // the events made up to `ticket`, other callers' too, in the order they
  // were made; records each as sent once the observer took it. One it
  // refused stays unsent and goes again, with those after it, at the next
  // Commit. A write that failed rolls the store back (RollBack) and is the
  // error.
  absl::Status Commit(uint64_t ticket);
  // After a failed write: rebuilds the jobs from what the ledger holds
  // (Ledger::Recover), which takes records again, and drops the events of
  // the records lost. Takes mu_.
  void RollBack();
  // The name an ended run of `name` keeps in the history once a new run
  // takes the name: <name>~<k>, k one past the last kept ('~' is in no job
  // name, so no run reports under it).
  std::string ArchivedNameLocked(const std::string& name) const;
  // The job `name` if `who` may see it, else NotFound.
  absl::StatusOr<pb::Job*> FindLocked(const Identity& who, const std::string& name);
  // Cancel, with `why` after its message; `lost_only`: only a job that is
  // lost (else FailedPrecondition).
  absl::StatusOr<pb::Job> Cancel(const Identity& who, const std::string& name,
                                 const std::string& why, bool lost_only);
  // The lost-runner watch: fails the jobs not heard from in time, cancels
  // those lost for history.lost_release_after, and tells the observer again
  // what it refused, each second.
  void Watch();

  const JobStoreOptions options_;
  Allocator& allocator_;
  std::unique_ptr<Ledger> ledger_;  // null: in memory
  std::mutex mu_;
  std::map<std::string, pb::Job> jobs_;  // by name
  // Events with the ticket of their record, in the order made, until a
  // Commit takes them: two callers' Commits may run in either order (a
  // lost job's "failed" was published after its "cancelled").
  std::deque<std::pair<uint64_t, JobEvent>> made_;
  // Serializes Commit's calls of the observer.
  std::mutex publish_mu_;
  // The events durable but not yet taken by the observer: those of the
  // store before this one, and those it refused (under publish_mu_).
  std::vector<JobEvent> unpublished_;
  bool refusing_ = false;  // the observer's last answer was an error (under publish_mu_)
  // The ledger's ticket of the last record appended; 0: none (or no ledger).
  uint64_t last_ticket_ = 0;
  // Bytes appended since the last snapshot, and that snapshot's size.
  uint64_t appended_bytes_ = 0;
  uint64_t snapshot_bytes_ = 0;
  // When each job that has not ended was last reported (or the store opened).
  std::map<std::string, std::chrono::steady_clock::time_point> heard_;
  std::condition_variable cv_;
  bool closing_ = false;
  std::thread watcher_;  // started by StartWatching
};

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_JOBS_STORE_H_
