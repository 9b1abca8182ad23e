// The Sessions and AgentSessions services: one callback reactor per stream
// and one thread per session (it runs the process here, or passes the
// user's input on to the agent's stream).
#include "launch/session_service.h"

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/grpc_stream.h"
#include "core/grpc_util.h"
#include "deepnex/agent.grpc.pb.h"
#include "deepnex/central.grpc.pb.h"
#include "launch/session_serve.h"

namespace deepnex::launch {
namespace {

namespace pb = ::deepnex::gpu::proto;
namespace apb = ::deepnex::agent::proto;

// How long an agent has to take a session and dial back for it.
constexpr std::chrono::milliseconds kAttachTimeout{10000};

// Input queued for a session's process before central stops reading the
// client's stream (gRPC's flow control then holds the client back): a
// process that does not read its stdin must not make central hold all the
// client sends.
constexpr size_t kMaxQueuedInput = 1 << 20;
// Likewise output queued for a client that does not read it: past this the
// process's output (or the agent's stream) waits. A probe's `yes` to a
// client that never read grew central by 160 MB/s.
constexpr size_t kMaxQueuedOutput = 1 << 20;

// Sessions open at once into one user's containers: each holds a thread and
// a few descriptors of central's (and its process), so one user must not
// be able to take them all. A port-forward's connections count each.
constexpr int kMaxSessionsPerUser = 128;

// A queued server stream with its reads and its end passed to hooks.
// Deletes itself once gRPC is done.
template <class In, class Out>
class Pipe final : public QueuedServerStream<In, Out> {
 public:
  struct Hooks {
    // On a gRPC thread, one at a time; false: read no more until ResumeRead.
    std::function<bool(In&)> read;
    std::function<void()> read_end;
    std::function<void()> written;  // after each write, no lock held
    std::function<void()> done;  // the last call; the pipe is gone after
  };

  void Begin(Hooks hooks) {
    hooks_ = std::move(hooks);
    this->StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (hooks_.read_end) hooks_.read_end();
      return;
    }
    // The hook may have closed the stream.
    if (hooks_.read(in_)) this->ReadUnlessClosed(&in_);
  }

  // Reads again after a read hook said to stop.
  void ResumeRead() { this->ReadUnlessClosed(&in_); }

  using QueuedServerStream<In, Out>::QueuedBytes;

  void OnCancel() override { this->Close(absl::CancelledError("the stream was cancelled")); }

  void OnDone() override {
    if (hooks_.done) hooks_.done();
    delete this;
  }

 protected:
  void OnWritten() override {
    if (hooks_.written) hooks_.written();
  }

 private:
  Hooks hooks_;
  In in_;
};

using ClientPipe = Pipe<pb::SessionInput, pb::SessionOutput>;
using AgentPipe = Pipe<apb::AgentSessionMessage, pb::SessionInput>;

std::string NewSessionId() {
  std::random_device rd;
  std::string bytes(16, '\0');
  for (char& c : bytes) c = static_cast<char>(rd());
  return absl::BytesToHexString(bytes);
}

// One session, shared by its streams and its thread.
struct Sess {
  std::mutex mu;
  std::condition_variable cv;
  ClientPipe* client = nullptr;  // null once gone
  AgentPipe* agent = nullptr;    // remote: once attached, until gone
  bool started = false;          // the SessionStart came
  std::deque<pb::SessionInput> inputs;
  size_t queued = 0;       // stdin bytes in `inputs`
  bool paused = false;     // the client's stream is not read until they drain
  bool input_end = false;  // the client is gone (or stopped sending)
  bool agent_paused = false;  // the agent's stream waits for the client's queue
  std::function<void()> gone;  // local: what the client's going away calls
  bool closed = false;     // local: the session ended
  bool attached = false;
  bool agent_gone = false;
  bool exited = false;
  std::string node;

  // Ends the client's stream once; REQUIRES: mu held.
  void CloseClientLocked(const absl::Status& s) {
    if (client != nullptr) client->Close(s);
  }

  // Queues the client's next input; false when the client's stream is to
  // be read no more for now. REQUIRES: mu held.
  bool QueueLocked(pb::SessionInput in) {
    queued += in.stdin().size();
    inputs.push_back(std::move(in));
    cv.notify_all();
    paused = queued >= kMaxQueuedInput;
    return !paused;
  }

  // The oldest input; reading the client resumes once half the queue's room
  // is free again. REQUIRES: mu held, inputs not empty.
  pb::SessionInput PopLocked() {
    pb::SessionInput in = std::move(inputs.front());
    inputs.pop_front();
    queued -= in.stdin().size();
    if (paused && queued <= kMaxQueuedInput / 2) {
      paused = false;
      if (client != nullptr) client->ResumeRead();
    }
    return in;
  }
};

// The process end of a local session, over the client's pipe.
class LocalPeer final : public SessionPeer {
 public:
  explicit LocalPeer(std::shared_ptr<Sess> s) : s_(std::move(s)) {}
  bool Read(pb::SessionInput* in) override {
    std::unique_lock<std::mutex> lock(s_->mu);
    s_->cv.wait(lock, [&] { return !s_->inputs.empty() || s_->input_end || s_->closed; });
    if (s_->inputs.empty()) return false;
    *in = s_->PopLocked();
    return true;
  }
  // Waits while the client has kMaxQueuedOutput unread: the process's
  // output then waits in its pipe, and the process with it.
  bool Write(const pb::SessionOutput& out) override {
    std::unique_lock<std::mutex> lock(s_->mu);
    s_->cv.wait(lock, [&] {
      return s_->client == nullptr || s_->client->QueuedBytes() < kMaxQueuedOutput;
    });
    return s_->client != nullptr && s_->client->Send(out);
  }
  void OnGone(std::function<void()> gone) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->gone = std::move(gone);
  }

 private:
  std::shared_ptr<Sess> s_;
};

class Services final : public SessionServices {
 public:
  Services(const TokenTable& tokens, agent::Hub& hub, SessionResolver resolve)
      : tokens_(tokens), hub_(hub), resolve_(std::move(resolve)), sessions_(this),
        agents_(this) {}
  ~Services() override { Shutdown(); }

  std::vector<grpc::Service*> services() override { return {&sessions_, &agents_}; }

  void Shutdown() override {
    std::unique_lock<std::mutex> lock(mu_);
    stopping_ = true;
    for (auto& [p, s] : live_) {
      std::lock_guard<std::mutex> sl(s->mu);
      s->input_end = true;
      s->CloseClientLocked(absl::UnavailableError("deepnex-central is stopping"));
      if (s->agent != nullptr) s->agent->Close(absl::UnavailableError("deepnex-central is stopping"));
      s->cv.notify_all();
    }
    cv_.wait(lock, [this] { return threads_ == 0; });
  }

 private:
  class SessionsService final : public pb::Sessions::CallbackService {
   public:
    explicit SessionsService(Services* s) : s_(s) {}
    grpc::ServerBidiReactor<pb::SessionInput, pb::SessionOutput>* Open(
        grpc::CallbackServerContext* ctx) override {
      return s_->OpenClient(ctx);
    }

   private:
    Services* const s_;
  };
  class AgentSessionsService final : public apb::AgentSessions::CallbackService {
   public:
    explicit AgentSessionsService(Services* s) : s_(s) {}
    grpc::ServerBidiReactor<apb::AgentSessionMessage, pb::SessionInput>* Open(
        grpc::CallbackServerContext* ctx) override {
      return s_->OpenAgent(ctx);
    }

   private:
    Services* const s_;
  };

  ClientPipe* OpenClient(grpc::CallbackServerContext* ctx) {
    auto* pipe = new ClientPipe;
    auto s = std::make_shared<Sess>();
    s->client = pipe;
    ClientPipe::Hooks hooks;
    hooks.read = [this, s, ctx](pb::SessionInput& in) {
      std::unique_lock<std::mutex> lock(s->mu);
      if (s->started) return s->QueueLocked(std::move(in));
      s->started = true;
      if (!in.has_start()) {
        s->CloseClientLocked(
            absl::InvalidArgumentError("a session's first message must be its SessionStart"));
        return false;
      }
      lock.unlock();
      Begin(s, *ctx, in);
      return true;
    };
    hooks.read_end = [s] {
      std::lock_guard<std::mutex> lock(s->mu);
      s->input_end = true;
      s->cv.notify_all();
    };
    hooks.written = [s] {
      std::lock_guard<std::mutex> lock(s->mu);
      s->cv.notify_all();  // a LocalPeer::Write waiting for room
      if (s->agent_paused && s->client != nullptr &&
          s->client->QueuedBytes() <= kMaxQueuedOutput / 2) {
        s->agent_paused = false;
        if (s->agent != nullptr) s->agent->ResumeRead();
      }
    };
    hooks.done = [s] {
      std::lock_guard<std::mutex> lock(s->mu);
      s->client = nullptr;
      s->input_end = true;
      if (s->gone) s->gone();
      s->cv.notify_all();
    };
    pipe->Begin(std::move(hooks));
    return pipe;
  }

  // Resolves the start's container and starts the session's thread.
  void Begin(const std::shared_ptr<Sess>& s, const grpc::ServerContextBase& ctx,
             const pb::SessionInput& in) {
    const pb::SessionStart& start = in.start();
    absl::StatusOr<SessionTarget> target = resolve_(ctx, start.user(), start.container());
    std::lock_guard<std::mutex> lock(mu_);
    absl::Status refused = !target.ok() ? target.status()
                           : stopping_  ? absl::UnavailableError("deepnex-central is stopping")
                                        : absl::OkStatus();
    if (refused.ok() && per_user_[target->user] >= kMaxSessionsPerUser) {
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "user ", target->user, " has ", kMaxSessionsPerUser,
          " sessions open (exec, shell, port-forward connections), the most one user may "
          "have; end one first"));
    }
    if (!refused.ok()) {
      std::lock_guard<std::mutex> sl(s->mu);
      s->CloseClientLocked(refused);
      return;
    }
    live_[s.get()] = s;
    ++threads_;
    ++per_user_[target->user];
    std::thread([this, s, target = *target, in] {
      if (target.local) {
        RunLocal(s, *target.local, target.backend, in.start());
      } else {
        RunRemote(s, target, in);
      }
      std::lock_guard<std::mutex> lock(mu_);
      live_.erase(s.get());
      if (--per_user_[target.user] == 0) per_user_.erase(target.user);
      --threads_;
      cv_.notify_all();
    }).detach();
  }

  void RunLocal(const std::shared_ptr<Sess>& s, Handle& h, const std::string& backend,
                const pb::SessionStart& start) {
    LocalPeer peer(s);
    absl::Status served = ServeSession(h, backend, start, peer, [&] {
      std::lock_guard<std::mutex> lock(s->mu);
      s->closed = true;
      s->cv.notify_all();
    });
    std::lock_guard<std::mutex> lock(s->mu);
    s->CloseClientLocked(served);
  }

  void RunRemote(const std::shared_ptr<Sess>& s, const SessionTarget& target,
                 const pb::SessionInput& start) {
    const std::string id = NewSessionId();
    s->node = target.node;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_[id] = s;
    }
    apb::Command command;
    command.mutable_session()->set_session_id(id);
    command.mutable_session()->set_name(target.name);
    absl::Status asked = hub_.Call(target.node, command, kAttachTimeout).status();
    std::unique_lock<std::mutex> lock(s->mu);
    if (asked.ok()) {
      s->cv.wait_for(lock, kAttachTimeout, [&] { return s->attached || s->input_end; });
    }
    {
      std::lock_guard<std::mutex> plock(mu_);
      pending_.erase(id);
    }
    if (!s->attached) {
      s->CloseClientLocked(asked.ok() ? absl::UnavailableError(absl::StrCat(
                                            "node ", target.node,
                                            ": its deepnex-agent did not open the session"))
                                      : asked);
      return;
    }
    s->inputs.push_front(start);
    // The user's input, on to the agent, until either side is gone.
    while (true) {
      s->cv.wait(lock, [&] { return !s->inputs.empty() || s->input_end || s->agent_gone; });
      if (s->agent_gone) return;
      if (s->inputs.empty()) {
        // The client is gone: the agent kills the process. Told on the
        // agent's own stream too, since its end of this session may be
        // blocked writing input the process does not read, and then reads
        // nothing of the session's stream that Close ends.
        s->agent->Close(absl::CancelledError("the user's session ended"));
        lock.unlock();
        command.mutable_session()->set_end(true);
        hub_.Call(target.node, command, kAttachTimeout).status().IgnoreError();
        lock.lock();
        s->cv.wait(lock, [&] { return s->agent_gone; });
        return;
      }
      s->agent->Send(s->PopLocked());
    }
  }

  AgentPipe* OpenAgent(grpc::CallbackServerContext* ctx) {
    auto* pipe = new AgentPipe;
    absl::StatusOr<Identity> who =
        AuthenticateCall(tokens_, *ctx, "", false, /*allow_node=*/true);
    auto s = std::make_shared<std::shared_ptr<Sess>>();  // set by the first message
    AgentPipe::Hooks hooks;
    hooks.read = [this, pipe, who, s](apb::AgentSessionMessage& m) {
      if (*s == nullptr) {
        absl::Status attached = Attach(pipe, who, m.session_id(), s.get());
        if (!attached.ok()) pipe->Close(attached);
        return true;
      }
      Sess& sess = **s;
      std::lock_guard<std::mutex> lock(sess.mu);
      if (m.output().error_code() != 0) {
        sess.exited = true;
        sess.CloseClientLocked(
            absl::Status(static_cast<absl::StatusCode>(m.output().error_code()),
                         absl::StrCat("node ", sess.node, ": ", m.output().error_message())));
        pipe->Close(absl::OkStatus());
        return true;
      }
      if (sess.client != nullptr) sess.client->Send(m.output());
      if (m.output().exited()) {
        sess.exited = true;
        sess.CloseClientLocked(absl::OkStatus());
        pipe->Close(absl::OkStatus());
        return true;
      }
      // The agent's stream waits while the client has too much unread.
      sess.agent_paused = sess.client != nullptr && sess.client->QueuedBytes() >= kMaxQueuedOutput;
      return !sess.agent_paused;
    };
    hooks.read_end = [pipe] { pipe->Close(absl::OkStatus()); };
    hooks.done = [s] {
      if (*s == nullptr) return;
      Sess& sess = **s;
      std::lock_guard<std::mutex> lock(sess.mu);
      sess.agent = nullptr;
      sess.agent_gone = true;
      if (!sess.exited) {
        sess.CloseClientLocked(absl::UnavailableError(absl::StrCat(
            "node ", sess.node, ": the session ended before its process did (its deepnex-agent "
            "went away)")));
      }
      sess.cv.notify_all();
    };
    pipe->Begin(std::move(hooks));
    if (!who.ok()) pipe->Close(who.status());
    return pipe;
  }

  // Joins the agent's stream to the pending session `id`: only the node's
  // own agent (or an admin) may take it.
  absl::Status Attach(AgentPipe* pipe, const absl::StatusOr<Identity>& who, const std::string& id,
                      std::shared_ptr<Sess>* out) {
    if (!who.ok()) return who.status();
    std::shared_ptr<Sess> s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(id);
      if (it == pending_.end()) {
        return absl::NotFoundError(absl::StrCat("no session \"", id, "\" waits for an agent"));
      }
      s = it->second;
    }
    if (who->role == AuthRole::kUser || !who->job.empty() ||
        (who->role == AuthRole::kNode && who->name != s->node)) {
      return absl::PermissionDeniedError(
          absl::StrCat(who->name, " cannot serve a session of node ", s->node));
    }
    std::lock_guard<std::mutex> lock(s->mu);
    if (s->attached) return absl::AlreadyExistsError(absl::StrCat("session ", id, " is served"));
    s->agent = pipe;
    s->attached = true;
    *out = s;
    s->cv.notify_all();
    return absl::OkStatus();
  }

  const TokenTable& tokens_;
  agent::Hub& hub_;
  const SessionResolver resolve_;
  SessionsService sessions_;
  AgentSessionsService agents_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Sess*, std::shared_ptr<Sess>> live_;
  std::map<std::string, int> per_user_;  // live sessions by container owner
  std::map<std::string, std::shared_ptr<Sess>> pending_;  // remote, until attached
  int threads_ = 0;
  bool stopping_ = false;
};

}  // namespace

std::unique_ptr<SessionServices> NewSessionServices(const TokenTable& tokens, agent::Hub& hub,
                                                    SessionResolver resolve) {
  return std::make_unique<Services>(tokens, hub, std::move(resolve));
}

}  // namespace deepnex::launch
