// The kill -9 sweeper of a job on the process backend. Private to libdeepnex.
#ifndef DEEPNEX_JOB_SWEEPER_H_
#define DEEPNEX_JOB_SWEEPER_H_

#include <sys/types.h>

#include <memory>
#include <mutex>

#include "deepnex/launch/launcher.h"
#include "deepnex/status.h"

namespace deepnex::job {

// Sweeps a job's process-backend containers on this host once the process
// running the job is gone however it ended (SIGKILL, the OOM killer): they
// ran on for ever, outside any allocation, and a new run of the name failed
// on their cgroups (probe). A child process, forked by Start, waits on a
// socket that only this process writes: "done" (Done) after the job was
// stopped and released, or EOF without it, on which it runs the backend's
// Cleanup of `options.id`. Every trainer that links libdeepnex gets it with
// its Job, not only `deepnex run`. Thread-safe.
class Sweeper {
 public:
  // REQUIRES: options.backend == "process", options.id not empty.
  static absl::StatusOr<std::unique_ptr<Sweeper>> Start(const launch::LauncherOptions& options);
  // Done.
  ~Sweeper();
  // Tells the sweeper that the job was stopped and released, so it sweeps
  // nothing, and waits for its exit. Idempotent.
  void Done();
  pid_t pid() const { return pid_; }

 private:
  Sweeper(pid_t pid, int write_fd) : pid_(pid), write_fd_(write_fd) {}
  const pid_t pid_;
  std::mutex mu_;
  int write_fd_;  // guarded by mu_; -1 once told
};

}  // namespace deepnex::job

#endif  // DEEPNEX_JOB_SWEEPER_H_
