// The generic Launcher: resolves specs (spec.h), starts runs on a Backend
// and supervises them under the restart policy; keeps logs across runs
// (rotating_log.h) and a record per container for `deepnex ps` (record.h).
#include "deepnex/launch/launcher.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/file_util.h"
#include "core/random.h"
#include "deepnex/units.h"
#include "launch/backend.h"
#include "launch/record.h"
#include "launch/rotating_log.h"
#include "launch/spec.h"
#include "launch/util.h"

namespace deepnex::launch {
namespace {

using Clock = std::chrono::steady_clock;
using Factory = absl::StatusOr<std::unique_ptr<Backend>> (*)(const LauncherOptions&);

struct BackendEntry {
  const char* name;
  Factory make;
};
constexpr BackendEntry kBackends[] = {
    {"process", MakeProcessBackend}, {"oci", MakeOciBackend},
    {"docker", MakeDockerBackend},   {"slurm", MakeSlurmBackend},
    {"kubernetes", MakeKubernetesBackend},
};

// How often FollowLogs looks at the log; the supervisor looks at a run (and
// moves its output into the container's log) every 5 of these.
constexpr std::chrono::milliseconds kPoll{100};
// How long an ended run's Remove is tried again (Release).
constexpr std::chrono::seconds kRemoveFor{60};
// Where a backend that writes a run's output to a file writes it, in the
// run's directory (process, oci, slurm); the others serve it through Logs.
constexpr char kRunLogFile[] = "output.log";
// What one read or copy of a log holds in memory at most.
constexpr uint64_t kLogChunk = 1 << 20;

// The backends that can cgroup a container the way Cgroup::Open finds it:
// "<cgroup parent>/<run name>".
bool CgroupNamedByRun(const std::string& backend) {
  return backend == "process" || backend == "oci";
}

bool ShouldRestart(const RestartPolicy& policy, const ExitStatus& e, int restarts) {
  const bool more = policy.max_restarts < 0 || restarts < policy.max_restarts;
  switch (policy.kind) {
    case RestartPolicy::Kind::kNever:
      return false;
    case RestartPolicy::Kind::kOnFailure:
      return !e.ok() && more;
    case RestartPolicy::Kind::kAlways:
      return more;
  }
  return false;
}

// Where a launcher keeps one container: its record and logs, and a directory
// per run.
struct Paths {
  std::string dir;
  std::string record() const { return dir + "/" + kRecordFile; }
  std::string logs() const { return dir + "/logs"; }
  std::string run(int attempt) const { return absl::StrCat(dir, "/run-", attempt); }
};

struct LauncherInfo {
  std::string id;
  std::string backend;
  std::string cgroup_parent;
  LauncherOptions options;  // for the crash-loop backoff
};

class Container : public Handle {
 public:
  Container(ContainerSpec spec, Backend* backend, LauncherInfo info, Paths paths)
      : spec_(std::move(spec)), backend_(backend), info_(std::move(info)),
        paths_(std::move(paths)), log_(paths_.logs(), spec_.log_max_bytes) {}

  ~Container() override { Join(); }

  // Starts the first run; on success the supervisor thread takes over.
  absl::Status Begin() {
    // A state_dir reused by a later launcher may hold a container of this
    // name from before: its logs are not this container's.
    DEEPNEX_RETURN_IF_ERROR(MakeDirectories(paths_.dir));
    {
      std::lock_guard<std::mutex> logs_lock(logs_mu_);
      log_.Reset();
    }
    {
      // Recorded before anything runs, or not run: the record is how a
      // later launcher on this state_dir finds the container and its grant
      // once this one is gone, and an unswept container holds GPUs that
      // would be granted again.
      std::lock_guard<std::mutex> lock(mu_);
      started_at_ = std::chrono::system_clock::now();
      DEEPNEX_RETURN_IF_ERROR(WriteRecordLocked());
    }
    DEEPNEX_ASSIGN_OR_RETURN(std::shared_ptr<Run> run, StartRun(0));
    std::lock_guard<std::mutex> lock(mu_);
    SetRunLocked(run, 0);
    // A Stop from List() or the destructor may have come before the run.
    if (stop_requested_) run->Stop(std::chrono::milliseconds(0)).IgnoreError();
    thread_ = std::thread([this] { Supervise(); });
    return absl::OkStatus();
  }

  void Join() {
    if (thread_.joinable()) thread_.join();
  }

  bool Ended() {
    std::lock_guard<std::mutex> lock(mu_);
    return final_.has_value();
  }

  const ContainerSpec& spec() const override { return spec_; }

  ContainerStatus Status() override {
    std::lock_guard<std::mutex> lock(mu_);
    return StatusLocked();
  }

  absl::StatusOr<ExitStatus> Wait(std::chrono::milliseconds timeout) override {
    timeout = CappedWait(timeout);
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return final_.has_value(); })) {
      return absl::DeadlineExceededError(absl::StrCat("container \"", spec_.name,
                                                      "\" still running after ",
                                                      timeout.count(), " ms"));
    }
    return *final_;
  }

  absl::Status Stop(std::chrono::milliseconds grace) override {
    grace = CappedWait(grace);
    DEEPNEX_RETURN_IF_ERROR(RequestStop(grace));
    // The backend's SIGKILL comes at `grace`; allow for the engine to notice.
    return Wait(grace + std::chrono::seconds(10)).status();
  }

  // Stop without waiting for the end.
  absl::Status RequestStop(std::chrono::milliseconds grace) {
    std::shared_ptr<Run> run;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_requested_ = true;
      run = run_;
    }
    cv_.notify_all();
    return run ? run->Stop(grace) : absl::OkStatus();
  }

  absl::StatusOr<std::string> Logs() override {
    std::lock_guard<std::mutex> lock(logs_mu_);
    PumpLocked(/*poll=*/false);
    return log_.Read(log_.begin(), log_.end() - log_.begin());
  }

  absl::StatusOr<LogChunk> ReadLogs(uint64_t offset, uint64_t max_bytes) override {
    // Read `ended` first: the log read after it holds everything then.
    const bool ended = Ended();
    std::lock_guard<std::mutex> lock(logs_mu_);
    PumpLocked(/*poll=*/false);
    const uint64_t from = std::clamp(offset, log_.begin(), log_.end());
    LogChunk chunk;
    DEEPNEX_ASSIGN_OR_RETURN(chunk.data, log_.Read(from, max_bytes));
    chunk.next_offset = from + chunk.data.size();
    chunk.ended = ended && chunk.next_offset == log_.end();
    return chunk;
  }

  absl::Status FollowLogs(const std::function<bool(const std::string&)>& sink) override {
    uint64_t offset = 0;
    FollowedLog followed(sink);
    while (true) {
      DEEPNEX_ASSIGN_OR_RETURN(LogChunk chunk, ReadLogs(offset, kLogChunk));
      if (!followed.Take(offset, chunk)) return absl::OkStatus();
      offset = chunk.next_offset;
      if (chunk.ended) return absl::OkStatus();
      // A full chunk: more is there already.
      if (chunk.data.size() == kLogChunk) continue;
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, kPoll, [&] { return final_.has_value(); });
    }
  }

  absl::StatusOr<launch::Usage> Usage() override {
    std::shared_ptr<Run> run;
    {
      std::lock_guard<std::mutex> lock(mu_);
      run = run_;
      if (!run) return last_usage_;
    }
    absl::StatusOr<launch::Usage> usage = run->Usage();
    if (!usage.ok()) return usage;
    std::lock_guard<std::mutex> lock(mu_);
    usage->cpu_seconds += ended_cpu_seconds_;
    return usage;
  }

  absl::StatusOr<std::unique_ptr<ExecProcess>> Exec(const ExecOptions& options) override {
    DEEPNEX_ASSIGN_OR_RETURN(std::shared_ptr<Run> run, RunningRun());
    return run->Exec(options);
  }

  absl::StatusOr<uint64_t> Commit(const std::string& image) override {
    if (info_.backend != "oci") {
      return absl::FailedPreconditionError(absl::StrCat(
          "container \"", spec_.name, "\" runs on the ", info_.backend,
          " backend: only oci containers have a layer of changes to commit"));
    }
    DEEPNEX_ASSIGN_OR_RETURN(std::shared_ptr<Run> run, RunningRun());
    return run->Commit(image);
  }

  absl::StatusOr<std::string> NetworkNamespace() override {
    DEEPNEX_ASSIGN_OR_RETURN(std::shared_ptr<Run> run, RunningRun());
    return run->NetworkNamespace();
  }

  // Deletes the container's directory; REQUIRES: ended.
  void RemoveFiles() {
    std::error_code ignored;
    std::filesystem::remove_all(paths_.dir, ignored);
  }

 private:
  // The run now, unless the container is not running.
  absl::StatusOr<std::shared_ptr<Run>> RunningRun() {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ != State::kRunning || !run_) {
      return absl::FailedPreconditionError(
          absl::StrCat("container \"", spec_.name, "\" is not running"));
    }
    return run_;
  }

  absl::StatusOr<std::shared_ptr<Run>> StartRun(int attempt) {
    RunContext context;
    context.launcher_id = info_.id;
    context.run_name = RunName(info_.id, spec_.name, attempt);
    context.dir = paths_.run(attempt);
    context.attempt = attempt;
    context.labels = spec_.labels;
    DEEPNEX_RETURN_IF_ERROR(MakeDirectories(context.dir));
    DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<Run> run, backend_->Start(spec_, context));
    run_name_ = context.run_name;
    return std::shared_ptr<Run>(std::move(run));
  }

  void SetRunLocked(std::shared_ptr<Run> run, int attempt) {
    run_ = run;
    run_id_ = run->id();
    state_ = State::kRunning;
    run_started_ = Clock::now();
    {
      std::lock_guard<std::mutex> logs_lock(logs_mu_);
      logs_run_ = run;
      run_log_path_ = paths_.run(attempt) + "/" + kRunLogFile;
      pumped_ = punched_ = 0;
    }
    WriteRecordLocked().IgnoreError();
  }

  // Moves the current run's new output into the container's log, so that
  // the log limit holds while a run writes. A run whose backend writes a
  // file is read from it by offset, a chunk at a time, and the part moved
  // is punched out of it (its writer appends, so it keeps its place); the
  // others' Logs is read only when asked (`poll` false), as each call may
  // cost the engine a request. REQUIRES: logs_mu_.
  void PumpLocked(bool poll) {
    if (!logs_run_) return;
    const int fd = open(run_log_path_.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      if (poll) return;
      absl::StatusOr<std::string> logs = logs_run_->Logs();
      if (!logs.ok()) {
        log_.Append("deepnex: logs lost: " + logs.status().ToString() + "\n");
      } else if (logs->size() > pumped_) {
        log_.Append(logs->data() + pumped_, logs->size() - pumped_);
        pumped_ = logs->size();
      }
      return;
    }
    std::string buf(kLogChunk, '\0');
    while (true) {
      const ssize_t n = pread(fd, buf.data(), buf.size(), static_cast<off_t>(pumped_));
      if (n <= 0) break;
      log_.Append(buf.data(), n);
      pumped_ += n;
    }
    // Whole blocks only; a filesystem without holes keeps the file whole.
    const uint64_t block = 4096;
    const uint64_t upto = pumped_ / block * block;
    if (upto > punched_ &&
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(punched_),
                  static_cast<off_t>(upto - punched_)) == 0) {
      punched_ = upto;
    }
    close(fd);
  }

  // Waits for the run to end and takes its logs and final usage. The run's
  // resources stay until Release.
  ExitStatus Finish(const std::shared_ptr<Run>& run, int attempt) {
    ExitStatus e;
    while (true) {
      {
        std::lock_guard<std::mutex> logs_lock(logs_mu_);
        PumpLocked(/*poll=*/true);
      }
      absl::StatusOr<std::optional<ExitStatus>> r = run->Wait(kPoll * 5);
      if (!r.ok()) {
        e.reason = ExitReason::kLost;
        AppendLog(absl::StrCat("deepnex: lost run ", run->id(), ": ", r.status().ToString(), "\n"));
        break;
      }
      if (r->has_value()) {
        e = **r;
        break;
      }
    }
    absl::StatusOr<launch::Usage> usage = run->Usage();
    {
      std::lock_guard<std::mutex> logs_lock(logs_mu_);
      PumpLocked(/*poll=*/false);
      logs_run_.reset();
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (usage.ok()) {
      ended_cpu_seconds_ += usage->cpu_seconds;
      last_usage_ = *usage;
      last_usage_.cpu_seconds = ended_cpu_seconds_;
    }
    run_.reset();
    return e;
  }

  // Deletes what an ended run holds (container, cgroup, bundle). After the
  // final run this happens once Wait has been answered: runc's delete alone
  // costs a runc start, and waiters need not pay it. Join (which Remove and
  // the launcher's destructor call first) waits for it.
  // An engine's API that is down (a Kubernetes API server) fails it for a
  // while: it is tried again, with a backoff, for up to kRemoveFor; an
  // error then is in the log and returned. A run given up as lost after an
  // outage may still be running, and it went on running beside its restart
  // when one failed DELETE was ignored.
  absl::Status Release(const std::shared_ptr<Run>& run, int attempt) {
    const auto deadline = Clock::now() + kRemoveFor;
    std::chrono::milliseconds backoff = kPoll;
    absl::Status removed = run->Remove();
    while (!removed.ok() && Clock::now() + backoff < deadline) {
      std::this_thread::sleep_for(backoff);
      backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::seconds(5));
      removed = run->Remove();
    }
    if (!removed.ok()) {
      AppendLog(absl::StrCat("deepnex: run ", run->id(), " not removed: ", removed.ToString(),
                             "\n"));
      return removed;
    }
    std::error_code ignored;
    std::filesystem::remove_all(paths_.run(attempt), ignored);
    return absl::OkStatus();
  }

  void Supervise() {
    std::shared_ptr<Run> run;
    {
      std::lock_guard<std::mutex> lock(mu_);
      run = run_;
    }
    for (int attempt = 0;; ++attempt) {
      ExitStatus e = Finish(run, attempt);
      std::unique_lock<std::mutex> lock(mu_);
      e.restarts = restarts_;
      last_exit_ = e;
      if (stop_requested_ || !ShouldRestart(spec_.restart, e, restarts_)) {
        EndLocked(e);
        lock.unlock();
        // After Wait is answered; a failure is in the container's log.
        Release(run, attempt).IgnoreError();
        return;
      }
      state_ = State::kRestarting;
      WriteRecordLocked().IgnoreError();
      // As kubelet: a run that stayed up long enough was healthy, and a
      // crash after it starts the doubling over.
      if (Clock::now() - run_started_ >= info_.options.restart_backoff_reset) backoff_step_ = 0;
      ++backoff_step_;
      RestartEvent event{spec_.name, e, restarts_ + 1, spec_.restart.max_restarts,
                         RestartBackoff(spec_.restart, info_.options, backoff_step_)};
      lock.unlock();
      // Told as it happens, so that a crash loop is visible while it runs,
      // not only in the final status.
      if (spec_.on_restart) spec_.on_restart(event);
      // Not another run while the last one may still be running: a worker
      // must not run twice.
      absl::Status released = Release(run, attempt);
      lock.lock();
      if (!released.ok()) {
        EndLostLocked(absl::StrCat("deepnex: restart ", restarts_ + 1,
                                   " not started: the run before it may still be running\n"));
        return;
      }
      cv_.wait_for(lock, event.delay, [&] { return stop_requested_; });
      if (stop_requested_) {
        EndLocked(e);
        return;
      }
      ++restarts_;
      lock.unlock();
      absl::StatusOr<std::shared_ptr<Run>> next = StartRun(attempt + 1);
      lock.lock();
      if (!next.ok()) {
        EndLostLocked(absl::StrCat("deepnex: restart ", restarts_, " failed: ",
                                   next.status().ToString(), "\n"));
        return;
      }
      run = *next;
      SetRunLocked(run, attempt + 1);
      if (stop_requested_) run->Stop(std::chrono::milliseconds(0)).IgnoreError();
    }
  }

  // A restart that could not be made: the container ends lost, its log
  // saying why.
  void EndLostLocked(const std::string& why) {
    AppendLog(why);
    ExitStatus lost;
    lost.reason = ExitReason::kLost;
    lost.restarts = restarts_;
    last_exit_ = lost;
    EndLocked(lost);
  }

  void EndLocked(const ExitStatus& e) {
    final_ = e;
    state_ = stop_requested_ ? State::kStopped : State::kExited;
    WriteRecordLocked().IgnoreError();
    cv_.notify_all();
  }

  void AppendLog(const std::string& text) {
    std::lock_guard<std::mutex> logs_lock(logs_mu_);
    log_.Append(text);
  }

  // REQUIRES: mu_.
  ContainerStatus StatusLocked() const {
    ContainerStatus s;
    s.name = spec_.name;
    s.id = run_id_;
    if (state_ == State::kRunning && run_) s.queued = run_->Queued();
    s.state = s.queued.empty() ? state_ : State::kStarting;
    s.restarts = restarts_;
    s.last_exit = last_exit_;
    s.started_at = started_at_;
    return s;
  }

  // The record `deepnex ps` and the orphan sweep read (record.h). Only the
  // first write must succeed (Begin): a later one that fails leaves the one
  // before, which names the launcher and grant all the same, and a full
  // disk must not stop supervision.
  absl::Status WriteRecordLocked() {
    ContainerRecord r{info_.id, info_.backend, run_name_, "", StatusLocked(), last_usage_};
    if (CgroupNamedByRun(info_.backend) && !run_name_.empty()) {
      r.cgroup = info_.cgroup_parent + "/" + run_name_;
    }
    // Its spec holds the container's environment: its owner's alone.
    return WriteFileAtomically(paths_.record(), ContainerRecordJson(spec_, r), 0600);
  }

  const ContainerSpec spec_;
  Backend* const backend_;
  const LauncherInfo info_;
  const Paths paths_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Run> run_;
  std::string run_id_, run_name_;
  State state_ = State::kStarting;
  int restarts_ = 0;
  int backoff_step_ = 0;  // restarts since the backoff last reset
  Clock::time_point run_started_;
  bool stop_requested_ = false;
  std::optional<ExitStatus> last_exit_, final_;
  std::chrono::system_clock::time_point started_at_;
  launch::Usage last_usage_;
  // The CPU seconds of the runs that ended: Usage counts every run's, so
  // that a restarted container's count (its metrics' counter, a job's
  // CPU-hours) does not lose the runs before (each has its own cgroup).
  double ended_cpu_seconds_ = 0;
  std::thread thread_;

  // Held while logs move from a run to the file, so Logs() never sees them
  // twice or not at all.
  std::mutex logs_mu_;
  RotatingLog log_;
  std::shared_ptr<Run> logs_run_;
  std::string run_log_path_;
  uint64_t pumped_ = 0;   // bytes of logs_run_'s output in log_
  uint64_t punched_ = 0;  // bytes of its output file freed on disk
};

class LauncherImpl : public Launcher {
 public:
  LauncherImpl(LauncherOptions options, bool owns_state_dir, std::unique_ptr<Backend> backend,
               std::unique_ptr<DirectoryLock> state_lock)
      : options_(std::move(options)), owns_state_dir_(owns_state_dir),
        state_lock_(std::move(state_lock)), backend_(std::move(backend)) {}

  ~LauncherImpl() override {
    std::map<std::string, std::shared_ptr<Container>> containers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      containers.swap(containers_);
    }
    // All at once, so N containers take one grace period, not N.
    for (auto& [name, c] : containers) c->RequestStop(std::chrono::seconds(1)).IgnoreError();
    for (auto& [name, c] : containers) c->Join();
    if (owns_state_dir_) {
      std::error_code ignored;
      std::filesystem::remove_all(options_.state_dir, ignored);
    }
  }

  std::string backend() const override { return options_.backend; }
  const std::string& id() const override { return options_.id; }

  absl::StatusOr<std::shared_ptr<Handle>> Start(const ContainerSpec& given) override {
    DEEPNEX_ASSIGN_OR_RETURN(ContainerSpec spec, Resolve(options_, options_.id, given));
    // A preset image is named, not its path on this host (a registry's
    // reference stays: it says where the image comes from).
    const std::string path = absl::StartsWith(spec.image, "/") ? spec.image : "";
    DEEPNEX_RETURN_IF_ERROR(AsNamed(backend_->Check(spec), {{path, given.image}}));
    Paths paths{absl::StrCat(options_.state_dir, "/containers/", spec.name)};
    auto container = std::make_shared<Container>(
        spec, backend_.get(),
        LauncherInfo{options_.id, options_.backend, CgroupParent(options_), options_}, paths);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (containers_.count(spec.name)) {
        return absl::AlreadyExistsError(absl::StrCat(
            "spec.name: container \"", spec.name, "\" exists (Remove it after it ended)"));
      }
      containers_[spec.name] = container;
    }
    absl::Status begun = container->Begin();
    if (!begun.ok()) {
      container->RemoveFiles();
      std::lock_guard<std::mutex> lock(mu_);
      containers_.erase(spec.name);
      return AsNamed(begun, {{path, given.image}});
    }
    return std::shared_ptr<Handle>(container);
  }

  std::vector<std::shared_ptr<Handle>> List() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<Handle>> all;
    for (auto& [name, c] : containers_) all.push_back(c);
    return all;
  }

  absl::StatusOr<std::shared_ptr<Handle>> Get(const std::string& name) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = containers_.find(name);
    if (it == containers_.end()) {
      return absl::NotFoundError(absl::StrCat("no container \"", name, "\""));
    }
    return std::shared_ptr<Handle>(it->second);
  }

  absl::Status Remove(const std::string& name) override {
    std::shared_ptr<Container> c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = containers_.find(name);
      if (it == containers_.end()) {
        return absl::NotFoundError(absl::StrCat("no container \"", name, "\""));
      }
      if (!it->second->Ended()) {
        return absl::FailedPreconditionError(
            absl::StrCat("container \"", name, "\" is still running; Stop it first"));
      }
      c = it->second;
      containers_.erase(it);
    }
    c->Join();
    c->RemoveFiles();
    return absl::OkStatus();
  }

  absl::StatusOr<int> Cleanup(const std::string& launcher_id) override {
    DEEPNEX_RETURN_IF_ERROR(CheckName("launcher_id", launcher_id, 32));
    return backend_->Cleanup(launcher_id);
  }

  absl::StatusOr<std::vector<gpu::Node>> Nodes() override { return backend_->Nodes(); }

 private:
  const LauncherOptions options_;
  const bool owns_state_dir_;
  const std::unique_ptr<DirectoryLock> state_lock_;  // a given state_dir's; released last
  const std::unique_ptr<Backend> backend_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Container>> containers_;
};

Factory FindFactory(const std::string& name) {
  for (const BackendEntry& b : kBackends) {
    if (name == b.name) return b.make;
  }
  return nullptr;
}

absl::StatusOr<std::string> MakeTempDir() {
  const char* tmp = getenv("TMPDIR");
  std::string templ = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp",
                                   "/deepnex-launch-XXXXXX");
  if (mkdtemp(templ.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", templ, ": ", strerror(errno)));
  }
  return templ;
}

}  // namespace

std::chrono::milliseconds RestartBackoff(const RestartPolicy& policy,
                                         const LauncherOptions& options, int step) {
  const auto base = std::max(policy.backoff, options.restart_backoff_floor);
  const auto cap = std::max(policy.max_backoff, options.restart_backoff_cap);
  double ms = static_cast<double>(base.count()) * std::ldexp(1.0, std::min(step, 64) - 1);
  return std::chrono::milliseconds(
      static_cast<int64_t>(std::min(ms, static_cast<double>(cap.count()))));
}

absl::StatusOr<std::unique_ptr<Launcher>> Launcher::Create(const LauncherOptions& given) {
  LauncherOptions options = given;
  // Not a Backend under the generic supervisor: deepnex-central and the
  // node's agent supervise its runs, so that a restart stays on the
  // container's allocation (which central releases when it ends for good).
  if (options.backend == "central") return MakeCentralLauncher(options);
  Factory make = FindFactory(options.backend);
  if (make == nullptr) {
    std::vector<std::string> names;
    for (const BackendEntry& b : kBackends) names.push_back(b.name);
    names.push_back("central");
    return absl::InvalidArgumentError(absl::StrCat("backend: \"", options.backend,
                                                   "\" is not one of ",
                                                   absl::StrJoin(names, ", ")));
  }
  if (options.restart_backoff_floor.count() < 0 ||
      options.restart_backoff_cap < options.restart_backoff_floor ||
      options.restart_backoff_reset.count() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "restart_backoff: floor ", options.restart_backoff_floor.count(), " ms, cap ",
        options.restart_backoff_cap.count(), " ms, reset ", options.restart_backoff_reset.count(),
        " ms is not a backoff (0 <= floor <= cap, reset > 0)"));
  }
  for (const auto& [name, dir] : options.images) {
    if (name.empty() || absl::StartsWith(name, "/") ||
        (dir != "host" && !absl::StartsWith(dir, "/"))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "images: \"", name, "\" -> \"", dir,
          "\" is not a name (not a path) for \"host\" or an absolute directory"));
    }
  }
  if (options.log_max_bytes == 0) {
    return absl::InvalidArgumentError("log_max_bytes: 0 is not a log limit (give at least 1 byte)");
  }
  if (options.id.empty()) options.id = RandomHex(6);
  DEEPNEX_RETURN_IF_ERROR(CheckName("id", options.id, 32));
  if (absl::StartsWith(options.cgroup_parent, "/") ||
      !CheckAbsoluteNormal("cgroup_parent", "/" + options.cgroup_parent).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cgroup_parent: \"", options.cgroup_parent,
        "\" is not a relative path without \".\" or \"..\" components"));
  }
  const bool owns_state_dir = options.state_dir.empty();
  std::unique_ptr<DirectoryLock> state_lock;
  if (owns_state_dir) {
    DEEPNEX_ASSIGN_OR_RETURN(options.state_dir, MakeTempDir());
  }
  // Before anything in it is read: its records are swept or adopted.
  DEEPNEX_RETURN_IF_ERROR(MakeStateDirectory(options.state_dir, "launcher state_dir",
                                             StateDirMode(options.backend)));
  if (!owns_state_dir) {
    // Two launchers on one state_dir would take each other's container
    // records (and sweep each other's containers as orphans).
    DEEPNEX_ASSIGN_OR_RETURN(state_lock, DirectoryLock::Acquire(options.state_dir, "launcher.lock",
                                                                "launcher state_dir"));
  }
  // Absolute, so that paths derived from it mean the same to the engines
  // (runc resolves a bundle's rootfs against the bundle) and after a chdir.
  for (std::string* dir : {&options.state_dir, &options.oci.root}) {
    std::error_code ec;
    std::filesystem::path absolute = std::filesystem::absolute(*dir, ec);
    if (!dir->empty() && !ec) *dir = absolute.lexically_normal().string();
  }
  absl::StatusOr<std::unique_ptr<Backend>> backend = make(options);
  if (!backend.ok()) {
    if (owns_state_dir) {
      std::error_code ignored;
      std::filesystem::remove_all(options.state_dir, ignored);
    }
    return backend.status();
  }
  return std::unique_ptr<Launcher>(
      new LauncherImpl(std::move(options), owns_state_dir, std::move(*backend),
                       std::move(state_lock)));
}

std::map<std::string, std::string> ProbeBackends(const LauncherOptions& options) {
  std::map<std::string, std::string> reasons;
  LauncherOptions probe = options;
  absl::StatusOr<std::string> tmp;
  if (probe.state_dir.empty()) {
    tmp = MakeTempDir();
    if (tmp.ok()) probe.state_dir = *tmp;
  }
  if (probe.id.empty()) probe.id = "probe";
  for (const BackendEntry& b : kBackends) {
    probe.backend = b.name;
    absl::StatusOr<std::unique_ptr<Backend>> backend = b.make(probe);
    reasons[b.name] = backend.ok() ? "" : std::string(backend.status().message());
  }
  if (tmp.ok()) {
    std::error_code ignored;
    std::filesystem::remove_all(*tmp, ignored);
  }
  return reasons;
}

}  // namespace deepnex::launch
