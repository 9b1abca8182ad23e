// deepnex-central's job records: every job that `deepnex run --central` runs
// registers with central, reports as it runs and ends there, and central
// keeps the finished ones as history (in its state directory, crash-safe like
// the allocator's ledger, pruned by age and count).
//
// A user sees and cancels their own jobs only (another user's is NotFound, as
// if it did not exist); an admin sees and cancels anyone's. Cancelling
// releases the job's allocations, which stops its containers on central, and
// the job's runner stops the rest at its next report and exits non-zero.
//
//   DEEPNEX_ASSIGN_OR_RETURN(auto jobs, gpu::JobsClient::Create({.address = addr}));
//   JobFilter f;
//   f.all = true;
//   DEEPNEX_ASSIGN_OR_RETURN(std::vector<JobRecord> list, jobs->List(f));
#ifndef DEEPNEX_GPU_JOBS_H_
#define DEEPNEX_GPU_JOBS_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "deepnex/status.h"

namespace deepnex::gpu {

struct CentralClientOptions;

enum class JobState { kPending, kRunning, kCompleted, kFailed, kCancelled };
// "pending", "running", "completed", "failed", "cancelled".
const char* JobStateName(JobState state);
// InvalidArgument naming `field` and `text` for anything else.
absl::StatusOr<JobState> ParseJobState(const std::string& text, const char* field);
// Whether `name` can name a job: [a-z0-9][a-z0-9-]*, at most 40 characters.
// Names travel in webhook headers, URLs and file names, so nothing else is.
bool IsJobName(const std::string& name);
// Completed, failed or cancelled: history.
bool JobEnded(JobState state);

struct JobAllocation {
  std::string id;
  std::string node;
  int gpus = 0;
  int cpus = 0;
  uint64_t memory = 0;
};

// One of a job's containers as its runner last reported it.
struct JobContainer {
  std::string name;
  std::string node;
  std::string role;   // "worker", "ps"
  std::string state;  // launch::StateName
  int restarts = 0;
  std::string last_exit;
  double cpu_seconds = 0;    // usage samples; 0: none
  uint64_t memory_peak = 0;  // bytes
};

// What a job's training script last passed to deepnex.report(step=...,
// **metrics) (rank 0's), as its runner last read it.
struct JobReport {
  int64_t step = 0;
  std::map<std::string, double> metrics;
  // The runner's clock; the epoch: no report yet.
  std::chrono::system_clock::time_point time{};
};

// `deepnex run --notify-when 'accuracy>=0.9'`: a metric, a comparison
// (>=, <=, >, <, ==) and a number.
struct MetricThreshold {
  std::string metric;
  std::string op;
  double value = 0;

  bool HoldsFor(const JobReport& report) const;
};
// InvalidArgument naming `field` and `text` for anything but METRIC OP NUMBER.
absl::StatusOr<MetricThreshold> ParseMetricThreshold(const std::string& text, const char* field);

struct JobRecord {
  std::string name;
  std::string user;
  std::vector<std::string> command;
  std::string mode;
  // Workers now; an elastic job (`--workers MIN:MAX`) moves between its
  // min_workers and max_workers (equal for one of fixed size).
  int workers = 0;
  int min_workers = 0;
  int max_workers = 0;
  // An elastic job's resizes so far and the last one ("resized from 2 to
  // 1: worker w1 lost"); each is a "resized" event.
  int resizes = 0;
  std::string last_resize;
  int ps = 0;  // parameter servers
  // Central's: its grants that carry the job's name (Request::job), and the
  // released ones its runner still reports, as they were granted. What a
  // report says of them is not taken.
  std::vector<JobAllocation> allocations;
  std::vector<std::string> nodes;
  JobState state = JobState::kPending;
  // Central's clock; the epoch: not yet.
  std::chrono::system_clock::time_point submitted{};
  std::chrono::system_clock::time_point started{};
  std::chrono::system_clock::time_point ended{};
  int exit_code = 0;
  int restarts = 0;  // of all its containers
  // Failed because its runner stopped reporting (runner_timeout): its host
  // or its `deepnex run` is gone, or cut off. A report from it revives it.
  bool lost = false;
  std::vector<JobContainer> containers;
  std::string message;  // why it ended, when not by itself
  std::string cancelled_by;
  // Where central POSTs this job's events (`deepnex run --notify URL`).
  std::vector<std::string> notify;
  // The last report, and when central sends it in a job.progress event:
  // every notify_every (zero: never), and once when notify_when (a
  // MetricThreshold; empty: never) first holds.
  JobReport report;
  std::chrono::milliseconds notify_every{0};
  std::string notify_when;
  // Central sums these when the job is read: elapsed from start to end (or
  // now), GPU-hours = its allocations' GPUs x elapsed, CPU-hours from the
  // containers' CPU-time samples where there are any, else its allocations'
  // cores x elapsed, and the highest memory peak of one container.
  double elapsed_seconds = 0;
  double gpu_hours = 0;
  double cpu_hours = 0;
  uint64_t peak_memory = 0;
};

// What a list shows. By default the caller's (admins: everyone's) jobs that
// have not ended, as squeue; `all`, `since` or an ended `state` add the
// history, as sacct.
struct JobFilter {
  bool all = false;
  std::string user;   // "": the caller's (admins: everyone's)
  std::string state;  // "": any; else a JobStateName
  // Jobs that had not ended by then; the epoch: any.
  std::chrono::system_clock::time_point since{};
};

// The webhook URLs a job may name (JobRecord::notify): central POSTs each
// of its events to each.
inline constexpr size_t kMaxJobNotifyUrls = 8;

// How much history deepnex-central keeps: ended jobs older than max_age
// are dropped, and beyond max_count records or max_bytes of them, the
// oldest of the user who holds the most (records, or bytes), so that one
// user's many jobs push out only their own. A job whose runner has not
// reported for runner_timeout (runners report every 2 s) is failed as lost;
// its allocations are held for a runner that was only cut off, and
// lost_release_after later, still unheard, it is cancelled by central and
// they go back (its workers on central's agents stop with them: a runner
// killed with SIGKILL held its GPUs for ever). 0: held until cancelled.
// Defaults: 30 days, 10000, 256 MiB, 60 s, 600 s
struct JobHistoryOptions {
  std::chrono::milliseconds max_age{std::chrono::hours(24 * 30)};
  uint64_t max_count = 10000;
  uint64_t max_bytes = uint64_t{256} << 20;
  std::chrono::milliseconds runner_timeout{60000};
  std::chrono::milliseconds lost_release_after{600000};
};

// A change of a job's state, as the store records it. kind: "queued",
// "started", "worker restarted", "resized" (an elastic job's worker count
// changed), "completed", "failed", "cancelled" or "progress" (a new report,
// sent for notify_every or notify_when).
struct JobEvent {
  std::string kind;
  // progress: "every" or "when"; resized: why (job.last_resize).
  std::string reason;
  int resized_from = 0;  // resized: the worker count before (job.workers after)
  JobRecord job;
  // "JOB/RUN/SEQ": the same when a restarted central sends it again.
  std::string id;
};
// Called by deepnex-central's job store after each event is durable, on the
// thread of the call that caused it, with no lock held; it must be quick.
// An error (the event could not be kept for sending) leaves the event unsent:
// the store tells it again, with the events after it, within a second, and
// after a restart.
using JobObserver = std::function<absl::Status(const JobEvent&)>;

// The Jobs service of deepnex-central. Thread-safe.
class JobsClient {
 public:
  static absl::StatusOr<std::unique_ptr<JobsClient>> Create(const CentralClientOptions& options);
  virtual ~JobsClient() = default;

  // Ordered by submission time. InvalidArgument for an unknown state;
  // PermissionDenied for another user's `user` (users).
  virtual absl::StatusOr<std::vector<JobRecord>> List(const JobFilter& filter) = 0;
  // NotFound naming `name` for no such job (or another user's).
  virtual absl::StatusOr<JobRecord> Get(const std::string& name) = 0;
  // The job as cancelled; FailedPrecondition for one that already ended.
  virtual absl::StatusOr<JobRecord> Cancel(const std::string& name) = 0;
  // The runner's registration and updates (state pending or running, then
  // ended); `run` tells this run of the job from an earlier one of the same
  // name. Returns the record, whose state is kCancelled once cancelled.
  virtual absl::StatusOr<JobRecord> Report(const JobRecord& job, const std::string& run) = 0;
};

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_JOBS_H_
