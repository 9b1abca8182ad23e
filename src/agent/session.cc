// AgentSessions: one synchronous stream and thread per session (a session
// is a person at a terminal: few at a time per node).
#include "agent/session.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "core/grpc_util.h"
#include "deepnex/agent.grpc.pb.h"
#include "deepnex/auth.h"
#include "launch/session_serve.h"

namespace deepnex::agent {
namespace {

namespace pb = ::deepnex::agent::proto;
namespace gpb = ::deepnex::gpu::proto;

using SessionStream = grpc::ClientReaderWriter<pb::AgentSessionMessage, gpb::SessionInput>;

class StreamPeer final : public launch::SessionPeer {
 public:
  StreamPeer(SessionStream* stream, std::function<void(std::function<void()>)> on_gone)
      : stream_(stream), on_gone_(std::move(on_gone)) {}
  bool Read(gpb::SessionInput* in) override { return stream_->Read(in); }
  bool Write(const gpb::SessionOutput& out) override {
    pb::AgentSessionMessage m;
    *m.mutable_output() = out;
    std::lock_guard<std::mutex> lock(mu_);
    return stream_->Write(m);
  }
  void OnGone(std::function<void()> gone) override { on_gone_(std::move(gone)); }

 private:
  SessionStream* const stream_;
  const std::function<void(std::function<void()>)> on_gone_;
  std::mutex mu_;  // stdout and stderr pumps write at once
};

}  // namespace

absl::Status AgentSessions::Start(std::shared_ptr<launch::Handle> container,
                                  const std::string& backend, const std::string& id) {
  auto ctx = std::make_shared<grpc::ClientContext>();
  if (!token_.empty()) ctx->AddMetadata(kAuthorizationKey, BearerValue(token_));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("deepnex-agent is stopping");
    if (!live_.emplace(id, Live{ctx, nullptr}).second) {
      return absl::AlreadyExistsError(absl::StrCat("session ", id, " is already served here"));
    }
    ++threads_;
  }
  std::thread([this, container = std::move(container), backend, id, ctx] {
    Serve(container, backend, id, ctx);
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(id);
    --threads_;
    cv_.notify_all();
  }).detach();
  return absl::OkStatus();
}

void AgentSessions::Serve(std::shared_ptr<launch::Handle> container, std::string backend,
                          std::string id,
                          std::shared_ptr<grpc::ClientContext> ctx) {
  auto stub = pb::AgentSessions::NewStub(central_);
  std::unique_ptr<SessionStream> stream = stub->Open(ctx.get());
  pb::AgentSessionMessage hello;
  hello.set_session_id(id);
  gpb::SessionInput first;
  if (stream->Write(hello) && stream->Read(&first)) {
    StreamPeer peer(stream.get(), [this, id](std::function<void()> gone) {
      SetGone(id, std::move(gone));
    });
    absl::Status served =
        first.has_start()
            ? launch::ServeSession(*container, backend, first.start(), peer,
                                   [&] { stream->WritesDone(); })
            : absl::InvalidArgumentError("a session's first input must be its SessionStart");
    if (!served.ok()) {
      // Central ends the user's stream with it.
      pb::AgentSessionMessage m;
      m.mutable_output()->set_error_code(static_cast<int>(served.code()));
      m.mutable_output()->set_error_message(std::string(served.message()));
      stream->Write(m);
      stream->WritesDone();
      while (stream->Read(&first)) {
      }
    }
  }
  stream->Finish().ok();
}

void AgentSessions::SetGone(const std::string& id, std::function<void()> gone) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(id);
  if (it != live_.end()) it->second.gone = std::move(gone);
}

void AgentSessions::End(const std::string& id) {
  // Under mu_, so that the process `gone` kills outlives the call: its
  // session clears `gone` (SetGone, which waits for mu_) before it ends.
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(id);
  if (it == live_.end()) return;
  it->second.ctx->TryCancel();
  if (it->second.gone) it->second.gone();
}

void AgentSessions::Stop() {
  std::unique_lock<std::mutex> lock(mu_);
  stopping_ = true;
  for (const auto& [id, live] : live_) live.ctx->TryCancel();
  cv_.wait(lock, [this] { return threads_ == 0; });
}

}  // namespace deepnex::agent
