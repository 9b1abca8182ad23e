#include "deepnex/ps/server.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/file_util.h"
#include "core/grpc_util.h"
#include "core/net.h"
#include "deepnex/auth.h"
#include "deepnex/metrics.h"
#include "deepnex/units.h"
#include "ps/service.h"

namespace deepnex::ps {

const char* ModeName(Mode mode) {
  switch (mode) {
    case Mode::kSync: return "sync";
    case Mode::kSsp: return "ssp";
    case Mode::kAsync: return "async";
  }
  return "?";
}

absl::StatusOr<Mode> ParseMode(const std::string& name) {
  for (Mode m : {Mode::kSync, Mode::kSsp, Mode::kAsync}) {
    if (name == ModeName(m)) return m;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("mode: unknown \"", name, "\" (one of sync, ssp, async)"));
}

const char* LeasePolicyName(LeasePolicy policy) {
  return policy == LeasePolicy::kShrink ? "shrink" : "abort";
}

absl::StatusOr<LeasePolicy> ParseLeasePolicy(const std::string& name) {
  if (name == "shrink") return LeasePolicy::kShrink;
  if (name == "abort") return LeasePolicy::kAbort;
  return absl::InvalidArgumentError(
      absl::StrCat("lease policy: unknown \"", name, "\" (one of shrink, abort)"));
}

const char* ReductionName(Reduction reduction) {
  return reduction == Reduction::kMean ? "mean" : "sum";
}

absl::StatusOr<Reduction> ParseReduction(const std::string& name) {
  if (name == "mean") return Reduction::kMean;
  if (name == "sum") return Reduction::kSum;
  return absl::InvalidArgumentError(
      absl::StrCat("reduction: unknown \"", name, "\" (one of mean, sum)"));
}

absl::Status ServerOptions::Validate() const {
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(what); };
  if (num_workers < 1 || num_workers > kMaxWorkers) {
    return bad(absl::StrCat("num_workers=", num_workers, ": must be 1..", kMaxWorkers));
  }
  if (address.empty()) return bad("address is empty");
  DEEPNEX_RETURN_IF_ERROR(ValidateAdvertiseHost("advertise", advertise));
  if (max_message_bytes < 1024) {
    return bad(absl::StrCat("max_message_bytes=", max_message_bytes,
                            ": must be at least 1024"));
  }
  if (max_pending_reply_bytes == 0) return bad("max_pending_reply_bytes=0: must be positive");
  if (max_deferred_push_bytes == 0) return bad("max_deferred_push_bytes=0: must be positive");
  if (ModeName(mode)[0] == '?') {
    return bad(absl::StrCat("mode=", static_cast<int>(mode), ": not a Mode (sync, ssp, async)"));
  }
  if (staleness < 0) return bad(absl::StrCat("staleness=", staleness, ": must be >= 0"));
  if (staleness > 0 && mode != Mode::kSsp) {
    return bad(absl::StrCat("staleness=", staleness, ": only mode ssp takes a staleness (",
                            ModeName(mode), " is ", mode == Mode::kSync ? "0" : "unbounded",
                            ")"));
  }
  DEEPNEX_RETURN_IF_ERROR(CheckMillis(lease_timeout, "lease_timeout"));
  DEEPNEX_RETURN_IF_ERROR(CheckMillis(checkpoint_interval, "checkpoint_interval", true));
  if (heartbeat_interval.count() < 0 || heartbeat_interval >= lease_timeout) {
    return bad(absl::StrCat("heartbeat_interval=", heartbeat_interval.count(),
                            "ms: must be >= 0 and below lease_timeout (",
                            lease_timeout.count(), "ms)"));
  }
  if ((checkpoint_every_rounds > 0 || checkpoint_interval.count() > 0) &&
      checkpoint_dir.empty()) {
    return bad("periodic checkpoints need checkpoint_dir");
  }
  if (name.empty() || name.find('/') != std::string::npos) {
    return bad(absl::StrCat("name=\"", name, "\": must be a plain file name"));
  }
  return optimizer.Validate();
}

namespace {

using Clock = std::chrono::steady_clock;

class ServerImpl final : public Server {
 public:
  ServerImpl(const ServerOptions& options, TokenTable tokens, bool job_token)
      : options_(options), service_(options, std::move(tokens), job_token) {}
  ~ServerImpl() override { Stop(); }

  absl::Status Start() {
    if (!options_.checkpoint_dir.empty()) {
      DEEPNEX_RETURN_IF_ERROR(LockCheckpointDir(options_.checkpoint_dir, "checkpoint_dir"));
    }
    if (!options_.restore_dir.empty()) {
      DEEPNEX_RETURN_IF_ERROR(service_.Restore(options_.restore_dir));
    }
    ServerHostOptions host;
    host.what = "ps server";
    host.address = options_.address;
    host.advertise = options_.advertise;
    host.tls_cert_file = options_.tls_cert_file;
    host.tls_key_file = options_.tls_key_file;
    host.max_receive_bytes = options_.max_message_bytes;
    DEEPNEX_ASSIGN_OR_RETURN(host_, ServerHost::Start(host, {&service_}));
    if (!options_.metrics_address.empty()) {
      DEEPNEX_ASSIGN_OR_RETURN(
          metrics_http_,
          MetricsHttpServer::Create(
              service_.registry(), options_.metrics_address,
              [this](const std::string& authorization) {
                return service_.AuthorizeMetrics(authorization);
              }));
    }
    background_ = std::thread([this] { Background(); });
    return absl::OkStatus();
  }

  std::string address() const override { return host_->address(); }
  int port() const override { return host_->port(); }

  void Stop() override {
    // A forked child's copy: its threads are the parent's (joining the
    // background thread here crashed the child).
    if (InForkedChild()) return;
    std::call_once(stop_once_, [this] {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
      }
      cv_.notify_all();
      if (background_.joinable()) background_.join();
      if (metrics_http_) metrics_http_->Stop();
      service_.StopBulk();
      if (!host_) return;
      service_.FailWaiters(absl::UnavailableError("the parameter server is stopping"));
      host_->Stop();
      // No checkpoint is being written now: the name is free for others.
      std::lock_guard<std::mutex> lock(checkpoint_locks_mu_);
      checkpoint_locks_.clear();
    });
  }

  void Wait() override { host_->Wait(); }

  absl::StatusOr<uint64_t> Checkpoint(const std::string& dir,
                                      std::chrono::milliseconds timeout) override {
    // An empty directory was an Internal "cannot create directory" error,
    // and a negative timeout DeadlineExceeded "within -5 ms" (probe).
    if (dir.empty()) return absl::InvalidArgumentError("checkpoint: the directory is empty");
    // A forked child wrote its copy of the tensors and took the name's lock.
    DEEPNEX_RETURN_IF_ERROR(CheckForkSafe("ps server"));
    DEEPNEX_RETURN_IF_ERROR(CheckMillis(timeout, "checkpoint: timeout", /*zero_ok=*/true));
    DEEPNEX_RETURN_IF_ERROR(LockCheckpointDir(dir, "checkpoint directory"));
    bool stopped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped = stopping_;
    }
    if (!stopped) return service_.WriteCheckpoint(dir, timeout);
    // A stopped server completes no more rounds: one behind was waited for
    // until the timeout (60 s by default) for nothing.
    absl::StatusOr<uint64_t> round = service_.WriteCheckpoint(dir, std::chrono::milliseconds(0));
    if (absl::IsDeadlineExceeded(round.status())) {
      return absl::FailedPreconditionError(absl::StrCat(
          round.status().message(), "; the server is stopped and completes no more rounds"));
    }
    return round;
  }

  int metrics_port() const override { return metrics_http_ ? metrics_http_->port() : 0; }
  std::string MetricsText() const override { return service_.MetricsText(); }

 private:
  // Holds <dir>/<name>.lock from the first checkpoint into `dir` until the
  // server ends: another server of this name, in this process or another,
  // would replace this one's NAME.ckpt there without a word. Per name, not
  // per directory: a job's servers share one directory, each with its file.
  absl::Status LockCheckpointDir(const std::string& dir, const char* what) {
    std::error_code ignored;  // an unresolvable path is its own key
    std::string key = std::filesystem::weakly_canonical(dir, ignored).string();
    if (key.empty()) key = dir;
    std::lock_guard<std::mutex> lock(checkpoint_locks_mu_);
    if (checkpoint_locks_.count(key) != 0) return absl::OkStatus();
    absl::StatusOr<std::unique_ptr<DirectoryLock>> held = DirectoryLock::Acquire(
        dir, options_.name + ".lock", absl::StrCat("ps \"", options_.name, "\": ", what));
    // Only for a lock another holds: a read-only directory or a link
    // planted as the lock file ("cannot open ...") was told to stop a server
    // that was not there.
    if (absl::IsFailedPrecondition(held.status()) &&
        absl::StrContains(held.status().message(), " is in use by ")) {
      return absl::FailedPreconditionError(
          absl::StrCat(held.status().message(),
                       "; stop that server, or give servers that share a directory names of "
                       "their own"));
    }
    DEEPNEX_RETURN_IF_ERROR(held.status());
    checkpoint_locks_.emplace(key, *std::move(held));
    return absl::OkStatus();
  }

  // Expires leases and writes periodic checkpoints until Stop().
  void Background() {
    const auto tick = std::clamp(options_.lease_timeout / 4, std::chrono::milliseconds(5),
                                 std::chrono::milliseconds(250));
    auto last_checkpoint = Clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      cv_.wait_for(lock, tick);
      if (stopping_) break;
      lock.unlock();
      service_.ExpireLeases();
      if (options_.checkpoint_every_rounds > 0) Report(service_.WritePeriodic());
      if (options_.checkpoint_interval.count() > 0 &&
          Clock::now() - last_checkpoint >= options_.checkpoint_interval) {
        Report(service_.WriteCheckpoint(options_.checkpoint_dir, std::chrono::seconds(30))
                   .status());
        last_checkpoint = Clock::now();
      }
      lock.lock();
    }
  }

  // A periodic checkpoint that failed leaves the previous one in place;
  // say so where an operator looks, and try again next time. Once per
  // failure, not per try: a full disk printed a line every tick (250 ms)
  // until it was freed. deepnex_ps_checkpoint_failures_total counts them.
  void Report(const absl::Status& status) {
    if (status.ok()) {
      if (!last_failure_.empty() && service_.checkpoints_written() != written_at_failure_) {
        std::fprintf(stderr, "deepnex ps %s: periodic checkpoints are written again\n",
                     options_.name.c_str());
        last_failure_.clear();
      }
      return;
    }
    const std::string message(status.message());
    if (message == last_failure_) return;
    last_failure_ = message;
    written_at_failure_ = service_.checkpoints_written();
    std::fprintf(stderr,
                 "deepnex ps %s: periodic checkpoint failed: %s (said again when that "
                 "changes; deepnex_ps_checkpoint_failures_total counts every try)\n",
                 options_.name.c_str(), message.c_str());
  }

  const ServerOptions options_;
  std::mutex checkpoint_locks_mu_;
  // By canonical directory; released when the server stops.
  std::map<std::string, std::unique_ptr<DirectoryLock>> checkpoint_locks_;
  Service service_;
  std::unique_ptr<ServerHost> host_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  std::once_flag stop_once_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;  // guarded by mu_
  std::thread background_;
  // Report's, on the background thread: the failure said last, and the
  // checkpoints written when it was.
  std::string last_failure_;
  uint64_t written_at_failure_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Create(const ServerOptions& options) {
  DEEPNEX_RETURN_IF_ERROR(options.Validate());
  DEEPNEX_ASSIGN_OR_RETURN(TokenTable tokens,
                           TokenTable::FromOptions(options.token, options.token_file));
  // A token given alone is the job's (what its launcher hands every
  // process); a token file of named lines has admins, users and jobs. A
  // file's first line that is one field and a token of the table can only
  // be a file of the token alone, as a line of a table has three fields.
  bool job_token = !options.token.empty();
  if (!job_token && !options.token_file.empty()) {
    absl::StatusOr<std::string> lone = ResolveClientToken("", options.token_file);
    job_token = lone.ok() && tokens.Authenticate(BearerValue(*lone)).ok();
  }
  TuneMallocForLargeBuffers();
  auto server = std::make_unique<ServerImpl>(options, std::move(tokens), job_token);
  DEEPNEX_RETURN_IF_ERROR(server->Start());
  return std::unique_ptr<Server>(std::move(server));
}

}  // namespace deepnex::ps
