#include "deepnex/job/job.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <cstdlib>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/random.h"
#include "core/text.h"
#include "deepnex/collective/store.h"
#include "deepnex/env.h"
#include "deepnex/gpu/allocator.h"
#include "deepnex/gpu/central.h"
#include "deepnex/ps/optimizer.h"
#include "deepnex/units.h"
#include "gpu/jobs_reporter.h"
#include "job/allocations.h"
#include "job/elastic.h"
#include "job/job_util.h"
#include "job/sweeper.h"
#include "deepnex/gpu/discovery.h"
#include "core/file_util.h"
#include "core/net.h"
#include "launch/util.h"
#include "nlohmann/json.hpp"
#include "notify/notifier.h"

namespace deepnex::job {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;
// Where a worker's deepnex.report() keeps rank 0's last report in the job's
// store (python/deepnex/_tune_report.py writes it): JSON {"step", "metrics",
// "time_ms"}.
constexpr char kReportKey[] = "deepnex/report";
// The longest piece of a worker's output shown as one line.
constexpr size_t kMaxLine = 1 << 20;
// How long a stop waits for each phase (the workers, then the parameter
// servers) to end, all hosts at once: what a container's grace (2 s) and a
// node's answer take.
constexpr milliseconds kStopDeadline{6000};

class JobImpl : public Job {
 public:
  explicit JobImpl(JobOptions options) : o_(std::move(options)) {}
  ~JobImpl() override {
    Stop(0).IgnoreError();
    launcher_.reset();
    std::error_code ignored;
    std::filesystem::remove_all(job_dir_, ignored);
  }

  const std::string& name() const override { return o_.name; }
  const std::string& backend() const override { return o_.launcher.backend; }

  absl::Status Init() {
    if (o_.name.empty()) o_.name = "job-" + RandomHex(4);
    if (!gpu::IsJobName(o_.name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "name: ", Quoted(o_.name), " is not a job name ([a-z0-9][a-z0-9-]*, at most 40)"));
    }
    if (o_.command.empty()) return absl::InvalidArgumentError("command: empty");
    if (o_.workers < 1) {
      return absl::InvalidArgumentError(absl::StrCat("workers: ", o_.workers, " is below 1"));
    }
    DEEPNEX_RETURN_IF_ERROR(ValidateElastic(o_));
    if (o_.nodes < 0) {
      return absl::InvalidArgumentError(absl::StrCat("nodes: ", o_.nodes, " is below 0"));
    }
    if (o_.nodes > o_.workers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "nodes: ", o_.nodes, " is more than the ", o_.workers, " workers to spread over them"));
    }
    DEEPNEX_RETURN_IF_ERROR(ValidateAdvertiseHost("advertise_address", o_.advertise_address));
    if (o_.notify.size() > gpu::kMaxJobNotifyUrls) {
      return absl::InvalidArgumentError(absl::StrCat("notify: ", o_.notify.size(),
                                                     " URLs; at most ", gpu::kMaxJobNotifyUrls));
    }
    for (const std::string& url : o_.notify) {
      absl::Status ok = notify::CheckUrl(url);
      if (!ok.ok()) return absl::InvalidArgumentError(absl::StrCat("notify: ", ok.message()));
      if (o_.central.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("notify: \"", url, "\" needs central (deepnex-central sends them)"));
      }
    }
    if (o_.notify_every.count() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "notify_every: ", o_.notify_every.count() / 60000.0, " minutes is below 0"));
    }
    if (!o_.notify_when.empty()) {
      DEEPNEX_RETURN_IF_ERROR(gpu::ParseMetricThreshold(o_.notify_when, "notify_when").status());
    }
    if ((o_.notify_every.count() > 0 || !o_.notify_when.empty()) && o_.central.empty()) {
      return absl::InvalidArgumentError(
          "notify_every, notify_when: need central (deepnex-central sends job.progress)");
    }
    std::string mode = o_.mode;
    if (mode.rfind("ssp:", 0) == 0) {
      int staleness = -1;
      if (!absl::SimpleAtoi(mode.substr(4), &staleness) || staleness < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "mode: \"", o_.mode, "\": ssp takes a staleness >= 0, e.g. ssp:2"));
      }
      ps_mode_ = "ssp";
      staleness_ = staleness;
    } else if (mode == "sync" || mode == "async") {
      ps_mode_ = mode;
    } else if (mode != "allreduce") {
      return absl::InvalidArgumentError(absl::StrCat(
          "mode: \"", o_.mode, "\" is not sync, ssp:S, async or allreduce"));
    }
    if (o_.ps < -1) return absl::InvalidArgumentError(absl::StrCat("ps: ", o_.ps, " is below 0"));
    if (o_.ps == -1) o_.ps = ps_mode_.empty() ? 0 : 1;
    if (!ps_mode_.empty() && o_.ps == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("ps: 0 parameter servers for mode \"", o_.mode, "\""));
    }
    if (o_.gpus_per_worker < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpus_per_worker: ", o_.gpus_per_worker, " is below 0"));
    }
    if (!(o_.cpus >= 0) || !std::isfinite(o_.cpus)) {
      return absl::InvalidArgumentError(
          absl::StrCat("cpus: ", o_.cpus, " is not a finite number >= 0"));
    }
    // deepnex-central grants only what is asked, and a container needs
    // memory: said before anything is allocated (a new user's job was
    // granted, then failed naming spec.memory, or first waited in the queue).
    if (!o_.central.empty() && o_.memory == 0) {
      return absl::InvalidArgumentError(
          "memory (--memory): required with central, which grants only what is asked, and a "
          "container needs some (e.g. --memory 4GiB)");
    }
    if (o_.image.empty()) {
      return absl::InvalidArgumentError("image (--image): empty; \"host\" runs this host's files");
    }
    if (o_.image != "host" && !ps_mode_.empty() &&
        ((o_.launcher.backend == "docker" && o_.central.empty()) ||
         o_.launcher.backend == "kubernetes")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "image (--image): ", QuotedPath(o_.image), " with mode \"", o_.mode,
          "\": the parameter servers run deepnex-ps from this host's files, which the ",
          o_.launcher.backend, " backend cannot run; use mode allreduce, or the oci backend"));
    }
    // Said by its own name: the launcher's check, where the workers run on
    // this host, named spec.working_dir.
    std::error_code no_dir;
    if (!o_.working_dir.empty() && o_.central.empty() && o_.launcher.backend == "process" &&
        !std::filesystem::is_directory(o_.working_dir, no_dir)) {
      return absl::NotFoundError(absl::StrCat("working_dir (--workdir): ",
                                              QuotedPath(o_.working_dir),
                                              " is not a directory on this host"));
    }
    // Before anything is allocated or started, by the servers' own rules
    // (the job had its own: it refused an lr of 0 that deepnex-ps takes).
    if (!ps_mode_.empty()) {
      ps::OptimizerConfig optimizer;
      DEEPNEX_ASSIGN_OR_RETURN(optimizer.kind, ps::ParseOptimizerKind(o_.optimizer));
      optimizer.lr = o_.lr.value_or(ps::DefaultLr(optimizer.kind));
      optimizer.momentum = o_.momentum;
      DEEPNEX_RETURN_IF_ERROR(optimizer.Validate());
    }
    // deepnex-central knows who the token is; only a local allocator needs
    // to be told.
    if (o_.user.empty() && o_.central.empty()) {
      const char* user = getenv("USER");
      o_.user = user != nullptr && *user != '\0' ? user : "root";
    }
    if (o_.ps > 0) {
      if (o_.ps_binary.empty()) {
        const char* bin = getenv("DEEPNEX_PS_BIN");
        o_.ps_binary = bin != nullptr && *bin != '\0' ? bin : "deepnex-ps";
      }
      DEEPNEX_ASSIGN_OR_RETURN(o_.ps_binary, launch::FindOnPath(o_.ps_binary, launch::PathOf({})));
    }
    // Each line is one write, so that lines from workers, parameter servers and the
    // job itself, written to the same pipe, never interleave within a line.
    if (!o_.output) {
      o_.output = [](const std::string& who, const std::string& line) {
        std::cout << absl::StrCat("[", who, "] ", line, "\n") << std::flush;
      };
    }
    if (!o_.on_event) {
      o_.on_event = [](const std::string& message) { std::cerr << message + "\n"; };
    }
    if (o_.launcher.id.empty()) o_.launcher.id = o_.name;
    if (o_.registry_dir.empty()) {
      const char* dir = getenv("DEEPNEX_RUN_DIR");
      if (dir != nullptr && *dir != '\0') {
        o_.registry_dir = dir;
      } else {
        // In /tmp, whose names anyone may take first: a probe's user made
        // another's /tmp/deepnex-UID, world-writable, and swapped the job
        // script a slurm job then ran as its victim.
        const std::string mine = absl::StrCat("/tmp/deepnex-", getuid());
        DEEPNEX_RETURN_IF_ERROR(MakeOwnDirectory(mine, "the run directory"));
        o_.registry_dir = mine + "/jobs";
      }
    }
    job_dir_ = absl::StrCat(o_.registry_dir, "/", o_.name);
    if (o_.launcher.state_dir.empty()) o_.launcher.state_dir = job_dir_ + "/launch";
    return absl::OkStatus();
  }

  absl::Status Start() override {
    {
      std::lock_guard<std::mutex> lock(start_mu_);
      if (stop_asked_) return Stopped();
      starting_ = true;
    }
    absl::Status s = StartAll();
    bool stopped;
    {
      std::lock_guard<std::mutex> lock(start_mu_);
      starting_ = false;
      stopped = stop_asked_;
    }
    start_cv_.notify_all();
    // A Stop from another thread ended the start: that Stop records the job
    // and releases what the start took.
    if (stopped) return Stopped();
    if (!s.ok()) {
      if (reporter_) {
        reporter_->Finish(gpu::JobState::kFailed, 1, s.ToString()).IgnoreError();
        // Cancelled while it waited: its allocation was withdrawn.
        if (reporter_->cancelled()) s = absl::CancelledError(reporter_->cancel_message());
      }
      Stop(0).IgnoreError();
    }
    return s;
  }

  // Tells when worker `rank` has waited in its engine's queue for a while
  // (`why`, its ContainerStatus::queued), and again when the engine gives
  // another reason: behind jobs deepnex did not submit, a Slurm job was
  // PENDING without a word. A start that is only queued briefly, as most
  // are, is not news.
  void Queued(size_t rank, const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(handles_mu_);
      QueuedWorker& w = queued_[rank];
      if (why.empty()) {
        w = QueuedWorker{Clock::now(), ""};
        return;
      }
      if (w.since == Clock::time_point{}) w.since = Clock::now();
      if (w.told == why || Clock::now() - w.since < milliseconds(2000)) return;
      w.told = why;
    }
    o_.on_event(absl::StrCat("worker ", rank, " is ", why));
  }

  absl::StatusOr<JobResult> Wait(milliseconds timeout) override {
    auto deadline = Clock::now() + CappedWait(timeout);
    // As torchrun does: once a worker has failed for good (its restart
    // policy gave up), the others are stopped rather than left to hang in a
    // collective or a shrunken round.
    JobResult result;
    int stop_signal = 0;
    for (;;) {
      {
        // Stopped: its containers go (or went) with Stop, and an elastic
        // job's outcome never ends (a stopped elastic run waited for ever).
        // One that had ended by itself stays so for later Waits.
        std::lock_guard<std::mutex> lock(start_mu_);
        result.stopped = stop_asked_ && !ended_;
        stop_signal = result.stopped ? stop_signal_ : 0;
      }
      if (result.stopped) {
        // A Stop on another thread (deepnex run's signal handler's) may still
        // be stopping: waited for no longer than `timeout`, so that the
        // caller can still take a second Ctrl-C meanwhile.
        std::unique_lock<std::mutex> lock(start_mu_);
        if (!start_cv_.wait_until(lock, deadline, [this] { return stops_running_ == 0; })) {
          return absl::DeadlineExceededError(absl::StrCat("job ", o_.name, " is stopping"));
        }
        break;
      }
      bool all_ended = true;
      bool failed = false;
      // Elastic: a failed worker that leaves enough is dropped, not the end.
      if (elastic_) all_ended = elastic_->outcome().ended;
      for (size_t rank = 0; !elastic_ && rank < workers_.size(); ++rank) {
        launch::ContainerStatus st = workers_[rank]->Status();
        Queued(rank, st.queued);
        bool ended = st.state == launch::State::kExited || st.state == launch::State::kStopped;
        all_ended = all_ended && ended;
        failed = failed || (ended && st.last_exit.has_value() && !st.last_exit->ok());
      }
      if (all_ended || failed) {
        std::lock_guard<std::mutex> lock(start_mu_);
        ended_ = true;
        break;
      }
      if (reporter_ && reporter_->cancelled()) {
        // Its allocations are gone already; its containers go now.
        reporter_->Finish(gpu::JobState::kFailed, 1, "cancelled").IgnoreError();
        Stop(0).IgnoreError();
        return absl::CancelledError(reporter_->cancel_message());
      }
      if (Clock::now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("job ", o_.name, " is still running"));
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
    // A cancel through central stops the workers, and their end may be
    // seen before the report that tells of the cancel: asked now, it is the
    // job's end rather than a success.
    if (reporter_ && !result.stopped) reporter_->ReportNow().IgnoreError();
    if (reporter_ && !result.stopped && reporter_->cancelled()) {
      reporter_->Finish(gpu::JobState::kFailed, 1, "cancelled").IgnoreError();
      Stop(0).IgnoreError();
      return absl::CancelledError(reporter_->cancel_message());
    }
    std::optional<launch::ExitStatus> first_failure;
    if (elastic_) first_failure = elastic_->outcome().failure;
    // A worker that failed by itself first, else one stopped from outside
    // the job (`deepnex stop`): a job with a worker missing did not pass.
    for (launch::State ended : {launch::State::kExited, launch::State::kStopped}) {
      for (size_t rank = 0; !elastic_ && rank < workers_.size(); ++rank) {
        launch::ContainerStatus st = workers_[rank]->Status();
        if (st.last_exit.has_value() && !st.last_exit->ok() && !first_failure.has_value() &&
            st.state == ended) {
          first_failure = st.last_exit;
          if (result.stopped) continue;  // the job's own Stop, not news
          if (ended == launch::State::kStopped) {
            o_.on_event(absl::StrCat("worker ", rank, " was stopped from outside the job: ",
                                     st.last_exit->ToString()));
          } else if (st.last_exit->reason == launch::ExitReason::kLost) {
            o_.on_event(absl::StrCat("worker ", rank, " was lost with its node \"",
                                     workers_[rank]->spec().allocation->node, "\""));
          }
        }
      }
    }
    if (reporter_ && !result.stopped) {
      // The parameter servers stop first: the final record shows none of
      // the job's containers running after its end.
      {
        std::lock_guard<std::mutex> lock(stop_mu_);
        StopContainers().IgnoreError();  // Shutdown stops them again, and says
      }
      const int code = first_failure.has_value() ? ExitCodeOf(*first_failure) : 0;
      reporter_->Finish(code == 0 ? gpu::JobState::kCompleted : gpu::JobState::kFailed, code, "")
          .IgnoreError();
    }
    // After a Stop, as that Stop (whichever runs first, the record says it).
    DEEPNEX_RETURN_IF_ERROR(Shutdown(stop_signal, /*show_all_output=*/!result.stopped));
    for (const auto& w : workers_) {
      bool left;
      {
        std::lock_guard<std::mutex> lock(handles_mu_);
        left = unstopped_.count(w.get()) > 0;
      }
      // Left to its node by the stop, which said so: not waited for again.
      if (left) {
        result.workers.push_back(launch::ExitStatus{launch::ExitReason::kLost});
        continue;
      }
      DEEPNEX_ASSIGN_OR_RETURN(launch::ExitStatus e, w->Wait(milliseconds(10000)));
      result.workers.push_back(e);
    }
    // Stopped: as its workers ended (an elastic job's outcome has no
    // failure, and its stopped workers read as a success).
    for (size_t i = 0; result.stopped && !first_failure && i < result.workers.size(); ++i) {
      if (!result.workers[i].ok()) first_failure = result.workers[i];
    }
    if (first_failure.has_value()) result.exit_code = ExitCodeOf(*first_failure);
    result.seconds = std::chrono::duration<double>(Clock::now() - started_).count();
    return result;
  }

  absl::Status Stop(int signal) override {
    {
      // A start in progress (waiting in deepnex-central's queue, say) stops
      // waiting and returns before the rest is stopped.
      std::unique_lock<std::mutex> lock(start_mu_);
      if (!stop_asked_) stop_signal_ = signal;
      stop_asked_ = true;
      ++stops_running_;
      if (allocations_ != nullptr) allocations_->Cancel();
      start_cv_.wait(lock, [this] { return !starting_; });
    }
    absl::Status s = Shutdown(signal, /*show_all_output=*/false);
    {
      std::lock_guard<std::mutex> lock(start_mu_);
      --stops_running_;
    }
    start_cv_.notify_all();
    return s;
  }

  // Stops every container of the job and waits for their ends: the workers,
  // then the parameter servers, each on a thread of its own, so that every
  // host's stop runs at once and each phase ends within kStopDeadline. One
  // after another, a host that did not answer held a Ctrl-C for 50 s
  // (probe). A container not stopped by then is left to its node (with
  // deepnex-central: central stops it once the node answers again), named
  // by Unstopped() and in the status, which names it and its host too.
  // Called with stop_mu_ held.
  absl::Status StopContainers() {
    std::vector<std::shared_ptr<launch::Handle>> workers, servers;
    {
      std::lock_guard<std::mutex> lock(handles_mu_);
      for (auto it = handles_.rbegin(); it != handles_.rend(); ++it) {
        // Left to its node by an earlier stop (Stop's, then Wait's and the
        // destructor's Shutdown): not waited for again.
        if (unstopped_.count(it->get())) continue;
        const bool worker = std::find(workers_.begin(), workers_.end(), *it) != workers_.end();
        (worker ? workers : servers).push_back(*it);
      }
    }
    absl::Status first = StopInParallel(workers);
    first.Update(StopInParallel(servers));
    return first;
  }

  // What StopContainers' threads share: they may outlive the job.
  struct Stopping {
    std::mutex mu;
    std::condition_variable cv;
    size_t running = 0;
  };

  absl::Status StopInParallel(const std::vector<std::shared_ptr<launch::Handle>>& handles) {
    auto stopping = std::make_shared<Stopping>();
    std::vector<std::shared_ptr<absl::Status>> results;
    const auto deadline = Clock::now() + kStopDeadline;
    for (const auto& h : handles) {
      auto result = std::make_shared<absl::Status>(absl::DeadlineExceededError(""));
      results.push_back(result);
      {
        std::lock_guard<std::mutex> lock(stopping->mu);
        ++stopping->running;
      }
      {
        std::lock_guard<std::mutex> lock(handles_mu_);
        unstopped_.insert(h.get());
      }
      std::thread([h, result, stopping, deadline] {
        absl::Status s = h->Stop(milliseconds(2000));
        const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
        absl::Status ended = h->Wait(std::max(left, milliseconds(0))).status();
        if (s.ok()) s = ended;
        std::lock_guard<std::mutex> lock(stopping->mu);
        *result = s;
        --stopping->running;
        stopping->cv.notify_all();
      }).detach();
    }
    {
      std::unique_lock<std::mutex> lock(stopping->mu);
      stopping->cv.wait_until(lock, deadline, [&] { return stopping->running == 0; });
    }
    absl::Status first;
    for (size_t i = 0; i < handles.size(); ++i) {
      absl::Status s;
      {
        std::lock_guard<std::mutex> lock(stopping->mu);
        s = *results[i];
      }
      if (s.ok()) {
        std::lock_guard<std::mutex> lock(handles_mu_);
        unstopped_.erase(handles[i].get());
        continue;
      }
      const std::string what = WhereIs(*handles[i]);
      if (absl::IsDeadlineExceeded(s) && s.message().empty()) {
        s = absl::DeadlineExceededError(
            absl::StrCat(what, ": not stopped within ", kStopDeadline.count() / 1000,
                         " s; left to its node"));
      } else {
        s = absl::Status(s.code(), absl::StrCat(what, ": not stopped: ", s.message()));
      }
      o_.on_event(std::string(s.message()));
      first.Update(s);
    }
    return first;
  }

  // "worker 1 on node h2" ("on this host" where the backend runs here).
  std::string WhereIs(const launch::Handle& h) {
    std::string who = h.spec().name;
    {
      std::lock_guard<std::mutex> lock(handles_mu_);
      auto it = who_.find(&h);
      if (it != who_.end()) who = it->second;
    }
    const std::optional<gpu::Allocation>& a = h.spec().allocation;
    if (!placed_ || !a.has_value()) return absl::StrCat(who, " on this host");
    return absl::StrCat(who, " on node ", Quoted(a->node));
  }

  std::vector<std::string> Unstopped() override {
    std::vector<std::shared_ptr<launch::Handle>> left;
    {
      std::lock_guard<std::mutex> lock(handles_mu_);
      for (const auto& h : handles_) {
        if (unstopped_.count(h.get())) left.push_back(h);
      }
    }
    std::vector<std::string> out;
    for (const auto& h : left) out.push_back(WhereIs(*h));
    return out;
  }

  // Stop, or at Run's end (where the job ended by itself) with every line of
  // the workers' output shown.
  absl::Status Shutdown(int signal, bool show_all_output) {
    std::lock_guard<std::mutex> lock(stop_mu_);
    // Stopped before its end: the record says by what (after Run's own
    // Finish, nothing changes).
    if (reporter_ && signal > 0) {
      reporter_->Finish(gpu::JobState::kCancelled, 128 + signal,
                        absl::StrCat("stopped by ", launch::SignalName(signal)))
          .IgnoreError();
    } else if (reporter_) {
      reporter_->Finish(gpu::JobState::kFailed, 1, "stopped before its end").IgnoreError();
    }
    // A probe's SIGTERM waited 76 s while 11 MB of output was printed.
    if (!show_all_output) quiet_ = true;
    // No worker is added or dropped from here on; the members' allocations
    // are the job's again, to release below (they were left held).
    if (elastic_) {
      std::vector<gpu::Allocation> taken = elastic_->TakeAllocations();
      std::lock_guard<std::mutex> lock(handles_mu_);
      grants_.insert(grants_.end(), taken.begin(), taken.end());
    }
    absl::Status first = StopContainers();
    if (allocations_ != nullptr) {
      for (const auto& a : Allocations()) {
        absl::Status s = allocations_->Release(a.id);
        // Through the agents, central releases an allocation once its
        // container ended for good (or was lost with its node).
        if (absl::IsNotFound(s) && o_.launcher.backend == "central") s = absl::OkStatus();
        if (first.ok()) first = s;
      }
    }
    {
      std::lock_guard<std::mutex> lock(handles_mu_);
      grants_.clear();
    }
    ps_grants_.clear();
    if (store_ != nullptr) store_->Stop();
    // Stopped and released: nothing is left for it to sweep.
    if (sweeper_ != nullptr) sweeper_->Done();
    // Last: the allocations go back while output is still printed.
    for (auto& t : log_threads_) t.join();
    log_threads_.clear();
    // Off `deepnex top`; the directory itself goes with the launcher, which
    // keeps its logs there until then.
    std::error_code ignored;
    std::filesystem::remove(job_dir_ + "/job.json", ignored);
    return first;
  }

  std::vector<std::shared_ptr<launch::Handle>> Containers() override {
    std::lock_guard<std::mutex> lock(handles_mu_);
    return handles_;
  }
  // The workers' allocations by rank, then the parameter servers'.
  std::vector<gpu::Allocation> Allocations() override {
    std::vector<gpu::Allocation> all;
    {
      std::lock_guard<std::mutex> lock(handles_mu_);
      // An elastic job's are its members' until Shutdown takes them.
      all = elastic_ && grants_.empty() ? elastic_->Allocations() : grants_;
    }
    all.insert(all.end(), ps_grants_.begin(), ps_grants_.end());
    return all;
  }

 private:
  absl::Status StartAll() {
    started_ = Clock::now();
    absl::StatusOr<std::unique_ptr<launch::Launcher>> launcher =
        launch::Launcher::Create(o_.launcher);
    // Its state directory is the job's: held, another run of this name is on
    // (a new user read only "launcher state_dir ... is in use by pid N").
    if (absl::IsFailedPrecondition(launcher.status()) &&
        absl::StrContains(launcher.status().message(), " is in use by ")) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", o_.name, ": another deepnex run of this name is running (",
          launcher.status().message(), "); give this one another name"));
    }
    DEEPNEX_ASSIGN_OR_RETURN(launcher_, std::move(launcher));
    // Slurm places on its nodes; the other backends run everything on this
    // host (the kubernetes one lists no nodes yet, and takes a job's
    // containers only with an image, which deepnex run does not give).
    DEEPNEX_ASSIGN_OR_RETURN(std::vector<gpu::Node> backend_nodes, launcher_->Nodes());
    if (backend_nodes.empty() && !o_.central.empty() && RunsHere(o_.launcher.backend)) {
      DEEPNEX_RETURN_IF_ERROR(UseAgents(&backend_nodes));
    }
    // The process backend would run a worker on this host's files whatever
    // its image says (it refuses only a directory).
    if (o_.image != "host" && o_.launcher.backend == "process") {
      return absl::InvalidArgumentError(absl::StrCat(
          "image (--image): ", QuotedPath(o_.image),
          ": the process backend runs this host's files (image \"host\"); an image needs the "
          "oci, docker or kubernetes backend, or deepnex-central's agents"));
    }
    placed_ = !backend_nodes.empty();
    // Before any container starts, for every program that runs a Job (a C++
    // trainer's kill -9 left them running as `deepnex run`'s once did).
    if (o_.launcher.backend == "process") {
      DEEPNEX_ASSIGN_OR_RETURN(sweeper_, Sweeper::Start(o_.launcher));
    }
    if (!placed_ && o_.nodes > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "nodes: ", o_.nodes, ": the ", o_.launcher.backend,
          " backend runs every container on this host; spreading over nodes needs a backend "
          "that places on them (slurm)"));
    }
    DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<AllocationSource> source,
                             AllocationSource::Create(o_, backend_nodes));
    {
      std::lock_guard<std::mutex> lock(start_mu_);
      allocations_ = std::move(source);
      if (stop_asked_) allocations_->Cancel();
    }
    if (!o_.central.empty()) {
      DEEPNEX_ASSIGN_OR_RETURN(reporter_, gpu::JobReporter::Register(CentralOptions(o_), [this] {
                                 return JobNow();
                               }));
    }
    gpu::Request request;
    request.user = o_.user;
    request.job = o_.name;
    request.gpus = o_.gpus_per_worker;
    request.mode = o_.gpu_mode;
    request.gpu_memory = o_.gpu_memory;
    // Every worker holds at least a core in the allocator's books, even
    // when its container is not limited (cpus 0), so that a machine is not
    // oversubscribed by jobs that did not say.
    request.cpus = std::max(1, static_cast<int>(std::ceil(o_.cpus)));
    request.memory = o_.memory != 0 ? o_.memory : allocations_->DefaultMemory(o_.workers);
    // An elastic job starts with its least; Elastic asks for the rest.
    request.replicas = IsElastic(o_) ? o_.min_workers : o_.workers;
    std::vector<std::string> nodes_used;
    if (o_.nodes > 0) {
      DEEPNEX_ASSIGN_OR_RETURN(grants_, allocations_->Spread(request, o_.nodes, &nodes_used));
    } else {
      DEEPNEX_ASSIGN_OR_RETURN(grants_, allocations_->Gang(request));
      for (const auto& g : grants_) {
        if (std::find(nodes_used.begin(), nodes_used.end(), g.node) == nodes_used.end()) {
          nodes_used.push_back(g.node);
        }
      }
    }
    // The containers run for whom the allocations are (the token's user).
    if (o_.user.empty() && !grants_.empty()) o_.user = grants_[0].user;
    if (!placed_) {
      // deepnex-central may grant another node; a backend that runs here
      // cannot go there (a deepnex-agent on that node will), and running it
      // here would use what another job was granted.
      const std::string here = HostName();
      for (size_t rank = 0; rank < grants_.size(); ++rank) {
        if (grants_[rank].node != here) {
          return absl::FailedPreconditionError(absl::StrCat(
              "worker ", rank, ": allocation ", grants_[rank].id, " is on node \"",
              grants_[rank].node, "\", not on this host (\"", here, "\"), and the ",
              o_.launcher.backend, " backend runs containers on this host only; use a backend "
              "that places on nodes (slurm) or run deepnex run on that node"));
        }
      }
    }
    // The parameter servers go to the workers' nodes, server i to the i-th
    // (round robin), else to any node with room now, each with the CPUs and
    // memory of a worker.
    if (placed_) {
      for (int i = 0; i < o_.ps; ++i) {
        gpu::Request ps = request;
        ps.gpus = 0;
        ps.gpu_memory = 0;
        ps.replicas = 1;
        absl::StatusOr<gpu::Allocation> got =
            allocations_->Now(ps, nodes_used[i % nodes_used.size()]);
        if (!got.ok()) {
          return absl::Status(got.status().code(), absl::StrCat(
              "ps ", i, ": no node has room now for a parameter server (",
              ps.cpus, " cpus and ", FormatByteSize(ps.memory), ", as a worker) beside the "
              "job's workers, and waiting in the queue while they hold their grants could "
              "wait for ever: ask for fewer --cpus or --memory per worker, or fewer --workers "
              "(", got.status().message(), ")"));
        }
        ps_grants_.push_back(*got);
      }
    }

    // Everything local: loopback, as before. Otherwise every interface, and
    // the address the other hosts (or pods) reach this one at.
    const bool local = !placed_ && !OnPodNetwork() && o_.advertise_address.empty();
    std::string advertise = o_.advertise_address;
    if (!local && advertise.empty()) advertise = PrimaryAddress(HostOf(o_.central));
    token_ = RandomHex(16);
    collective::StoreServerOptions so;
    so.token = token_;
    so.address = local ? "127.0.0.1:0" : "0.0.0.0:0";
    so.advertise = advertise;
    DEEPNEX_ASSIGN_OR_RETURN(store_, collective::StoreServer::Create(so));

    for (int i = 0; i < o_.ps; ++i) {
      DEEPNEX_ASSIGN_OR_RETURN(int port, ReservePort());
      const std::string who = absl::StrCat("ps ", i);
      launch::ContainerSpec spec = PsSpec(i, JoinHostPort(local ? "127.0.0.1" : "0.0.0.0", port));
      if (placed_) {
        spec.allocation = ps_grants_[i];
        // What deepnex-ps advertises: its agent's address for the node, else
        // the one that routes towards the job's store.
        spec.env["DEEPNEX_STORE_ADDR"] = store_->address();
        DEEPNEX_ASSIGN_OR_RETURN(std::string host, allocations_->AgentAddress(ps_grants_[i].node));
        if (!host.empty()) spec.command.insert(spec.command.end(), {"--advertise", host});
      } else if (!local) {
        spec.command.insert(spec.command.end(), {"--advertise", advertise});
      }
      DEEPNEX_RETURN_IF_ERROR(StartContainer(spec, who).status());
      // On another node, the server says where it can be reached.
      ps_addrs_.push_back(placed_ ? "" : JoinHostPort(local ? "127.0.0.1" : advertise, port));
    }
    for (int i = 0; i < o_.ps; ++i) {
      DEEPNEX_ASSIGN_OR_RETURN(ps_addrs_[i], AwaitServer(absl::StrCat("ps ", i), ps_addrs_[i]));
    }

    DEEPNEX_ASSIGN_OR_RETURN(master_port_, ReservePort());
    if (placed_) {
      DEEPNEX_ASSIGN_OR_RETURN(master_addr_, allocations_->AgentAddress(grants_[0].node));
      if (master_addr_.empty()) master_addr_ = grants_[0].node;
    }
    if (IsElastic(o_)) {
      DEEPNEX_ASSIGN_OR_RETURN(auto elastic, Elastic::Start(ElasticFor(request), grants_));
      std::lock_guard<std::mutex> lock(handles_mu_);
      elastic_ = std::move(elastic);
      grants_.clear();  // the members' now
    }
    for (int rank = 0; !elastic_ && rank < o_.workers; ++rank) {
      WorkerStart w{rank, rank, 0, {}, grants_[rank]};
      for (const auto& g : grants_) w.nodes.push_back(g.node);
      DEEPNEX_RETURN_IF_ERROR(StartWorker(w).status());
    }
    WriteRecord();
    if (reporter_) reporter_->Run();
    return absl::OkStatus();
  }

  // Starts worker `w` with the job environment of its generation; an
  // elastic one's also names its id and the generation, and is never
  // restarted in place (Elastic replaces it under the policy).
  absl::StatusOr<std::shared_ptr<launch::Handle>> StartWorker(const WorkerStart& w) {
    // As torchrun: the rank and count of this worker among those on its
    // node.
    int local_rank = 0, local_world_size = 0;
    for (size_t other = 0; other < w.nodes.size(); ++other) {
      if (w.nodes[other] != w.allocation.node) continue;
      if (static_cast<int>(other) < w.rank) ++local_rank;
      ++local_world_size;
    }
    Context ctx;
    ctx.job_id = o_.name;
    ctx.role = Role::kWorker;
    ctx.rank = w.rank;
    ctx.world_size = static_cast<int>(w.nodes.size());
    ctx.local_rank = local_rank;
    ctx.ps_addrs = ps_addrs_;
    ctx.store_addr = store_->address();
    ctx.token = token_;
    launch::ContainerSpec spec = SpecOf("worker", absl::StrCat(o_.name, "-worker", w.id));
    spec.image = o_.image;
    if (o_.image != "host") spec.working_dir = o_.working_dir;
    spec.command = o_.command;
    spec.env = UserEnv();
    // torchrun's default keeps N workers from each starting a thread per
    // core of the machine; here a worker gets the cores it was granted.
    if (!spec.env.count("OMP_NUM_THREADS")) {
      double cores = o_.cpus > 0 ? o_.cpus : w.allocation.cpus;
      spec.env["OMP_NUM_THREADS"] = absl::StrCat(std::max(1, static_cast<int>(cores)));
    }
    for (const auto& [k, v] : ctx.ToEnv()) spec.env[k] = v;
    spec.env["LOCAL_WORLD_SIZE"] = absl::StrCat(local_world_size);
    // torchrun's rank 0 serves its own TCPStore on MASTER_PORT, so that
    // must be a free port, not the job's store; and on MASTER_ADDR, which
    // is rank 0's node when the backend placed the workers (the address
    // its agent advertises, else its name).
    spec.env["MASTER_PORT"] = absl::StrCat(master_port_);
    if (placed_) spec.env["MASTER_ADDR"] = master_addr_;
    spec.restart = o_.restart;
    if (w.generation > 0) {
      spec.env["DEEPNEX_ELASTIC"] = absl::StrCat(o_.min_workers, ":", o_.workers);
      spec.env["DEEPNEX_WORKER_ID"] = absl::StrCat("w", w.id);
      spec.env["DEEPNEX_ELASTIC_GENERATION"] = absl::StrCat(w.generation);
      spec.restart = launch::RestartPolicy{};
    }
    spec.allocation = w.allocation;
    spec.memory = o_.memory;
    DEEPNEX_ASSIGN_OR_RETURN(auto h, StartContainer(spec, absl::StrCat("worker ", w.id)));
    std::lock_guard<std::mutex> lock(handles_mu_);
    workers_.push_back(h);
    return h;
  }

  // A worker's environment before the job's own variables: what passes
  // of the runner's (in the host image), then the job's env.
  std::map<std::string, std::string> UserEnv() const {
    std::map<std::string, std::string> env;
    if (o_.image == "host") env = InheritedEnv(/*as_another_user=*/o_.launcher.backend == "central");
    for (const auto& [k, v] : o_.env) env[k] = v;
    return env;
  }

  // How the job's Elastic grants, starts and releases workers like
  // `request`'s.
  ElasticOptions ElasticFor(gpu::Request request) {
    ElasticOptions e;
    e.min_workers = o_.min_workers;
    e.max_workers = o_.workers;
    // The workers' collective timeout, as deepnex.elastic reads it (one it
    // refuses fails the workers first).
    const std::map<std::string, std::string> env = UserEnv();
    auto timeout = env.find("DEEPNEX_ELASTIC_TIMEOUT");
    double seconds;
    if (timeout != env.end() && absl::SimpleAtod(timeout->second, &seconds) && seconds > 0 &&
        std::isfinite(seconds)) {
      e.stalled_after = milliseconds(static_cast<int64_t>(std::ceil(std::min(seconds, 1e9) * 1000)));
    }
    e.restart = o_.restart;
    e.launcher = o_.launcher;
    e.store.address = store_->address();
    e.store.token = token_;
    e.store.timeout = milliseconds(5000);
    request.replicas = 1;
    e.grant = [this, request](int priority) mutable -> absl::StatusOr<gpu::Allocation> {
      request.priority = priority;
      DEEPNEX_ASSIGN_OR_RETURN(auto got, allocations_->Grow(request, milliseconds(1000)));
      // A backend that runs here cannot use another node's grant.
      if (placed_ || got[0].node == HostName()) return got[0];
      allocations_->Release(got[0].id).IgnoreError();
      return absl::ResourceExhaustedError(absl::StrCat("granted on node ", got[0].node));
    };
    e.start = [this](const WorkerStart& w) { return StartWorker(w); };
    e.release = [this](const gpu::Allocation& a) { allocations_->Release(a.id).IgnoreError(); };
    if (placed_) e.nodes = [this] { return allocations_->Nodes(); };
    e.on_event = o_.on_event;
    e.on_resize = [this] {
      if (reporter_) reporter_->Poke();
    };
    return e;
  }

  // The backends that run every container on this host.
  // Kubernetes runs pods on the pod network (its pods take no host network),
  // where this host's loopback is the pod's own.
  bool OnPodNetwork() const { return o_.launcher.backend == "kubernetes"; }

  static bool RunsHere(const std::string& backend) {
    return backend == "process" || backend == "oci" || backend == "docker";
  }

  // With deepnex-central, a backend that runs everything here gives way to
  // central's agents when it has any: each worker and parameter server then
  // runs on its allocation's node, started, followed and stopped through
  // central and that node's deepnex-agent (whose own --backend applies).
  // `nodes` gets the agents' nodes; none: the local launcher stays.
  absl::Status UseAgents(std::vector<gpu::Node>* nodes) {
    launch::LauncherOptions via = o_.launcher;
    via.backend = "central";
    via.central.address = o_.central;
    via.central.token = o_.central_token;
    via.central.token_file = o_.central_token_file;
    DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<launch::Launcher> central,
                             launch::Launcher::Create(via));
    DEEPNEX_ASSIGN_OR_RETURN(*nodes, central->Nodes());
    if (nodes->empty()) return absl::OkStatus();
    launcher_ = std::move(central);
    o_.launcher = via;
    return absl::OkStatus();
  }

  // The job as deepnex-central records it (JobReporter's snapshot): pending
  // until its containers started.
  gpu::JobRecord JobNow() {
    gpu::JobRecord r;
    r.name = o_.name;
    r.user = o_.user;
    r.command = o_.command;
    r.mode = o_.mode;
    // An elastic job waits for its least; running, it says how many it has.
    r.min_workers = r.workers = IsElastic(o_) ? o_.min_workers : o_.workers;
    r.max_workers = o_.workers;
    r.ps = o_.ps;
    r.notify = o_.notify;
    r.notify_every = o_.notify_every;
    r.notify_when = o_.notify_when;
    r.report = LastReport();
    for (const auto& a : Allocations()) {
      r.allocations.push_back(
          {a.id, a.node, static_cast<int>(a.gpus.size()), a.cpus, a.memory});
      if (std::find(r.nodes.begin(), r.nodes.end(), a.node) == r.nodes.end()) {
        r.nodes.push_back(a.node);
      }
    }
    std::vector<std::shared_ptr<launch::Handle>> handles;
    {
      std::lock_guard<std::mutex> lock(handles_mu_);
      handles = handles_;
      r.state = workers_.empty() ? gpu::JobState::kPending : gpu::JobState::kRunning;
      if (elastic_) {
        r.workers = elastic_->size();
        r.resizes = elastic_->resizes();
        r.last_resize = elastic_->last_resize();
        r.restarts = elastic_->restarts();
      }
    }
    for (const auto& h : handles) {
      launch::ContainerStatus st = h->Status();
      const launch::ContainerSpec& spec = h->spec();
      gpu::JobContainer c;
      c.name = st.name;
      c.node = spec.allocation ? spec.allocation->node : HostName();
      auto role = spec.labels.find("deepnex.role");
      if (role != spec.labels.end()) c.role = role->second;
      c.state = launch::StateName(st.state);
      c.restarts = st.restarts;
      if (st.last_exit) c.last_exit = st.last_exit->ToString();
      absl::StatusOr<launch::Usage> usage = h->Usage();
      if (usage.ok()) {
        c.cpu_seconds = usage->cpu_seconds;
        c.memory_peak = usage->memory_peak;
      }
      r.restarts += st.restarts;
      r.containers.push_back(std::move(c));
    }
    return r;
  }

  // Rank 0's last deepnex.report(), which its worker keeps at kReportKey
  // in the job's store (python/deepnex/_tune_report.py); none (the epoch)
  // until there is one. Best effort: a value that does not parse is skipped.
  gpu::JobReport LastReport() {
    gpu::JobReport out;
    if (!store_) return out;
    if (!report_client_) {
      collective::StoreClientOptions co;
      co.address = store_->address();
      co.token = token_;
      co.timeout = milliseconds(1000);
      auto client = collective::StoreClient::Create(co);
      if (!client.ok()) return out;
      report_client_ = std::move(*client);
    }
    auto set = report_client_->Check({kReportKey});
    if (!set.ok() || !(*set)[0]) return out;
    auto value = report_client_->Get(kReportKey, milliseconds(1000));
    if (!value.ok()) return out;
    return ParseReport(*value);
  }

  // job.json for `deepnex top`; best effort (a full /tmp must not fail a
  // job that runs).
  void WriteRecord() {
    nlohmann::json allocations = nlohmann::json::array();
    for (const auto& a : Allocations()) {
      nlohmann::json gpus = nlohmann::json::array();
      for (const auto& g : a.gpus) gpus.push_back(g.index);
      allocations.push_back({{"id", a.id}, {"node", a.node}, {"gpus", gpus},
                             {"cpus", a.cpus}, {"memory", a.memory}});
    }
    nlohmann::json r = {
        {"name", o_.name},          {"pid", getpid()},
        {"mode", o_.mode},          {"workers", o_.workers},
        {"ps", o_.ps},              {"backend", o_.launcher.backend},
        {"user", o_.user},          {"state_dir", o_.launcher.state_dir},
        {"allocations", allocations},
        {"started_at", std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count()}};
    if (MakeDirectories(job_dir_).ok()) {
      WriteFileAtomically(job_dir_ + "/job.json", r.dump(1) + "\n").IgnoreError();
    }
  }

  // What the job's workers and parameter servers share: where they run,
  // for whom, and the labels that tell them apart.
  launch::ContainerSpec SpecOf(const std::string& role, const std::string& name) {
    launch::ContainerSpec spec;
    spec.name = name;
    spec.working_dir = o_.working_dir.empty() ? CurrentDir() : o_.working_dir;
    spec.mounts = o_.mounts;
    spec.user = o_.user;
    spec.cpus = o_.cpus;
    spec.labels["deepnex.job"] = o_.name;
    spec.labels["deepnex.role"] = role;
    return spec;
  }

  launch::ContainerSpec PsSpec(int i, const std::string& addr) {
    launch::ContainerSpec spec = SpecOf("ps", absl::StrCat(o_.name, "-ps", i));
    // The server's own name (its checkpoint is <dir>/ps<i>.ckpt) stays the
    // same across jobs, so a new job can restore an old job's checkpoint.
    std::vector<std::string>& c = spec.command;
    c = {o_.ps_binary, "--listen", addr, "--mode", ps_mode_, "--workers",
         absl::StrCat(o_.workers), "--optimizer", o_.optimizer,
         "--momentum", ShortestDouble(o_.momentum), "--job", o_.name,
         "--name", absl::StrCat("ps", i)};
    // Else the server's default for its optimizer.
    if (o_.lr.has_value()) c.insert(c.end(), {"--lr", ShortestDouble(*o_.lr)});
    if (ps_mode_ == "ssp") {
      c.insert(c.end(), {"--staleness", absl::StrCat(staleness_)});
    }
    if (!o_.checkpoint_dir.empty()) {
      // Restored when a checkpoint is there: a server restarted by its
      // policy comes back with what it had.
      c.insert(c.end(), {"--checkpoint-dir", o_.checkpoint_dir, "--checkpoint-every", "1",
                         "--restore", o_.checkpoint_dir, "--restore-if-present"});
    }
    spec.env = InheritedEnv(/*as_another_user=*/o_.launcher.backend == "central");
    // Not on the command line, which every user of the machine can read in
    // /proc; deepnex-ps reads $DEEPNEX_TOKEN.
    spec.env["DEEPNEX_TOKEN"] = token_;
    spec.restart = o_.restart;
    return spec;
  }

  // Keeps where the server `who` says it listens, for AwaitServer.
  void NoteListening(const std::string& who, const std::string& line) {
    static constexpr char kListening[] = "deepnex-ps listening on ";
    if (line.rfind(kListening, 0) != 0) return;
    std::string address = line.substr(sizeof(kListening) - 1);
    address = address.substr(0, address.find(' '));
    std::lock_guard<std::mutex> lock(listening_mu_);
    listening_[who] = address;
  }

  // Starts `spec` as `who` ("worker 0"): its output and restarts are told
  // under that name.
  absl::StatusOr<std::shared_ptr<launch::Handle>> StartContainer(launch::ContainerSpec spec,
                                                                 const std::string& who) {
    DEEPNEX_RETURN_IF_ERROR(StopAsked());
    // The job's store and parameter servers listen on this host's
    // addresses; a pod reaches them from the pod network.
    spec.host_network = !OnPodNetwork();
    spec.on_restart = [this, who](const launch::RestartEvent& e) {
      if (reporter_) reporter_->Poke();
      o_.on_event(absl::StrCat(who, " ", e.ToString()));
    };
    DEEPNEX_ASSIGN_OR_RETURN(std::shared_ptr<launch::Handle> h, launcher_->Start(spec));
    std::lock_guard<std::mutex> lock(handles_mu_);
    handles_.push_back(h);
    who_[h.get()] = who;
    log_threads_.emplace_back([this, h, who] {
      std::string partial;
      h->FollowLogs([&](const std::string& chunk) {
         if (quiet_) return false;
         // Only the new chunk is searched, and the lines taken at once: a
         // 200 MB line was searched again with each chunk.
         size_t start = 0, nl = partial.size();
         partial += chunk;
         while ((nl = partial.find('\n', nl)) != std::string::npos) {
           const std::string line = partial.substr(start, nl - start);
           NoteListening(who, line);
           o_.output(who, line);
           start = ++nl;
         }
         partial.erase(0, start);
         // A line past kMaxLine is shown in pieces rather than held whole.
         for (; partial.size() >= kMaxLine; partial.erase(0, kMaxLine)) {
           o_.output(who, partial.substr(0, kMaxLine));
         }
         return true;
       }).IgnoreError();
      if (!partial.empty() && !quiet_) o_.output(who, partial);
    });
    return h;
  }

  // Waits until the server `who` ("ps 0") at `address` accepts connections;
  // `address` empty: until it printed where it listens ("deepnex-ps
  // listening on HOST:PORT ...", as it does on another node), then there.
  // Returns the address.
  absl::StatusOr<std::string> AwaitServer(const std::string& who, std::string address) {
    auto deadline = Clock::now() + std::chrono::seconds(30);
    for (;;) {
      if (address.empty()) {
        std::lock_guard<std::mutex> lock(listening_mu_);
        auto it = listening_.find(who);
        if (it != listening_.end()) address = it->second;
      }
      if (!address.empty()) {
        const size_t colon = address.rfind(':');
        int port = 0;
        if (absl::SimpleAtoi(address.substr(colon + 1), &port) &&
            Connects(HostOf(address), port)) {
          return address;
        }
      }
      for (const auto& h : handles_) {
        launch::ContainerStatus st = h->Status();
        if (st.state == launch::State::kExited) {
          return absl::UnavailableError(absl::StrCat(
              "parameter server ", st.name, " ended before serving: ",
              st.last_exit ? st.last_exit->ToString() : "no status"));
        }
      }
      DEEPNEX_RETURN_IF_ERROR(StopAsked());
      if (Clock::now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "parameter server ", who, address.empty() ? " did not say where it listens"
                                                      : " on " + address + " did not serve",
            " within 30 s"));
      }
      std::this_thread::sleep_for(milliseconds(20));
    }
  }

  absl::Status Stopped() const {
    return absl::CancelledError(absl::StrCat("job ", o_.name, " was stopped while it started"));
  }
  // Cancelled once Stop was called: a start goes no further.
  absl::Status StopAsked() {
    std::lock_guard<std::mutex> lock(start_mu_);
    return stop_asked_ ? Stopped() : absl::OkStatus();
  }

  static std::string CurrentDir() {
    char buf[4096];
    return getcwd(buf, sizeof(buf)) != nullptr ? buf : "/";
  }

  JobOptions o_;
  std::string ps_mode_;  // empty for allreduce
  int staleness_ = 0;
  std::string token_;
  std::string job_dir_;
  Clock::time_point started_;
  std::unique_ptr<AllocationSource> allocations_;
  std::vector<gpu::Allocation> grants_;     // the workers', by rank
  std::vector<gpu::Allocation> ps_grants_;  // the parameter servers' (placed_ only)
  // The backend places containers on nodes (Launcher::Nodes), not on this
  // host.
  bool placed_ = false;
  std::mutex listening_mu_;
  std::map<std::string, std::string> listening_;  // who -> the address it printed
  std::unique_ptr<collective::StoreServer> store_;
  std::unique_ptr<launch::Launcher> launcher_;
  // The process backend's: sweeps the containers if this process is killed
  // (set by StartAll, told by Shutdown).
  std::unique_ptr<Sweeper> sweeper_;
  std::vector<std::shared_ptr<launch::Handle>> handles_;
  std::vector<std::shared_ptr<launch::Handle>> workers_;
  // Who each container is ("worker 0"), and those a stop left running.
  std::map<const launch::Handle*, std::string> who_;
  std::set<const launch::Handle*> unstopped_;
  // Each worker's wait in its engine's queue (Queued), by rank: since
  // when, and what was told of it.
  struct QueuedWorker {
    Clock::time_point since;
    std::string told;
  };
  std::map<size_t, QueuedWorker> queued_;
  std::vector<std::string> ps_addrs_;  // the workers' DEEPNEX_PS_ADDRS
  int master_port_ = 0;
  std::string master_addr_;
  // Guards handles_, workers_, who_, unstopped_, log_threads_ and elastic_, which an elastic
  // job's thread adds to while others read.
  std::mutex handles_mu_;
  // An elastic job's membership (null: a job of fixed size).
  std::unique_ptr<Elastic> elastic_;
  std::vector<std::thread> log_threads_;
  // Set by Stop: the workers' output still unread is not shown.
  std::atomic<bool> quiet_{false};
  std::mutex stop_mu_;
  // A Start in progress and whether Stop was called (guarded by start_mu_,
  // as is the assignment of allocations_, which Stop cancels).
  std::mutex start_mu_;
  std::condition_variable start_cv_;
  bool starting_ = false;
  bool stop_asked_ = false;
  int stop_signal_ = 0;  // the first Stop's
  int stops_running_ = 0;  // Stops between their start and their Shutdown's end
  bool ended_ = false;   // a Wait saw the job end by itself
  // With deepnex-central: keeps the job's record there (null without).
  std::unique_ptr<gpu::JobReporter> reporter_;
  // LastReport's; JobNow's callers never overlap (JobReporter's snapshot).
  std::unique_ptr<collective::StoreClient> report_client_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Job>> Job::Create(const JobOptions& options) {
  auto job = std::make_unique<JobImpl>(options);
  DEEPNEX_RETURN_IF_ERROR(job->Init());
  return job;
}

absl::StatusOr<JobResult> RunJob(const JobOptions& options) {
  DEEPNEX_ASSIGN_OR_RETURN(auto job, Job::Create(options));
  DEEPNEX_RETURN_IF_ERROR(job->Start());
  return job->Wait(milliseconds::max());
}

}  // namespace deepnex::job
