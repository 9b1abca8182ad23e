// JobsClient (include/deepnex/gpu/jobs.h) and the runner's JobReporter:
// blocking unary calls to deepnex-central's Jobs service (jobs_store.cc).
#include <random>

#include "absl/strings/str_cat.h"
#include "deepnex/jobs.grpc.pb.h"
#include "gpu/central_call.h"
#include "gpu/jobs_reporter.h"
#include "gpu/jobs_store.h"

namespace deepnex::gpu {
namespace {

class JobsClientImpl final : public JobsClient {
 public:
  explicit JobsClientImpl(CentralCaller caller)
      : caller_(std::move(caller)), stub_(pb::Jobs::NewStub(caller_.channel())) {}

  absl::StatusOr<std::vector<JobRecord>> List(const JobFilter& filter) override {
    if (!filter.state.empty()) {
      DEEPNEX_RETURN_IF_ERROR(ParseJobState(filter.state, "state").status());
    }
    pb::JobsRequest req;
    req.set_all(filter.all);
    req.set_user(filter.user);
    req.set_state(filter.state);
    req.set_since_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                         filter.since.time_since_epoch())
                         .count());
    pb::JobList reply;
    DEEPNEX_RETURN_IF_ERROR(
        caller_.Call(req, [&](auto* ctx) { return stub_->ListJobs(ctx, req, &reply); }));
    std::vector<JobRecord> out;
    for (const pb::Job& j : reply.jobs()) {
      DEEPNEX_ASSIGN_OR_RETURN(JobRecord r, FromProto(j));
      out.push_back(std::move(r));
    }
    return out;
  }

  absl::StatusOr<JobRecord> Get(const std::string& name) override {
    pb::JobName req;
    req.set_name(name);
    pb::Job reply;
    DEEPNEX_RETURN_IF_ERROR(
        caller_.Call(req, [&](auto* ctx) { return stub_->GetJob(ctx, req, &reply); }));
    return FromProto(reply);
  }

  absl::StatusOr<JobRecord> Cancel(const std::string& name) override {
    pb::JobName req;
    req.set_name(name);
    pb::Job reply;
    DEEPNEX_RETURN_IF_ERROR(
        caller_.Call(req, [&](auto* ctx) { return stub_->CancelJob(ctx, req, &reply); }));
    return FromProto(reply);
  }

  absl::StatusOr<JobRecord> Report(const JobRecord& job, const std::string& run) override {
    pb::Job req;
    ToProto(job, &req);
    req.set_run(run);
    pb::Job reply;
    DEEPNEX_RETURN_IF_ERROR(
        caller_.Call(req, [&](auto* ctx) { return stub_->ReportJob(ctx, req, &reply); }));
    return FromProto(reply);
  }

 private:
  const CentralCaller caller_;
  std::unique_ptr<pb::Jobs::Stub> stub_;
};

std::string RunId() {
  std::random_device rd;
  return absl::StrCat(absl::Hex(rd(), absl::kZeroPad8), absl::Hex(rd(), absl::kZeroPad8));
}

}  // namespace

absl::StatusOr<std::unique_ptr<JobsClient>> JobsClient::Create(
    const CentralClientOptions& options) {
  DEEPNEX_ASSIGN_OR_RETURN(CentralCaller caller, CentralCaller::Connect(options));
  return std::unique_ptr<JobsClient>(std::make_unique<JobsClientImpl>(std::move(caller)));
}

JobReporter::JobReporter(std::unique_ptr<JobsClient> client, Snapshot snapshot,
                         std::chrono::milliseconds every)
    : client_(std::move(client)), snapshot_(std::move(snapshot)), every_(every), run_(RunId()) {}

JobReporter::~JobReporter() { StopThread(); }

absl::StatusOr<std::unique_ptr<JobReporter>> JobReporter::Register(
    const CentralClientOptions& options, Snapshot snapshot, std::chrono::milliseconds every) {
  // A report that hangs on a central that is gone would hold the job up.
  CentralClientOptions o = options;
  o.timeout = std::min(o.timeout, std::chrono::milliseconds(5000));
  DEEPNEX_ASSIGN_OR_RETURN(auto client, JobsClient::Create(o));
  auto reporter = std::unique_ptr<JobReporter>(
      new JobReporter(std::move(client), std::move(snapshot), every));
  reporter->registered_ = reporter->snapshot_();
  DEEPNEX_RETURN_IF_ERROR(reporter->Send(reporter->registered_));
  reporter->thread_ = std::thread([r = reporter.get()] { r->Loop(); });
  return reporter;
}

absl::Status JobReporter::Send(const JobRecord& job) {
  DEEPNEX_ASSIGN_OR_RETURN(JobRecord reply, client_->Report(job, run_));
  if (reply.state == JobState::kCancelled && !cancelled_.load()) {
    std::lock_guard<std::mutex> lock(mu_);
    cancel_message_ = absl::StrCat("job ", job.name, " was cancelled by ", reply.cancelled_by,
                                   " through deepnex-central");
    cancelled_.store(true);
  }
  return absl::OkStatus();
}

std::string JobReporter::cancel_message() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cancel_message_;
}

void JobReporter::Run() {
  std::lock_guard<std::mutex> lock(mu_);
  running_ = true;
  poked_ = true;
  cv_.notify_all();
}

absl::Status JobReporter::ReportNow() {
  std::lock_guard<std::mutex> reporting(report_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return absl::OkStatus();
  }
  return Send(snapshot_());
}

void JobReporter::Poke() {
  std::lock_guard<std::mutex> lock(mu_);
  poked_ = true;
  cv_.notify_all();
}

void JobReporter::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait_for(lock, every_, [this] { return poked_ || stopping_; });
    if (stopping_) return;
    poked_ = false;
    const bool running = running_;
    lock.unlock();
    {
      std::lock_guard<std::mutex> reporting(report_mu_);
      // Best effort: the next report carries the same and more.
      Send(running ? snapshot_() : registered_).IgnoreError();
    }
    lock.lock();
  }
}

void JobReporter::StopThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

absl::Status JobReporter::Finish(JobState state, int exit_code, const std::string& message,
                                 std::chrono::milliseconds patience) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return absl::OkStatus();
    finished_ = true;
  }
  StopThread();
  std::lock_guard<std::mutex> reporting(report_mu_);
  JobRecord job = snapshot_();
  job.state = state;
  job.exit_code = exit_code;
  job.message = message;
  const auto deadline = std::chrono::steady_clock::now() + patience;
  for (;;) {
    absl::Status s = Send(job);
    if (s.ok() || s.code() != absl::StatusCode::kUnavailable ||
        std::chrono::steady_clock::now() >= deadline) {
      return s;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace deepnex::gpu
