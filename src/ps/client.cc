#include "deepnex/ps/client.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <initializer_list>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include <grpcpp/channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <unistd.h>

#include "core/grpc_util.h"
#include "core/text.h"
#include "core/timer.h"
#include "deepnex/ps.grpc.pb.h"
#include "ps/bulk_channel.h"
#include "ps/client_op.h"
#include "ps/partition.h"
#include "ps/pieces.h"
#include "ps/plan.h"
#include "ps/shm_channel.h"
#include "ps/values.h"

namespace deepnex::ps {
namespace {

namespace pb = ::deepnex::ps::proto;
using Clock = std::chrono::system_clock;

// How long a failed op spends asking the servers why.
constexpr std::chrono::milliseconds kExplainTimeout{1000};
constexpr char kPushMethod[] = "/deepnex.ps.proto.ParameterServer/Push";
constexpr char kPullMethod[] = "/deepnex.ps.proto.ParameterServer/Pull";
constexpr char kWritePartsMethod[] =
    "/deepnex.ps.proto.ParameterServer/WriteParts";

// What a client knows of a tensor: its meta and how many times this
// incarnation pushed it.
struct KeyState {
  pb::TensorMeta meta;
  uint64_t seq = 0;
};

uint64_t NewIncarnation() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
               (static_cast<uint64_t>(getpid()) << 16) ^ ++counter;
  return v == 0 ? 1 : v;
}

class ClientImpl final : public Client {
 public:
  ClientImpl(const ClientOptions& options, std::string token, Transport transport)
      : options_(options), token_(std::move(token)), transport_(transport) {}

  // Requests in flight call back into this object: Close cancels them and
  // waits (here too for a Close on another thread still at it).
  ~ClientImpl() override {
    Close().IgnoreError();
    std::unique_lock<std::mutex> lock(inflight_mu_);
    inflight_cv_.wait(lock, [this] { return live_.empty(); });
  }

  absl::Status Connect() {
    DEEPNEX_ASSIGN_OR_RETURN(auto credentials,
                             MakeChannelCredentials(options_.tls_ca_file));
    for (const std::string& address : options_.servers) {
      std::vector<Connection> conns;
      for (int i = 0; i < options_.connections_per_server; ++i) {
        Connection c;
        // The first connection proves the address; the others to it connect
        // as they are used.
        if (i == 0) {
          DEEPNEX_ASSIGN_OR_RETURN(c.channel,
                                   Dial("ps server", address, credentials,
                                        std::min(options_.timeout, kConnectTimeout)));
        } else {
          c.channel = MakeChannel(address, credentials, kClientKeepalive);
        }
        c.generic = std::make_unique<grpc::GenericStub>(c.channel);
        c.stub = pb::ParameterServer::NewStub(c.channel);
        conns.push_back(std::move(c));
      }
      servers_.push_back(std::move(conns));
    }
    if (observer()) return absl::OkStatus();
    DEEPNEX_RETURN_IF_ERROR(RegisterEverywhere());
    if (options_.heartbeat) heartbeat_ = std::thread([this] { Heartbeats(); });
    return absl::OkStatus();
  }

  absl::Status Init(const std::vector<NamedTensor>& tensors) override {
    DEEPNEX_RETURN_IF_ERROR(CheckOpen());
    DEEPNEX_RETURN_IF_ERROR(CheckWriter("init"));
    DEEPNEX_RETURN_IF_ERROR(EnsureRegistered());
    const Clock::time_point deadline = Clock::now() + options_.timeout;
    std::vector<std::string> keys;
    std::vector<std::pair<pb::TensorMeta, const TensorView*>> won;
    // Every tensor checked before the first claim: a claim won for values
    // that cannot be sent would leave the others waiting for them.
    for (const NamedTensor& t : tensors) {
      DEEPNEX_RETURN_IF_ERROR(CheckKey("init", t.key));
      const std::string what = absl::StrFormat("init of \"%s\"", t.key);
      if (!IsFloatingPoint(t.view.dtype)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: dtype %s; parameters must be float32, float64, float16 or "
                            "bfloat16",
                            what, DTypeName(t.view.dtype)));
      }
      DEEPNEX_RETURN_IF_ERROR(t.view.CheckShape(what));
      if (t.view.NumElements() > 0 && t.view.data == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": no data"));
      }
      if (NumParts(t.view.NumElements(), DTypeSize(t.view.dtype), options_.partition_bytes) >
          kMaxParts) {
        const uint64_t bytes = t.view.NumElements() * DTypeSize(t.view.dtype);
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": partition_bytes=", options_.partition_bytes, " would cut its ", bytes,
            " bytes into more than ", kMaxParts,
            " parts, the most a tensor has; give partition_bytes >= ",
            (bytes + kMaxParts - 1) / kMaxParts));
      }
    }
    // Claims, then commits, batched per server holding first parts into
    // requests of about request_bytes: a call per tensor made 100k tensors'
    // init take 134 s.
    struct Claims {
      size_t server;
      pb::ClaimRequest claim;
      size_t bytes = 0;
      std::vector<const TensorView*> views;  // parallel to claim.metas
      pb::CommitRequest commit;              // of those won
    };
    std::vector<Claims> batches;
    std::map<size_t, size_t> filling;  // server -> its batch being filled
    for (const NamedTensor& t : tensors) {
      const size_t server = Primary(t.key);
      auto open = filling.find(server);
      if (open == filling.end() || batches[open->second].bytes >= options_.request_bytes) {
        batches.push_back(Claims{server});
        batches.back().claim.set_worker_id(options_.worker_id);
        open = filling.insert_or_assign(server, batches.size() - 1).first;
      }
      Claims& b = batches[open->second];
      pb::TensorMeta* meta = b.claim.add_metas();
      meta->set_key(t.key);
      meta->set_dtype(static_cast<int>(t.view.dtype));
      for (int64_t d : t.view.shape) meta->add_shape(d);
      meta->set_num_parts(static_cast<uint32_t>(  // at most kMaxParts, checked above
          NumParts(t.view.NumElements(), DTypeSize(t.view.dtype), options_.partition_bytes)));
      b.bytes += meta->ByteSizeLong() + 4;  // and its field's tag and length
      b.views.push_back(&t.view);
      keys.push_back(t.key);
    }
    for (Claims& b : batches) {
      pb::ClaimReply reply;
      DEEPNEX_RETURN_IF_ERROR(
          Unary(b.server, "init", b.claim, &reply, &pb::ParameterServer::Stub::Claim));
      const int n = b.claim.metas_size();
      if (reply.won_size() != n || reply.metas_size() != n) {
        return absl::InternalError(absl::StrCat("init: ", options_.servers[b.server],
                                                " answered ", reply.won_size(), " of ", n,
                                                " claims"));
      }
      for (int i = 0; i < n; ++i) {
        if (!reply.won(i)) continue;
        won.push_back({reply.metas(i), b.views[i]});
        b.commit.add_keys(b.claim.metas(i).key());
      }
    }
    if (!won.empty()) {
      DEEPNEX_RETURN_IF_ERROR(WriteParts(won)->Wait());
      for (const Claims& b : batches) {
        if (b.commit.keys_size() == 0) continue;
        pb::CommitReply reply;
        DEEPNEX_RETURN_IF_ERROR(
            Unary(b.server, "init", b.commit, &reply, &pb::ParameterServer::Stub::Commit));
      }
    }
    // Whoever lost waits for the winner's values to be complete.
    auto backoff = std::chrono::milliseconds(5);
    while (true) {
      DEEPNEX_ASSIGN_OR_RETURN(auto metas, FetchMetas(keys));
      std::vector<std::string> pending;
      for (const auto& m : metas) {
        if (!m.ready()) pending.push_back(m.key());
      }
      if (pending.empty()) {
        Remember(metas);
        return absl::OkStatus();
      }
      if (Clock::now() + backoff > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "init: still waiting for the first initializer of \"",
            absl::StrJoin(pending, "\", \""), "\" after ",
            options_.timeout.count(), " ms"));
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
    }
  }

  absl::Status Push(const std::vector<NamedTensor>& grads) override {
    return WhoIsBehind({&grads}, Led([&] { return PushAsync(grads); }));
  }
  absl::Status Pull(const std::vector<NamedTensor>& out) override {
    return WhoIsBehind({&out}, Led([&] { return PullAsync(out); }));
  }
  absl::Status PushPull(const std::vector<NamedTensor>& grads,
                        const std::vector<NamedTensor>& out) override {
    return WhoIsBehind({&grads, &out}, Led([&] { return PushPullAsync(grads, out); }));
  }

  std::shared_ptr<PendingOp> PushAsync(
      const std::vector<NamedTensor>& grads) override {
    return StartPush(grads);
  }

  std::shared_ptr<PendingOp> PullAsync(
      const std::vector<NamedTensor>& out) override {
    return StartPull(out);
  }

  // Pulling the keys just pushed, in the same order (a training step), is
  // one call per request: each push asks its server to reply with the
  // values it must see, read once its round allows. Other keys: the pulls
  // go out with the pushes, and each server holds a pull until the push it
  // must see is applied, so the two directions overlap on the wire.
  std::shared_ptr<PendingOp> PushPullAsync(
      const std::vector<NamedTensor>& grads,
      const std::vector<NamedTensor>& out) override {
    std::vector<Piece> push, pull;
    bool finite_checked = false;
    absl::Status s = CheckWriter("push");
    if (s.ok()) s = Prepare("pull", out, /*pushing=*/false, nullptr);
    if (s.ok()) s = Prepare("push", grads, /*pushing=*/true, &push, &finite_checked);
    if (s.ok()) s = Prepare("pull", out, /*pushing=*/false, &pull);
    if (!s.ok()) return FailedOp(s);
    auto op = NewOp();
    const bool same_keys =
        grads.size() == out.size() &&
        std::equal(grads.begin(), grads.end(), out.begin(),
                   [](const NamedTensor& a, const NamedTensor& b) { return a.key == b.key; });
    if (same_keys) {
      SendPush(push, finite_checked, op, nullptr, &pull);
      return Release(op);
    }
    auto pulls = SendPull(pull, op);
    SendPush(push, finite_checked, op, [pulls] {
      for (const auto& r : pulls) r->Cancel();  // they would wait in vain
    });
    return Release(op);
  }

  absl::StatusOr<std::vector<TensorInfo>> Describe(
      const std::vector<std::string>& keys) override {
    DEEPNEX_RETURN_IF_ERROR(CheckOpen());
    DEEPNEX_ASSIGN_OR_RETURN(auto metas, FetchMetas(keys));
    Remember(metas);
    std::vector<TensorInfo> infos;
    for (const auto& m : metas) {
      TensorInfo info;
      info.key = m.key();
      info.dtype = static_cast<DType>(m.dtype());
      info.shape.assign(m.shape().begin(), m.shape().end());
      info.version = m.version();
      infos.push_back(std::move(info));
    }
    return infos;
  }

  absl::StatusOr<std::vector<ServerStats>> Stats() override {
    DEEPNEX_RETURN_IF_ERROR(CheckOpen());
    std::vector<ServerStats> all;
    for (size_t s = 0; s < servers_.size(); ++s) {
      DEEPNEX_ASSIGN_OR_RETURN(ServerStats st, StatsOf(s));
      all.push_back(std::move(st));
    }
    return all;
  }

  absl::StatusOr<std::vector<uint64_t>> Checkpoint(const std::string& name) override {
    DEEPNEX_RETURN_IF_ERROR(CheckOpen());
    std::vector<uint64_t> rounds;
    for (size_t s = 0; s < servers_.size(); ++s) {
      pb::CheckpointRequest req;
      req.set_name(name);
      // Servers wait at most an hour for a round boundary.
      req.set_timeout_ms(std::min<int64_t>(options_.timeout.count(), 3600 * 1000));
      pb::CheckpointReply reply;
      DEEPNEX_RETURN_IF_ERROR(
          Unary(s, "checkpoint", req, &reply, &pb::ParameterServer::Stub::Checkpoint));
      rounds.push_back(reply.round());
    }
    return rounds;
  }

  int worker_id() const override { return options_.worker_id; }

  absl::Status Leave() override {
    pushed_ = true;
    return Close();
  }

  absl::Status Close() override {
    if (absl::Status s = CheckForkSafe("ps client"); !s.ok()) {
      // A forked child: the heartbeat thread is the parent's, joining it
      // would wait forever, and Leave would touch gRPC.
      if (heartbeat_.joinable()) heartbeat_.detach();
      return s;
    }
    if (closed_) return absl::OkStatus();
    // A push promised to go again before the next call goes now: there is
    // none after this (a probe's close left the tensor half-applied).
    absl::Status finished = FinishPushes();
    if (closed_.exchange(true)) return absl::OkStatus();
    {
      std::lock_guard<std::mutex> lock(heartbeat_mu_);
      heartbeat_stop_ = true;
    }
    heartbeat_cv_.notify_all();
    if (heartbeat_.joinable()) heartbeat_.join();
    // Leaving is a courtesy: a server that is gone expires the lease anyway.
    for (size_t s = 0; s < servers_.size() && incarnation_.load() != 0; ++s) {
      pb::LeaveRequest req;
      req.set_worker_id(options_.worker_id);
      req.set_incarnation(incarnation_.load());
      req.set_never_pushed(!pushed_.load());
      pb::LeaveReply reply;
      grpc::ClientContext ctx;
      PrepareContext(&ctx, Clock::now() + std::chrono::seconds(2));
      Pick(s).stub->Leave(&ctx, req, &reply);
    }
    std::vector<std::shared_ptr<BulkLink>> links;
    {
      std::lock_guard<std::mutex> lock(mu_);
      links.swap(bulk_);
      links.insert(links.end(), retired_.begin(), retired_.end());
      retired_.clear();
    }
    for (const auto& link : links) {
      if (link) link->stream->Close();
    }
    for (const auto& link : links) {
      if (link) link->stream->Join();
    }
    CancelInflight();
    if (!finished.ok()) {
      const char* part = AnyUnfinished() ? "; the servers may hold that push in part" : "";
      return absl::Status(finished.code(), absl::StrCat("close: ", finished.message(), part));
    }
    return absl::OkStatus();
  }

 private:
  struct Connection {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<grpc::GenericStub> generic;
    std::unique_ptr<pb::ParameterServer::Stub> stub;
  };

  // A framed request to one server, retried on Unavailable until the
  // operation's deadline.
  struct Request {
    std::shared_ptr<Op> op;
    size_t server;
    const char* method;
    const char* what;
    grpc::ByteBuffer request;
    grpc::ByteBuffer response;
    std::unique_ptr<grpc::ClientContext> ctx;
    Clock::time_point deadline;
    std::chrono::milliseconds backoff;
    std::function<absl::Status(const grpc::ByteBuffer&)> on_reply;
    // Runs when the request fails for good (after the op hears of it).
    std::function<void()> on_failure;
    // Sees the outcome before the op does, and may add to a failure's message.
    std::function<absl::Status(absl::Status)> on_done;
    // A request through `shm`: the same over TCP, for a server that has no
    // segment for this client any more.
    std::shared_ptr<ShmRegions> shm;
    std::function<grpc::ByteBuffer()> over_tcp;
    // A push or pull may go over the server's bulk connection instead.
    BulkMethod bulk_method = BulkMethod(0);
    uint64_t reply_bytes = 0;  // the values a reply may carry
    // Where a reply's values go, in order (none for shm): a bulk reply is
    // read straight into them.
    std::vector<std::pair<char*, uint64_t>> direct;
    std::mutex mu;  // guards ctx, cancel_bulk, cancelled and backing_off against Cancel()
    std::function<void()> cancel_bulk;
    bool cancelled = false;
    bool backing_off = false;  // its next attempt waits on the timer

    void Cancel() {
      std::lock_guard<std::mutex> lock(mu);
      cancelled = true;
      if (ctx) ctx->TryCancel();
      if (cancel_bulk) cancel_bulk();
    }
    // Whether the caller took the request off the timer: the one that does
    // goes on with it (the timer's next attempt, or Close's cancel).
    bool TakeBackoff() {
      std::lock_guard<std::mutex> lock(mu);
      return std::exchange(backing_off, false);
    }
  };

  // A request sent over a bulk connection: done once its bytes are written
  // (the writer may read the caller's tensors until then) and its outcome
  // (a reply, the deadline, a cancel, the connection lost) is known.
  struct BulkCall {
    std::shared_ptr<Request> r;
    std::atomic<int> left{2};
    grpc::Status outcome;
  };

  // The bulk connection to one server, and its requests in flight by id.
  struct BulkLink {
    size_t server = 0;
    std::shared_ptr<BulkStream> stream;
    std::mutex mu;
    std::unordered_map<uint64_t, std::shared_ptr<BulkCall>> pending;  // guarded by mu
    uint64_t next_id = 0;                                            // guarded by mu
    bool sweep_armed = false;                                        // guarded by mu
  };

  // How often a link with requests in flight looks for passed deadlines:
  // one timer per link, not one per request (a timer entry held until its
  // request's deadline would pile up at thousands of small rounds a second).
  static constexpr std::chrono::milliseconds kBulkSweep{50};

  absl::Status CheckOpen() const {
    if (closed_) return absl::FailedPreconditionError("the client is closed");
    return CheckForkSafe("ps client");
  }

  bool observer() const { return options_.worker_id == kObserver; }

  absl::Status CheckWriter(const char* op) const {
    if (observer()) {
      return absl::FailedPreconditionError(
          absl::StrCat(op, ": an observer (worker_id -1) only reads"));
    }
    return absl::OkStatus();
  }

  // Takes this worker's lease on every server as a new incarnation.
  // Each incarnation gets a fresh segment from each server on this host.
  absl::Status RegisterEverywhere() {
    uint64_t incarnation = NewIncarnation();
    std::vector<std::shared_ptr<ShmRegions>> shm(servers_.size());
    std::vector<std::shared_ptr<BulkLink>> bulk(servers_.size());
    absl::Status status = RegisterWith(incarnation, &shm, &bulk);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (status.ok()) {
        shm_ = std::move(shm);
        std::swap(bulk_, bulk);
        incarnation_ = incarnation;
        for (auto& [key, k] : keys_) k.seq = 0;  // seqs count per incarnation
        stale_ = false;
      }
      for (const auto& link : bulk) {
        if (link) retired_.push_back(link);
      }
    }
    // The earlier incarnation's connections (or, after a failure, the new
    // ones): their requests go again, and Close() waits for their threads,
    // which call back into this client.
    for (const auto& link : bulk) {
      if (link) link->stream->Close();
    }
    return status;
  }

  // Register with each server as `incarnation`, attaching what each offers.
  absl::Status RegisterWith(uint64_t incarnation, std::vector<std::shared_ptr<ShmRegions>>* shm,
                            std::vector<std::shared_ptr<BulkLink>>* bulk) {
    for (size_t s = 0; s < servers_.size(); ++s) {
      pb::RegisterRequest req;
      req.set_worker_id(options_.worker_id);
      req.set_incarnation(incarnation);
      req.set_server_index(static_cast<uint32_t>(s));
      req.set_num_servers(static_cast<uint32_t>(servers_.size()));
      if (transport_ != Transport::kTcp) {
        req.set_host_id(HostIdentity());
        req.set_shm_bytes(options_.shm_bytes);
      }
      // The bulk socket is plaintext.
      req.set_bulk(options_.tls_ca_file.empty());
      pb::RegisterReply reply;
      absl::Status status = Unary(s, "register", req, &reply, &pb::ParameterServer::Stub::Register);
      if (absl::IsFailedPrecondition(status)) {  // this list against another client's
        return absl::FailedPreconditionError(
            absl::StrCat("servers[", s, "] \"", options_.servers[s], "\": ", status.message()));
      }
      DEEPNEX_RETURN_IF_ERROR(status);
      heartbeat_interval_ = std::chrono::milliseconds(reply.heartbeat_interval_ms());
      if (reply.reject_nonfinite()) reject_nonfinite_ = true;
      DEEPNEX_ASSIGN_OR_RETURN((*shm)[s], AttachShm(transport_, options_.servers[s], reply,
                                                     std::min(options_.timeout, kConnectTimeout)));
      // With shared memory too: its requests' headers then skip gRPC as well.
      if (reply.bulk_port() != 0) (*bulk)[s] = OpenBulk(s, reply);
    }
    return absl::OkStatus();
  }

  // A bulk connection to `server` as its Register reply offers, or null:
  // a server out of reach on that port is served over gRPC.
  std::shared_ptr<BulkLink> OpenBulk(size_t server, const pb::RegisterReply& reply) {
    absl::StatusOr<std::shared_ptr<BulkStream>> stream =
        DialBulk(options_.servers[server], static_cast<int>(reply.bulk_port()),
                 reply.bulk_ticket(), std::min(options_.timeout, kConnectTimeout));
    if (!stream.ok()) return nullptr;
    auto link = std::make_shared<BulkLink>();
    link->server = server;
    link->stream = *std::move(stream);
    link->stream->Start([this, link](const BulkFrame& frame) { return OnBulkReply(*link, frame); },
                        [this, link](const absl::Status& status) { OnBulkClosed(link, status); },
                        /*on_demand=*/true);
    return link;
  }

  std::shared_ptr<BulkLink> BulkTo(size_t server) {
    std::lock_guard<std::mutex> lock(mu_);
    return bulk_.empty() ? nullptr : bulk_[server];
  }

  // The bulk links this thread sent requests on, one entry per request,
  // while it starts an op it will wait for (Led).
  static thread_local std::vector<std::shared_ptr<BulkLink>>* led_links_;

  // Starts an op and waits for it, reading the replies of a bulk link it
  // went over on this thread, rather than waking the link's reader thread
  // to read them and then this one.
  // A push or pull of `tensors` that timed out waits for rounds that other
  // workers have not pushed to (a pull for the round of its last push, a
  // push for rounds enough that it may lead by no more than the mode
  // allows): `s` with the workers that the rounds it needs of those
  // tensors' partitions wait for, as its servers say within a second (a
  // probe's said only "Deadline Exceeded", naming nobody; counting pushes
  // over all keys named workers that had pushed the key in question).
  absl::Status WhoIsBehind(std::initializer_list<const std::vector<NamedTensor>*> tensors,
                           absl::Status s) {
    if (s.code() != absl::StatusCode::kDeadlineExceeded || observer()) return s;
    pb::StatsRequest req;
    for (const auto* list : tensors) {
      for (const NamedTensor& t : *list) req.add_keys(t.key);
    }
    req.set_worker(options_.worker_id);
    std::set<int> behind;
    for (size_t server = 0; server < servers_.size(); ++server) {
      pb::StatsReply r;
      if (!Unary(server, "stats", req, &r, &pb::ParameterServer::Stub::Stats, kExplainTimeout)
               .ok()) {
        continue;
      }
      for (int w : r.awaited()) {
        if (w != options_.worker_id) behind.insert(w);
      }
    }
    if (behind.empty()) return s;
    return absl::Status(s.code(), absl::StrCat(s.message(), "; the round waits for worker ",
                                               absl::StrJoin(behind, ", "),
                                               " (not pushed to it yet)"));
  }

  // Server `s`'s counters.
  absl::StatusOr<ServerStats> StatsOf(size_t s) {
    pb::StatsReply r;
    DEEPNEX_RETURN_IF_ERROR(
        Unary(s, "stats", pb::StatsRequest(), &r, &pb::ParameterServer::Stub::Stats));
    ServerStats st;
    st.address = options_.servers[s];
    st.mode = r.mode();
    st.staleness = r.staleness();
    st.num_workers = r.num_workers();
    st.live_workers = r.live_workers();
    st.pushes = r.pushes();
    st.pulls = r.pulls();
    st.bytes_in = r.bytes_in();
    st.bytes_out = r.bytes_out();
    st.rounds = r.rounds();
    st.round_latency_p50 = r.round_latency_p50();
    st.round_latency_p99 = r.round_latency_p99();
    st.lease_expiries = r.lease_expiries();
    st.checkpoints = r.checkpoints();
    st.checkpoint_round = r.checkpoint_round();
    st.min_version = r.min_version();
    st.max_version = r.max_version();
    for (const auto& w : r.workers()) {
      st.workers.push_back({w.worker(), w.state(), w.pushes(), w.max_lead(), w.late_pushes()});
    }
    st.prometheus = r.prometheus();
    return st;
  }

  absl::Status Led(const std::function<std::shared_ptr<PendingOp>()>& start) {
    std::vector<std::shared_ptr<BulkLink>> links;
    led_links_ = &links;
    std::shared_ptr<PendingOp> op = start();
    led_links_ = nullptr;
    // One link is read here: the replies on the others are their reader
    // threads'.
    for (size_t i = 1; i < links.size(); ++i) links[i]->stream->Unclaim();
    if (!links.empty()) links[0]->stream->Lead([&] { return op->Done(); }, kBulkSweep);
    return op->Wait();
  }

  // With r->mu held (from Attempt), which it releases before sending: the
  // send may settle the call on this thread.
  void SendBulk(const std::shared_ptr<Request>& r, const std::shared_ptr<BulkLink>& link,
                std::unique_lock<std::mutex> lock) {
    auto c = std::make_shared<BulkCall>();
    c->r = r;
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(link->mu);
      id = ++link->next_id;
      link->pending[id] = c;
      ArmSweep(link);
    }
    r->ctx.reset();
    r->response.Clear();
    std::weak_ptr<BulkLink> weak = link;
    // Off the canceller's thread, which holds r->mu.
    r->cancel_bulk = [this, weak, id] {
      timer_.After(std::chrono::milliseconds(0), [this, weak, id] {
        if (std::shared_ptr<BulkLink> link = weak.lock()) {
          EndBulk(*link, id, grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
        }
      });
    };
    BulkFrame frame;
    frame.kind = r->bulk_method;
    frame.id = id;
    grpc::ByteBuffer request = r->request;
    lock.unlock();
    link->stream->Expect(/*claim=*/led_links_ != nullptr);
    if (led_links_ != nullptr) led_links_->push_back(link);
    link->stream->Send(frame, "", std::move(request), [this, c](bool) { Settle(c); });
  }

  // REQUIRES: link->mu held.
  void ArmSweep(const std::shared_ptr<BulkLink>& link) {
    if (link->sweep_armed) return;
    link->sweep_armed = true;
    timer_.After(kBulkSweep, [this, weak = std::weak_ptr<BulkLink>(link)] {
      if (std::shared_ptr<BulkLink> link = weak.lock()) Sweep(link);
    });
  }

  // Ends the link's requests whose deadline has passed.
  void Sweep(const std::shared_ptr<BulkLink>& link) {
    std::vector<uint64_t> expired;
    {
      std::lock_guard<std::mutex> lock(link->mu);
      link->sweep_armed = false;
      const Clock::time_point now = Clock::now();
      for (const auto& [id, c] : link->pending) {
        if (c->r->deadline <= now) expired.push_back(id);
      }
      if (link->pending.size() > expired.size()) ArmSweep(link);
    }
    for (uint64_t id : expired) {
      EndBulk(*link, id, grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "Deadline Exceeded"));
    }
  }

  std::shared_ptr<BulkCall> TakeBulk(BulkLink& link, uint64_t id) {
    std::lock_guard<std::mutex> lock(link.mu);
    auto it = link.pending.find(id);
    if (it == link.pending.end()) return nullptr;
    std::shared_ptr<BulkCall> c = std::move(it->second);
    link.pending.erase(it);
    return c;
  }

  // Request `id` ends without a reply (deadline, cancel): the server is
  // told to drop it, as gRPC tells it of a cancelled call. One whose bytes
  // are still queued or going out closes the connection instead, so that
  // the writer lets go of the caller's tensors now; so does a deadline
  // while a caller (Lead) is in the middle of a reply: the server may have
  // stopped sending it halfway, and the caller would wait with it.
  void EndBulk(BulkLink& link, uint64_t id, const grpc::Status& status) {
    std::shared_ptr<BulkCall> c = TakeBulk(link, id);
    if (c == nullptr) return;
    if (c->left.load() == 2 || (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
                                link.stream->LeaderInFrame())) {
      link.stream->Close();
    } else {
      BulkFrame frame;
      frame.kind = kBulkCancel;
      frame.id = id;
      link.stream->Send(frame, "", grpc::ByteBuffer());
    }
    c->outcome = status;
    Settle(c);
  }

  void Settle(const std::shared_ptr<BulkCall>& c) {
    if (c->left.fetch_sub(1) == 1) OnReply(c->r, c->outcome);
  }

  absl::Status OnBulkReply(BulkLink& link, const BulkFrame& frame) {
    constexpr uint32_t kMaxText = 64 << 10;
    constexpr uint64_t kMaxHeader = 1 << 20;  // a pull reply's versions
    if (frame.text > kMaxText) {
      return absl::InternalError(absl::StrFormat("bulk reply with %d bytes of text", frame.text));
    }
    std::string text(frame.text, '\0');
    DEEPNEX_RETURN_IF_ERROR(link.stream->Read(text.data(), text.size()));
    std::shared_ptr<BulkCall> c = TakeBulk(link, frame.id);
    if (c == nullptr) return link.stream->Skip(frame.body);  // it ended without its reply
    absl::Status s;
    grpc::ByteBuffer body;
    if (frame.body > c->r->reply_bytes + kMaxHeader) {
      s = absl::InternalError(absl::StrFormat("%s: a bulk reply of %d bytes for %d of values",
                                              c->r->what, frame.body, c->r->reply_bytes));
    } else if (frame.prefix > 0 && frame.prefix <= frame.body && !c->r->direct.empty() &&
               frame.body - frame.prefix == c->r->reply_bytes) {
      // The values land in the caller's tensors; the reply's slices point
      // at them, so that on_reply finds them in place (ReplyReader).
      std::vector<grpc::Slice> slices;
      slices.emplace_back(frame.prefix);
      s = link.stream->Read(const_cast<uint8_t*>(slices[0].begin()), frame.prefix);
      for (const auto& [ptr, n] : c->r->direct) {
        if (s.ok()) s = link.stream->Read(ptr, n);
        slices.emplace_back(ptr, n, grpc::Slice::STATIC_SLICE);
      }
      body = grpc::ByteBuffer(slices.data(), slices.size());
    } else if (frame.body > 0) {
      grpc::Slice slice(frame.body);
      s = link.stream->Read(const_cast<uint8_t*>(slice.begin()), frame.body);
      body = grpc::ByteBuffer(&slice, 1);
    }
    if (!s.ok()) {
      // It goes again once the connection's end is seen.
      c->outcome = grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(s.message()));
      Settle(c);
      return s;
    }
    c->r->response = std::move(body);
    c->outcome = grpc::Status(
        frame.kind <= grpc::StatusCode::UNAUTHENTICATED ? static_cast<grpc::StatusCode>(frame.kind)
                                                         : grpc::StatusCode::UNKNOWN,
        text);
    Settle(c);
    return absl::OkStatus();
  }

  // The connection ended: its requests go again (over gRPC) as after any
  // Unavailable.
  void OnBulkClosed(const std::shared_ptr<BulkLink>& link, const absl::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (link->server < bulk_.size() && bulk_[link->server] == link) bulk_[link->server] = nullptr;
    }
    std::vector<std::shared_ptr<BulkCall>> left;
    {
      std::lock_guard<std::mutex> lock(link->mu);
      for (auto& [id, c] : link->pending) left.push_back(std::move(c));
      link->pending.clear();
    }
    for (const auto& c : left) {
      c->outcome = grpc::Status(grpc::StatusCode::UNAVAILABLE, std::string(status.message()));
      Settle(c);
    }
  }

  std::shared_ptr<ShmRegions> ShmTo(size_t server) {
    std::lock_guard<std::mutex> lock(mu_);
    return shm_.empty() ? nullptr : shm_[server];
  }

  // After a failure that leaves this incarnation's pushes uncertain, or a
  // lease the servers gave up on, the next operation registers anew.
  absl::Status EnsureRegistered() {
    std::lock_guard<std::mutex> lock(register_mu_);
    {
      std::lock_guard<std::mutex> state(mu_);
      if (!stale_) return absl::OkStatus();
    }
    return RegisterEverywhere();
  }

  void MarkStale() {
    std::lock_guard<std::mutex> lock(mu_);
    stale_ = true;
  }

  void Heartbeats() {
    std::unique_lock<std::mutex> lock(heartbeat_mu_);
    while (!heartbeat_stop_) {
      heartbeat_cv_.wait_for(lock, heartbeat_interval_.load());
      if (heartbeat_stop_) break;
      lock.unlock();
      for (size_t s = 0; s < servers_.size(); ++s) {
        pb::HeartbeatRequest req;
        req.set_worker_id(options_.worker_id);
        req.set_incarnation(incarnation_.load());
        pb::HeartbeatReply reply;
        grpc::ClientContext ctx;
        PrepareContext(&ctx, Clock::now() + heartbeat_interval_.load() * 2);
        grpc::Status st = Pick(s).stub->Heartbeat(&ctx, req, &reply);
        if (st.error_code() == grpc::StatusCode::ABORTED) MarkStale();
      }
      lock.lock();
    }
  }

  size_t Primary(const std::string& key) const {
    return ServerOf(key, 0, static_cast<int>(servers_.size()));
  }

  const Connection& Pick(size_t server) {
    const auto& conns = servers_[server];
    return conns[next_conn_.fetch_add(1, std::memory_order_relaxed) % conns.size()];
  }

  // Before a retry on Unavailable: the server's channels connect now rather
  // than when gRPC's own backoff says (up to 2.4 s after the last failed
  // connect), so that the retries' backoff alone paces them: a client with a
  // 0.5 s timeout failed 5 times in 8 with "failed to connect" to a server
  // back after a 4 s outage (and CI's 2 s one, once).
  void Reconnect(size_t server) {
    for (const Connection& c : servers_[server]) {
      grpc::experimental::ChannelResetConnectionBackoff(c.channel.get());
    }
  }

  void PrepareContext(grpc::ClientContext* ctx, Clock::time_point deadline) const {
    ctx->set_deadline(deadline);
    if (!token_.empty()) ctx->AddMetadata(kAuthorizationKey, BearerValue(token_));
  }

  // Transport failures and NotFound (which of several servers lost its
  // tensors) get the server's address; other errors the server sent say
  // what was wrong.
  absl::Status CallError(const grpc::Status& s, size_t server, const char* what) const {
    absl::Status status = ToAbslStatus(s);
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
        s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
        s.error_code() == grpc::StatusCode::NOT_FOUND) {
      return absl::Status(status.code(),
                          absl::StrCat(what, " to ", options_.servers[server],
                                       ": ", status.message()));
    }
    // gRPC's own words name neither limit (a probe's init of 400 KB).
    if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
        absl::StartsWith(s.error_message(), "Received message larger than max")) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, " to ", options_.servers[server], ": ", status.message(),
          ": a request over the server's max_message_bytes; give the client partition_bytes and "
          "request_bytes below it, or the server a larger max_message_bytes"));
    }
    return status;
  }

  // A blocking control call with retries on Unavailable.
  // `timeout`: 0 for options_.timeout.
  template <typename Req, typename Resp>
  absl::Status Unary(size_t server, const char* what, const Req& req, Resp* resp,
                     grpc::Status (pb::ParameterServer::Stub::*method)(
                         grpc::ClientContext*, const Req&, Resp*),
                     std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) {
    const Clock::time_point deadline =
        Clock::now() + (timeout.count() > 0 ? timeout : options_.timeout);
    auto backoff = options_.retry_backoff;
    while (true) {
      grpc::ClientContext ctx;
      PrepareContext(&ctx, deadline);
      grpc::Status s = (Pick(server).stub.get()->*method)(&ctx, req, resp);
      if (s.ok()) return absl::OkStatus();
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE ||
          Clock::now() + backoff >= deadline) {
        return CallError(s, server, what);
      }
      Reconnect(server);
      std::this_thread::sleep_for(backoff);
      backoff *= 2;
    }
  }

  void Send(std::shared_ptr<Request> r) {
    {
      std::lock_guard<std::mutex> lock(inflight_mu_);
      live_.insert(r);
    }
    Attempt(std::move(r));
  }

  void Attempt(std::shared_ptr<Request> r) {
    std::unique_lock<std::mutex> lock(r->mu);
    if (closed_ || r->cancelled) {
      lock.unlock();
      return Complete(r, absl::CancelledError(absl::StrCat(
          r->what, closed_ ? ": the client was closed" : ": cancelled")));
    }
    if (r->bulk_method != 0) {
      if (std::shared_ptr<BulkLink> link = BulkTo(r->server)) {
        return SendBulk(r, link, std::move(lock));
      }
    }
    r->ctx = std::make_unique<grpc::ClientContext>();
    PrepareContext(r->ctx.get(), r->deadline);
    r->response.Clear();
    Pick(r->server).generic->UnaryCall(
        r->ctx.get(), r->method, grpc::StubOptions(), &r->request, &r->response,
        [this, r](grpc::Status s) { OnReply(r, s); });
  }

  void OnReply(const std::shared_ptr<Request>& r, const grpc::Status& s) {
    if (s.ok()) {
      return Complete(r, r->on_reply ? r->on_reply(r->response) : absl::OkStatus());
    }
    if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION && r->over_tcp) {
      // The server restarted (or let the segment go): TCP to it from now
      // on, until this client next registers.
      r->request = std::exchange(r->over_tcp, nullptr)();
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& shm : shm_) shm = shm == r->shm ? nullptr : shm;
      }
      return Attempt(r);
    }
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE &&
        Clock::now() + r->backoff < r->deadline) {
      Reconnect(r->server);
      auto delay = r->backoff;
      r->backoff *= 2;
      {
        std::lock_guard<std::mutex> lock(r->mu);
        r->backing_off = true;
      }
      timer_.After(delay, [this, r] {
        if (r->TakeBackoff()) Attempt(r);
      });
      return;
    }
    Complete(r, CallError(s, r->server, r->what));
  }

  void Complete(const std::shared_ptr<Request>& r, absl::Status status) {
    if (r->on_done) status = r->on_done(std::move(status));
    // The op hears of the failure before the requests it cancels do.
    auto on_failure = status.ok() ? nullptr : r->on_failure;
    r->op->RequestDone(status);
    if (on_failure) on_failure();
    std::lock_guard<std::mutex> lock(inflight_mu_);
    live_.erase(r);
    if (live_.empty()) inflight_cv_.notify_all();
  }

  // Cancels the requests still out and waits for them: once Close returns,
  // none reads or writes the caller's tensors (a probe's async push read a
  // freed gradient at its deadline, 3 s after Close said OK).
  void CancelInflight() {
    std::vector<std::shared_ptr<Request>> live;
    {
      std::lock_guard<std::mutex> lock(inflight_mu_);
      live.assign(live_.begin(), live_.end());
    }
    for (const auto& r : live) {
      r->Cancel();
      if (r->TakeBackoff()) {
        Complete(r, absl::CancelledError(absl::StrCat(r->what, ": the client was closed")));
      }
    }
    std::unique_lock<std::mutex> lock(inflight_mu_);
    inflight_cv_.wait(lock, [this] { return live_.empty(); });
  }

  std::shared_ptr<Request> NewRequest(std::shared_ptr<Op> op, size_t server,
                                      const char* method, const char* what,
                                      Clock::time_point deadline) {
    auto r = std::make_shared<Request>();
    r->op = std::move(op);
    r->server = server;
    r->method = method;
    r->what = what;
    r->deadline = deadline;
    r->backoff = options_.retry_backoff;
    return r;
  }

  // A key the servers can take: protobuf refuses a string field that is not
  // UTF-8 (the server answered an empty Unimplemented).
  static absl::Status CheckKey(const char* op, const std::string& key) {
    if (key.empty()) return absl::InvalidArgumentError(absl::StrCat(op, ": empty key"));
    if (!IsUtf8(key)) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": key ", Quoted(key), " is not UTF-8 text"));
    }
    return absl::OkStatus();
  }

  // Metas of `keys`, one Describe per server holding their first parts.
  absl::StatusOr<std::vector<pb::TensorMeta>> FetchMetas(
      const std::vector<std::string>& keys) {
    for (const std::string& key : keys) DEEPNEX_RETURN_IF_ERROR(CheckKey("describe", key));
    std::map<size_t, pb::DescribeRequest> by_server;
    for (const std::string& key : keys) by_server[Primary(key)].add_keys(key);
    std::unordered_map<std::string, pb::TensorMeta> found;
    for (const auto& [server, req] : by_server) {
      pb::DescribeReply reply;
      DEEPNEX_RETURN_IF_ERROR(Unary(server, "describe", req, &reply,
                                    &pb::ParameterServer::Stub::Describe));
      for (const auto& m : reply.metas()) found[m.key()] = m;
    }
    // What a server says is checked as Init checks it: parts and pieces are
    // cut by it.
    std::vector<pb::TensorMeta> metas;
    for (const std::string& key : keys) {
      auto it = found.find(key);
      if (it == found.end()) {
        return absl::InternalError(absl::StrCat(
            "describe: ", options_.servers[Primary(key)], " did not describe \"", key, "\""));
      }
      absl::Status valid =
          CheckTensorMeta(absl::StrCat("describe: ", options_.servers[Primary(key)],
                                       "'s description of \"", key, "\""),
                          it->second)
              .status();
      if (!valid.ok()) return absl::InternalError(valid.message());
      metas.push_back(it->second);
    }
    return metas;
  }

  void Remember(const std::vector<pb::TensorMeta>& metas) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& m : metas) keys_[m.key()].meta = m;
  }

  // Checks each tensor against what the servers hold (describing keys this
  // client has not seen) and cuts it into pieces; `pushing` takes a new
  // round for each key. `finite_checked` says whether this found no NaN or
  // Inf in the whole push (one the servers take in several requests).
  absl::Status Prepare(const char* op, const std::vector<NamedTensor>& tensors,
                       bool pushing, std::vector<Piece>* pieces,
                       bool* finite_checked = nullptr) {
    DEEPNEX_RETURN_IF_ERROR(CheckOpen());
    if (absl::Status s = FinishPushes(); !s.ok()) {
      const char* again = AnyUnfinished() ? "; it goes again at the next call" : "";
      return absl::Status(s.code(), absl::StrCat(op, ": ", s.message(), again));
    }
    DEEPNEX_RETURN_IF_ERROR(EnsureRegistered());
    std::vector<std::string> unknown;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& t : tensors) {
        if (!keys_.count(t.key)) unknown.push_back(t.key);
      }
    }
    if (!unknown.empty()) {
      absl::StatusOr<std::vector<pb::TensorMeta>> metas = FetchMetas(unknown);
      if (!metas.ok()) {
        return absl::Status(metas.status().code(),
                            absl::StrCat(op, ": ", metas.status().message()));
      }
      Remember(*metas);
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& t : tensors) {
      const KeyState& k = keys_.at(t.key);
      DType dtype = static_cast<DType>(k.meta.dtype());
      int64_t count = 1;
      for (int64_t d : k.meta.shape()) count *= d;
      if (t.view.dtype != dtype) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s of \"%s\": got %s values, the tensor is %s", op,
                            t.key, DTypeName(t.view.dtype), DTypeName(dtype)));
      }
      if (t.view.NumElements() != count) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s of \"%s\": got %d %s values, the tensor has %d", op, t.key,
            t.view.NumElements(), DTypeName(dtype), count));
      }
      // The same count in another shape is another layout (a transposed
      // weight's gradient was applied element by element, no error).
      if (!std::equal(t.view.shape.begin(), t.view.shape.end(), k.meta.shape().begin(),
                      k.meta.shape().end())) {
        const std::vector<int64_t> shape(k.meta.shape().begin(), k.meta.shape().end());
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s of \"%s\": got shape %s, the tensor is %s (reshape it to match)", op, t.key,
            DescribeShape(t.view.shape, dtype), DescribeShape(shape, dtype)));
      }
      if (count > 0 && t.view.data == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s of \"%s\": no data", op, t.key));
      }
    }
    // The servers refuse a pull naming a partition twice. A push naming a
    // key twice pushed two rounds of it in one step (in sync mode, this
    // worker's next two), the second with values meant for the same round.
    std::unordered_set<std::string> seen;
    for (const auto& t : tensors) {
      if (!seen.insert(t.key).second) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: \"%s\" is named more than once; %s", op, t.key,
            pushing ? "push the sum once" : "pull it once and copy"));
      }
    }
    if (pieces == nullptr) return absl::OkStatus();
    std::unordered_map<std::string, uint64_t> rounds;  // pushing: each key's new one
    for (const auto& t : tensors) {
      const KeyState& k = keys_.at(t.key);
      uint64_t seq = k.seq;
      if (pushing) rounds[t.key] = seq = k.seq + 1;
      CutIntoPieces(t, k.meta, seq, pieces);
    }
    // Each server refuses a bad gradient in what it is sent, whole; a push
    // the servers take in several requests is checked whole here, or one
    // refused after another was applied would leave the step half taken
    // (and a sync round out of step across its partitions). The requests
    // say so, and the servers do not scan them again.
    if (pushing && reject_nonfinite_ &&
        Batch(*pieces, servers_.size(), options_.request_bytes).size() > 1) {
      for (const Piece& p : *pieces) {
        const DType dtype = static_cast<DType>(p.slice.dtype());
        if (!AnyNonFiniteAt(dtype, p.data, p.slice.count())) continue;
        uint64_t i = 0;
        while (i < p.slice.count() && !NonFiniteAt(dtype, p.data + i * DTypeSize(dtype))) ++i;
        absl::Status refused = RefuseNonFinite(
            p.slice.key(), absl::StrFormat("element %d is NaN or Inf", p.slice.offset() + i));
        pieces->clear();
        return refused;
      }
      if (finite_checked != nullptr) *finite_checked = true;
    }
    for (const auto& [key, seq] : rounds) keys_.at(key).seq = seq;
    return absl::OkStatus();
  }

  std::shared_ptr<Op> StartPush(const std::vector<NamedTensor>& grads) {
    std::vector<Piece> pieces;
    bool finite_checked = false;
    absl::Status s = CheckWriter("push");
    if (s.ok()) s = Prepare("push", grads, /*pushing=*/true, &pieces, &finite_checked);
    if (!s.ok()) return FailedOp(s);
    auto op = NewOp();
    SendPush(pieces, finite_checked, op, nullptr);
    return Release(op);
  }

  std::shared_ptr<Op> StartPull(const std::vector<NamedTensor>& out) {
    std::vector<Piece> pieces;
    absl::Status s = Prepare("pull", out, /*pushing=*/false, &pieces);
    if (!s.ok()) return FailedOp(s);
    auto op = NewOp();
    SendPull(pieces, op);
    return Release(op);
  }

  // An op held open by one placeholder request while its requests are sent.
  // Aborted says the servers gave up on this incarnation: the next
  // operation registers anew (a failed push settles in SendPush).
  std::shared_ptr<Op> NewOp() {
    auto op = std::make_shared<Op>(1);
    op->Then([this](const absl::Status& status) {
      if (absl::IsAborted(status)) MarkStale();
    });
    return op;
  }

  std::shared_ptr<Op> Release(std::shared_ptr<Op> op) {
    op->RequestDone(absl::OkStatus());
    return op;
  }

  // With `pull` (the same pieces cut from the tensors to pull into), each
  // push asks for the values back in its reply. `finite_checked`: Prepare
  // found no NaN or Inf in the whole push.
  void SendPush(const std::vector<Piece>& pieces, bool finite_checked,
                const std::shared_ptr<Op>& op, std::function<void()> on_failure,
                const std::vector<Piece>* pull = nullptr) {
    auto batches = Batch(pieces, servers_.size(), options_.request_bytes);
    op->Add(static_cast<int>(batches.size()));
    pushed_ = true;
    auto fate = std::make_shared<PushFate>();
    op->Then([this, fate](const absl::Status& status) { Settle(fate.get(), status); });
    const Clock::time_point deadline = Clock::now() + options_.timeout;
    for (auto& [server, batch] : batches) {
      pb::PushHeader header;
      header.set_worker_id(options_.worker_id);
      header.set_incarnation(incarnation_.load());
      header.set_finite_checked(finite_checked);
      for (const Piece* p : batch) *header.add_slices() = p->slice;
      auto r = NewRequest(op, server, kPushMethod, "push", deadline);
      r->bulk_method = kBulkPush;
      std::shared_ptr<ShmRegions> shm = ShmTo(server);
      uint64_t bytes = 0;
      for (const Piece* p : batch) bytes += p->bytes;
      std::optional<pb::ShmRegion> region = shm ? Stage(shm.get(), bytes, &batch) : std::nullopt;
      if (region) *header.mutable_shm() = *region;
      if (pull != nullptr) {
        header.set_pull(true);
        std::vector<std::pair<char*, uint64_t>> dst;
        for (const Piece* p : batch) {
          const Piece& into = (*pull)[p - pieces.data()];
          dst.push_back({into.data, into.bytes});
          r->reply_bytes += into.bytes;
        }
        if (!region) r->direct = dst;
        r->on_reply = ReplyReader("push", std::move(dst), shm, region);
      } else if (region) {
        r->on_reply = RegionReleaser(shm, region);
      }
      r->request = EncodeFramed(header, region ? std::vector<grpc::Slice>() : PayloadOf(batch));
      if (region) r->over_tcp = PushOverTcp(header, shm, *region);
      r->shm = shm;
      r->on_failure = on_failure;
      // Sent, the header is what a resend of this request needs, as a plain push.
      header.clear_shm();
      header.clear_pull();
      std::vector<std::pair<const char*, uint64_t>> spans;
      for (const Piece* p : batch) spans.push_back({p->data, p->bytes});
      r->on_done = [this, fate, server, again = std::move(header), spans = std::move(spans),
                    order = next_push_.fetch_add(1)](absl::Status status) {
        return Witness(fate.get(), {order, server, again, spans}, std::move(status));
      };
      Send(std::move(r));
    }
  }

  // A failed push's request that a server may have applied, or refused
  // while another server applied its own: sent again (exactly once: the
  // servers know its seq) before this client's next call, so that every
  // part of a tensor stays at the same step. Its bytes are a copy: the
  // caller may reuse the tensors once the push has failed.
  struct Unfinished {
    uint64_t order;  // pushes go again in the order they were sent
    size_t server;
    pb::PushHeader header;  // without shm region or pull
    std::string payload;
  };
  struct PushFate {
    std::mutex mu;
    bool maybe_applied = false;
    std::vector<Unfinished> failed;
  };
  struct Sent {
    uint64_t order;
    size_t server;
    const pb::PushHeader& header;
    const std::vector<std::pair<const char*, uint64_t>>& spans;
  };

  // The server answered with a refusal: it applied nothing of the request.
  static bool Refused(const absl::Status& s) {
    switch (s.code()) {
      case absl::StatusCode::kInvalidArgument:
      case absl::StatusCode::kNotFound:
      case absl::StatusCode::kAlreadyExists:
      case absl::StatusCode::kPermissionDenied:
      case absl::StatusCode::kUnauthenticated:
      case absl::StatusCode::kFailedPrecondition:
      case absl::StatusCode::kOutOfRange:
      case absl::StatusCode::kResourceExhausted:
      case absl::StatusCode::kUnimplemented:
        return true;
      default:
        return false;
    }
  }

  // Runs as each request of a push ends, while the caller's tensors are
  // still untouched: keeps a failed one's bytes.
  absl::Status Witness(PushFate* fate, const Sent& sent, absl::Status status) {
    if (absl::IsAborted(status)) return status;  // the servers dropped this incarnation
    const bool unsure = !status.ok() && !Refused(status);
    std::lock_guard<std::mutex> lock(fate->mu);
    fate->maybe_applied |= status.ok() || unsure;
    if (status.ok()) return status;
    Unfinished u{sent.order, sent.server, sent.header, ""};
    for (const auto& [data, bytes] : sent.spans) u.payload.append(data, bytes);
    fate->failed.push_back(std::move(u));
    if (!unsure) return status;
    return absl::Status(
        status.code(),
        absl::StrCat(status.message(),
                     "; this push may have been taken in part or whole (a sync round also "
                     "waits for every worker's push)",
                     closed_ ? "; the client is closed: nothing goes again"
                             : ": what is unsure goes again, exactly once, before this "
                               "client's next call (do not push it again)"));
  }

  // A failed push: refused everywhere, it took nothing and this incarnation's
  // seqs start again; else its failed requests go again.
  void Settle(PushFate* fate, const absl::Status& status) {
    if (status.ok() || absl::IsAborted(status)) return;
    std::lock_guard<std::mutex> lock(fate->mu);
    if (!fate->maybe_applied) return MarkStale();
    std::lock_guard<std::mutex> unfinished(unfinished_mu_);
    for (Unfinished& u : fate->failed) unfinished_.emplace(u.order, std::move(u));
  }

  bool AnyUnfinished() {
    std::lock_guard<std::mutex> lock(unfinished_mu_);
    return !unfinished_.empty();
  }

  // Sends the unfinished pushes again, in order, and waits for them.
  absl::Status FinishPushes() {
    std::lock_guard<std::mutex> one_at_a_time(finish_mu_);
    while (true) {
      const Unfinished* u;  // only this function erases
      {
        std::lock_guard<std::mutex> lock(unfinished_mu_);
        if (unfinished_.empty()) return absl::OkStatus();
        u = &unfinished_.begin()->second;
      }
      const uint64_t order = u->order;
      absl::Status s;
      if (u->header.incarnation() == incarnation_.load()) {
        auto op = std::make_shared<Op>(1);
        auto r = NewRequest(op, u->server, kPushMethod, "push", Clock::now() + options_.timeout);
        r->request = EncodeFramed(u->header, {grpc::Slice(u->payload.data(), u->payload.size(),
                                                          grpc::Slice::STATIC_SLICE)});
        Send(std::move(r));
        s = op->Wait();
      }
      std::lock_guard<std::mutex> lock(unfinished_mu_);
      if (s.ok()) {
        unfinished_.erase(order);
        continue;
      }
      if (!absl::IsAborted(s) && !Refused(s)) {
        return absl::Status(s.code(),
                            absl::StrCat("an earlier push is still unfinished (", s.message(), ")"));
      }
      // The servers dropped this incarnation, or refuse the rest: give up
      // on it and register anew.
      unfinished_.clear();
      MarkStale();
      if (absl::IsAborted(s)) return absl::OkStatus();
      return absl::Status(
          s.code(), absl::StrCat("an earlier push that failed could not be finished (",
                                 s.message(),
                                 "); this worker registers again, and the servers may hold "
                                 "that push in part"));
    }
  }

  std::vector<std::shared_ptr<Request>> SendPull(const std::vector<Piece>& pieces,
                                                 const std::shared_ptr<Op>& op) {
    auto batches = Batch(pieces, servers_.size(), options_.request_bytes);
    op->Add(static_cast<int>(batches.size()));
    const Clock::time_point deadline = Clock::now() + options_.timeout;
    std::vector<std::shared_ptr<Request>> sent;
    for (auto& [server, batch] : batches) {
      pb::PullRequest req;
      req.set_worker_id(options_.worker_id);
      req.set_incarnation(incarnation_.load());
      std::vector<std::pair<char*, uint64_t>> dst;
      uint64_t total = 0;
      for (const Piece* p : batch) {
        *req.add_slices() = p->slice;
        dst.push_back({p->data, p->bytes});
        total += p->bytes;
      }
      std::shared_ptr<ShmRegions> shm = ShmTo(server);
      std::optional<pb::ShmRegion> region = shm ? Stage(shm.get(), total, nullptr) : std::nullopt;
      if (region) *req.mutable_shm() = *region;
      auto r = NewRequest(op, server, kPullMethod, "pull", deadline);
      r->bulk_method = kBulkPull;
      r->reply_bytes = total;
      if (!region) r->direct = dst;
      std::string bytes = req.SerializeAsString();
      grpc::Slice slice(bytes);
      r->request = grpc::ByteBuffer(&slice, 1);
      r->on_reply = ReplyReader("pull", std::move(dst), shm, region);
      if (region) r->over_tcp = PullOverTcp(req);
      r->shm = shm;
      sent.push_back(r);
      Send(std::move(r));
    }
    return sent;
  }

  std::shared_ptr<Op> WriteParts(
      const std::vector<std::pair<pb::TensorMeta, const TensorView*>>& won) {
    std::vector<Piece> pieces;
    std::unordered_map<std::string, const pb::TensorMeta*> metas;
    for (const auto& [meta, view] : won) {
      CutIntoPieces({meta.key(), *view}, meta, 0, &pieces);
      metas[meta.key()] = &meta;
    }
    auto batches = Batch(pieces, servers_.size(), options_.request_bytes);
    auto op = std::make_shared<Op>(static_cast<int>(batches.size()));
    const Clock::time_point deadline = Clock::now() + options_.timeout;
    for (auto& [server, batch] : batches) {
      pb::WritePartsHeader header;
      header.set_worker_id(options_.worker_id);
      for (const Piece* p : batch) {
        *header.add_slices() = p->slice;
        *header.add_metas() = *metas[p->slice.key()];
      }
      auto r = NewRequest(op, server, kWritePartsMethod, "init", deadline);
      r->request = EncodeFramed(header, PayloadOf(batch));
      Send(std::move(r));
    }
    return op;
  }

  const ClientOptions options_;
  const std::string token_;
  const Transport transport_;  // options_.transport or $DEEPNEX_PS_TRANSPORT
  std::vector<std::vector<Connection>> servers_;
  std::atomic<uint64_t> next_conn_{0};
  std::atomic<bool> closed_{false};
  // A server said it refuses gradients holding NaN or Inf (Register).
  std::atomic<bool> reject_nonfinite_{false};
  // Some push went out (Close tells the servers whether this worker joined).
  std::atomic<bool> pushed_{false};
  std::atomic<uint64_t> next_push_{0};  // orders push requests
  std::mutex finish_mu_;                // one FinishPushes at a time
  std::mutex unfinished_mu_;
  std::map<uint64_t, Unfinished> unfinished_;  // guarded by unfinished_mu_
  Timer timer_;
  std::mutex mu_;
  std::unordered_map<std::string, KeyState> keys_;
  std::vector<std::shared_ptr<ShmRegions>> shm_;  // per server; guarded by mu_
  std::vector<std::shared_ptr<BulkLink>> bulk_;   // per server, or null; guarded by mu_
  // Earlier incarnations' links, whose threads Close() waits for; guarded by mu_.
  std::vector<std::shared_ptr<BulkLink>> retired_;
  std::mutex inflight_mu_;
  std::condition_variable inflight_cv_;
  // Requests sent and not yet completed; guarded by inflight_mu_.
  std::unordered_set<std::shared_ptr<Request>> live_;
  std::atomic<uint64_t> incarnation_{0};
  bool stale_ = false;  // guarded by mu_
  std::mutex register_mu_;
  std::atomic<std::chrono::milliseconds> heartbeat_interval_{std::chrono::milliseconds(1000)};
  std::mutex heartbeat_mu_;
  std::condition_variable heartbeat_cv_;
  bool heartbeat_stop_ = false;
  std::thread heartbeat_;
};

thread_local std::vector<std::shared_ptr<ClientImpl::BulkLink>>* ClientImpl::led_links_ = nullptr;

}  // namespace

absl::StatusOr<std::unique_ptr<Client>> Client::Create(
    const ClientOptions& options) {
  DEEPNEX_RETURN_IF_ERROR(options.Validate());
  DEEPNEX_ASSIGN_OR_RETURN(std::string token,
                           ResolveClientToken(options.token, options.token_file));
  DEEPNEX_ASSIGN_OR_RETURN(Transport transport,
                           ResolveTransport(options.transport, options.shm_bytes));
  TuneMallocForLargeBuffers();
  auto client = std::make_unique<ClientImpl>(options, std::move(token), transport);
  DEEPNEX_RETURN_IF_ERROR(client->Connect());
  return std::unique_ptr<Client>(std::move(client));
}

}  // namespace deepnex::ps
