// JobReporter: how a job runner (deepnex::job's, with deepnex-central) keeps
// its job's record on central up to date. Private to libdeepnex.
#ifndef DEEPNEX_GPU_JOBS_REPORTER_H_
#define DEEPNEX_GPU_JOBS_REPORTER_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "deepnex/gpu/central.h"
#include "deepnex/gpu/jobs.h"

namespace deepnex::gpu {

// Registers a job, then reports it every `every` and when poked, from a
// thread of its own, until Finish: the registration again until Run (so
// that central hears from a job that waits in the queue), then what the
// snapshot says. A report that central does not answer (it restarts) is
// tried again at the next one. Thread-safe.
class JobReporter {
 public:
  // What the job is now (state pending or running); called on the
  // reporter's thread once Run was called, else on the caller's, and by
  // ReportNow and Finish: never two calls at once.
  using Snapshot = std::function<JobRecord()>;

  // Registers the job as `snapshot` has it: its error (AlreadyExists for a
  // name taken) is the job's.
  static absl::StatusOr<std::unique_ptr<JobReporter>> Register(
      const CentralClientOptions& options, Snapshot snapshot,
      std::chrono::milliseconds every = std::chrono::seconds(2));
  // Stops reporting (without a final report).
  ~JobReporter();

  // Reports the snapshot from now on: now, then every `every`.
  void Run();
  // Reports soon (a container restarted). Any thread, any lock.
  void Poke();
  // Reports the snapshot now, on the caller's thread (after Run): what
  // central answers, a cancel, is known when it returns. After Finish,
  // nothing (a later report would undo the final one).
  absl::Status ReportNow();
  // Whether central says the job was cancelled, and by whom.
  bool cancelled() const { return cancelled_.load(); }
  std::string cancel_message() const;
  // Stops the thread and reports the job ended (state `state`, `exit_code`,
  // `message`), trying for up to `patience` while central does not answer.
  // Only the first call reports.
  absl::Status Finish(JobState state, int exit_code, const std::string& message,
                      std::chrono::milliseconds patience = std::chrono::seconds(15));

 private:
  JobReporter(std::unique_ptr<JobsClient> client, Snapshot snapshot,
              std::chrono::milliseconds every);
  absl::Status Send(const JobRecord& job);
  void Loop();
  void StopThread();

  const std::unique_ptr<JobsClient> client_;
  const Snapshot snapshot_;
  const std::chrono::milliseconds every_;
  const std::string run_;  // this run's id
  std::atomic<bool> cancelled_{false};
  // Held by whoever takes a snapshot and sends it (the thread, ReportNow,
  // Finish), before mu_: a snapshot's reads (the job's report client) raced
  // another's, and an older report could reach central after a newer one.
  std::mutex report_mu_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool poked_ = false;
  bool running_ = false;  // Run was called
  JobRecord registered_;
  bool stopping_ = false;
  bool finished_ = false;
  std::string cancel_message_;
  std::thread thread_;
};

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_JOBS_REPORTER_H_
