// OpenCentralSession: a synchronous bidi stream; writes from any thread
// under a lock, reads from one.
#include "launch/session_client.h"

#include <algorithm>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "core/grpc_util.h"
#include "deepnex/auth.h"
#include "deepnex/central.grpc.pb.h"
#include "deepnex/launch/central.h"

namespace deepnex::launch {
namespace {

namespace pb = ::deepnex::gpu::proto;

class CentralSession final : public Session {
 public:
  CentralSession(std::unique_ptr<pb::Sessions::Stub> stub, std::unique_ptr<grpc::ClientContext> ctx)
      : stub_(std::move(stub)), ctx_(std::move(ctx)), stream_(stub_->Open(ctx_.get())) {}

  ~CentralSession() override {
    Cancel();
    Finish().IgnoreError();
  }

  absl::Status Send(const pb::SessionInput& in) {
    std::lock_guard<std::mutex> lock(write_mu_);
    if (writes_done_ || !stream_->Write(in)) {
      return absl::UnavailableError("the session ended");
    }
    return absl::OkStatus();
  }

  absl::Status Write(const std::string& data) override {
    pb::SessionInput in;
    in.set_stdin(data);
    return Send(in);
  }

  absl::Status CloseStdin() override {
    pb::SessionInput in;
    in.set_close_stdin(true);
    return Send(in);
  }

  absl::Status Resize(int rows, int cols) override {
    pb::SessionInput in;
    in.mutable_resize()->set_rows(static_cast<uint32_t>(std::max(0, rows)));
    in.mutable_resize()->set_cols(static_cast<uint32_t>(std::max(0, cols)));
    return Send(in);
  }

  absl::StatusOr<SessionEvent> Read() override {
    std::lock_guard<std::mutex> lock(read_mu_);
    while (!ended_) {
      if (!pending_.stdout().empty()) {
        SessionEvent e;
        e.kind = SessionEvent::Kind::kStdout;
        e.data = std::move(*pending_.mutable_stdout());
        pending_.clear_stdout();
        return e;
      }
      if (!pending_.stderr().empty()) {
        SessionEvent e;
        e.kind = SessionEvent::Kind::kStderr;
        e.data = std::move(*pending_.mutable_stderr());
        pending_.clear_stderr();
        return e;
      }
      if (pending_.exited()) {
        ended_ = true;
        // Tells the server that nothing more comes: it ends the call.
        {
          std::lock_guard<std::mutex> wlock(write_mu_);
          stream_->WritesDone();
          writes_done_ = true;
        }
        SessionEvent e;
        e.kind = SessionEvent::Kind::kExit;
        e.exit_code = pending_.exit_code();
        return e;
      }
      if (!stream_->Read(&pending_)) {
        ended_ = true;
      }
    }
    absl::Status s = Finish();
    return s.ok() ? absl::FailedPreconditionError("the session has ended") : s;
  }

  void Cancel() override { ctx_->TryCancel(); }

 private:
  absl::Status Finish() {
    std::lock_guard<std::mutex> lock(finish_mu_);
    if (!finished_) {
      {
        std::lock_guard<std::mutex> wlock(write_mu_);
        if (!writes_done_) stream_->WritesDone();
        writes_done_ = true;
      }
      status_ = ToAbslStatus(stream_->Finish());
      finished_ = true;
    }
    return status_;
  }

  std::unique_ptr<pb::Sessions::Stub> stub_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<pb::SessionInput, pb::SessionOutput>> stream_;
  std::mutex write_mu_;
  bool writes_done_ = false;  // guarded by write_mu_
  std::mutex read_mu_;
  pb::SessionOutput pending_;  // what Read has not returned yet
  bool ended_ = false;
  std::mutex finish_mu_;
  bool finished_ = false;
  absl::Status status_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Session>> OpenCentralSession(
    const std::shared_ptr<grpc::Channel>& channel, const std::string& token,
    const SessionOptions& options) {
  DEEPNEX_RETURN_IF_ERROR(CheckForkSafe("central client"));
  if (options.container.empty()) return absl::InvalidArgumentError("container: empty");
  if (options.command.empty() == (options.port == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "container \"", options.container, "\": give a command or a port, not ",
        options.command.empty() ? "neither" : "both"));
  }
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (!token.empty()) ctx->AddMetadata(kAuthorizationKey, BearerValue(token));
  auto session =
      std::make_unique<CentralSession>(pb::Sessions::NewStub(channel), std::move(ctx));
  pb::SessionInput in;
  pb::SessionStart* start = in.mutable_start();
  start->set_container(options.container);
  start->set_user(options.user);
  for (const auto& c : options.command) start->add_command(c);
  start->set_tty(options.tty);
  start->mutable_window()->set_rows(static_cast<uint32_t>(std::max(0, options.rows)));
  start->mutable_window()->set_cols(static_cast<uint32_t>(std::max(0, options.cols)));
  start->set_port(options.port);
  // A failed write shows as the stream's status at the first Read.
  session->Send(in).IgnoreError();
  return std::unique_ptr<Session>(std::move(session));
}

absl::StatusOr<int> CentralClient::Exec(
    const std::string& name, const std::vector<std::string>& command, const std::string& input,
    const std::function<void(bool is_stderr, const std::string& data)>& output,
    const std::string& user) {
  SessionOptions o;
  o.container = name;
  o.user = user;
  o.command = command;
  DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<Session> s, OpenSession(o));
  if (!input.empty()) s->Write(input).IgnoreError();
  s->CloseStdin().IgnoreError();
  while (true) {
    DEEPNEX_ASSIGN_OR_RETURN(SessionEvent e, s->Read());
    if (e.kind == SessionEvent::Kind::kExit) return e.exit_code;
    if (output) output(e.kind == SessionEvent::Kind::kStderr, e.data);
  }
}

}  // namespace deepnex::launch
