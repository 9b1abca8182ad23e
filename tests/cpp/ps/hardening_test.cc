// The parameter server against hostile requests: raw wire messages that a
// deepnex client never sends (sizes that wrap, repeated slices, replies left
// unread, pushes out of order), checkpoint targets, and token scopes.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/grpc_util.h"
#include "deepnex/ps.grpc.pb.h"
#include "deepnex/ps/client.h"
#include "deepnex/ps/server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ps/plan.h"
#include "ps/ps_test_util.h"
#include "test_matchers.h"

namespace deepnex::ps {
namespace {

namespace pb = ::deepnex::ps::proto;
using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::HasSubstr;

constexpr char kPull[] = "/deepnex.ps.proto.ParameterServer/Pull";
constexpr char kWriteParts[] = "/deepnex.ps.proto.ParameterServer/WriteParts";
constexpr char kCheckpoint[] = "/deepnex.ps.proto.ParameterServer/Checkpoint";

std::unique_ptr<Server> Start(const ServerOptions& options) {
  auto server = Server::Create(options);
  EXPECT_THAT(server.status(), IsOk());
  return server.ok() ? std::move(*server) : nullptr;
}

std::unique_ptr<Client> Connect(const Server& server, int worker, ClientOptions o = {}) {
  o.servers = {server.address()};
  o.worker_id = worker;
  auto client = Client::Create(o);
  EXPECT_THAT(client.status(), IsOk());
  return client.ok() ? std::move(*client) : nullptr;
}

// Polls `condition` until it holds or 20 s pass.
bool WaitFor(const std::function<bool()>& condition) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// Raw calls on one channel (one connection), answered asynchronously.
class Wire {
 public:
  explicit Wire(const std::string& address)
      : channel_(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())),
        generic_(channel_),
        stub_(pb::ParameterServer::NewStub(channel_)) {}
  ~Wire() { CancelAll(); WaitAll(); }

  pb::ParameterServer::Stub& stub() { return *stub_; }

  // `index` of `count` servers: the caller's position for this server
  // (count 0: not given).
  grpc::Status Register(int worker, uint64_t incarnation, uint32_t index = 0, uint32_t count = 0) {
    pb::RegisterRequest req;
    req.set_worker_id(worker);
    req.set_incarnation(incarnation);
    req.set_server_index(index);
    req.set_num_servers(count);
    pb::RegisterReply reply;
    grpc::ClientContext ctx;
    return stub_->Register(&ctx, req, &reply);
  }

  // Starts a call; its status is collected (see statuses()).
  void Start(const char* method, grpc::ByteBuffer request) {
    auto call = std::make_shared<Call>();
    call->request = std::move(request);
    call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    {
      std::lock_guard<std::mutex> lock(mu_);
      calls_.push_back(call);
    }
    generic_.UnaryCall(&call->ctx, method, grpc::StubOptions(), &call->request,
                       &call->response, [this, call](grpc::Status s) {
                         std::lock_guard<std::mutex> lock(mu_);
                         call->status = s;
                         call->done = true;
                         cv_.notify_all();
                       });
  }

  // Starts one call and waits for it.
  grpc::Status Call1(const char* method, grpc::ByteBuffer request) {
    Start(method, std::move(request));
    std::shared_ptr<Call> call;
    {
      std::lock_guard<std::mutex> lock(mu_);
      call = calls_.back();
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return call->done; });
    return call->status;
  }

  int Count(grpc::StatusCode code) {
    std::lock_guard<std::mutex> lock(mu_);
    int n = 0;
    for (const auto& c : calls_) n += c->done && c->status.error_code() == code;
    return n;
  }
  // The reply of the i-th call started. REQUIRES: it is done.
  grpc::ByteBuffer Response(size_t i) {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_[i]->response;
  }
  int Pending() {
    std::lock_guard<std::mutex> lock(mu_);
    int n = 0;
    for (const auto& c : calls_) n += !c->done;
    return n;
  }
  std::string FirstMessage(grpc::StatusCode code) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& c : calls_) {
      if (c->done && c->status.error_code() == code) return c->status.error_message();
    }
    return "";
  }
  // The caller goes: every call still running is cancelled.
  void CancelAll() {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& c : calls_) {
      if (!c->done) c->ctx.TryCancel();
    }
  }
  void WaitAll() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      for (const auto& c : calls_) {
        if (!c->done) return false;
      }
      return true;
    });
  }

 private:
  struct Call {
    grpc::ClientContext ctx;
    grpc::ByteBuffer request, response;
    grpc::Status status;
    bool done = false;
  };
  std::shared_ptr<grpc::Channel> channel_;
  grpc::GenericStub generic_;
  std::unique_ptr<pb::ParameterServer::Stub> stub_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Call>> calls_;
};

pb::Slice SliceOf(const std::string& key, uint32_t part, uint64_t offset, uint64_t count,
                  uint64_t seq = 0) {
  pb::Slice s;
  s.set_key(key);
  s.set_part(part);
  s.set_offset(offset);
  s.set_count(count);
  s.set_dtype(static_cast<int>(DType::kFloat32));
  s.set_seq(seq);
  return s;
}

grpc::ByteBuffer Plain(const google::protobuf::MessageLite& m) {
  grpc::Slice slice(m.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

pb::TensorMeta MetaOf(const std::string& key, uint64_t elements, uint32_t parts) {
  pb::TensorMeta meta;
  meta.set_key(key);
  meta.set_dtype(static_cast<int>(DType::kFloat32));
  meta.add_shape(static_cast<int64_t>(elements));
  meta.set_num_parts(parts);
  return meta;
}

TEST(PsHardeningTest, WritePartsWhoseSizeWrapsIsRefusedAndTheServerKeepsServing) {
  auto server = Start({});
  Wire wire(server->address());
  // 2^62 float32 values are 2^64 bytes, which wraps to the empty payload's 0.
  pb::WritePartsHeader header;
  *header.add_slices() = SliceOf("huge", 0, 0, 1ull << 62);
  *header.add_metas() = MetaOf("huge", 1ull << 62, 1);
  grpc::Status s = wire.Call1(kWriteParts, EncodeFramed(header, {}));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(),
              HasSubstr("init of \"huge\" part 0: 4611686018427387904 elements are more "
                        "than 2^64 bytes"));

  // Two slices of 2^63 bytes each: the sum wraps. The first, a good slice,
  // is not made either.
  pb::WritePartsHeader two;
  *two.add_slices() = SliceOf("a", 0, 0, 1ull << 61);
  *two.add_metas() = MetaOf("a", 1ull << 61, 1);
  *two.add_slices() = SliceOf("b", 0, 0, 1ull << 61);
  *two.add_metas() = MetaOf("b", 1ull << 61, 1);
  s = wire.Call1(kWriteParts, EncodeFramed(two, {}));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("add up to more than 2^64 bytes"));

  // A slice that is not the part its meta makes.
  pb::WritePartsHeader skew;
  *skew.add_slices() = SliceOf("c", 1, 0, 4);
  *skew.add_metas() = MetaOf("c", 8, 2);
  std::vector<float> four(4, 1.0f);
  std::vector<grpc::Slice> payload;
  payload.emplace_back(four.data(), 16, grpc::Slice::STATIC_SLICE);
  s = wire.Call1(kWriteParts, EncodeFramed(skew, std::move(payload)));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(),
              HasSubstr("init of \"c\" part 1: got 4 elements at offset 0; 2 parts of "
                        "[8] float32 make it 4 at offset 4"));

  // Nothing was left behind: stats walks every partition, and still works.
  auto client = Connect(*server, 0);
  auto stats = client->Stats();
  ASSERT_THAT(stats.status(), IsOk());
  EXPECT_EQ((*stats)[0].max_version, 0u);
  std::vector<float> v(4, 2.0f), got(4);
  EXPECT_THAT(client->Pull({View("a", got)}), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_THAT(client->Init({View("w", v)}), IsOk());
  ASSERT_THAT(client->Pull({View("w", got)}), IsOk());
  EXPECT_EQ(got, v);
}

// A 1 MiB tensor in one partition.
class PullLimitTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kElements = 1 << 18;

  void StartWith(ServerOptions so) {
    server_ = Start(so);
    ClientOptions co;
    co.partition_bytes = kElements * 4;
    client_ = Connect(*server_, 0, co);
    values_.assign(kElements, 1.0f);
    ASSERT_THAT(client_->Init({View("w", values_)}), IsOk());
  }

  pb::PullRequest PullOf(int copies, int worker = -1, uint64_t incarnation = 0,
                         uint64_t seq = 0) {
    pb::PullRequest req;
    req.set_worker_id(worker);
    req.set_incarnation(incarnation);
    for (int i = 0; i < copies; ++i) *req.add_slices() = SliceOf("w", 0, 0, kElements, seq);
    return req;
  }

  // Worker 1's (incarnation 7) push number `seq` of all of "w".
  pb::PushHeader PushOf(uint64_t seq) {
    pb::PushHeader push;
    push.set_worker_id(1);
    push.set_incarnation(7);
    *push.add_slices() = SliceOf("w", 0, 0, kElements, seq);
    return push;
  }

  std::unique_ptr<Server> server_;
  std::unique_ptr<Client> client_;
  std::vector<float> values_;
};

TEST_F(PullLimitTest, APullNamingASliceTwiceIsRefused) {
  StartWith({});
  Wire wire(server_->address());
  grpc::Status s = wire.Call1(kPull, Plain(PullOf(1500)));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(),
              HasSubstr("pull of \"w\" part 0: slices 0 and 1 name the same partition"));
  EXPECT_EQ(Metric(*server_, "deepnex_ps_pending_reply_bytes"), 0);
  EXPECT_TRUE(wire.Call1(kPull, Plain(PullOf(1))).ok());
  std::vector<float> got(kElements);
  EXPECT_THAT(client_->Pull({View("w", got), View("w", got)}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("pull: \"w\" is named more than once")));
}

// A push naming a key twice pushed this worker's next two rounds of it in
// one step (sync, one worker: both applied, version 2).
TEST_F(PullLimitTest, APushNamingAKeyTwiceIsRefusedAndAppliesNothing) {
  StartWith({});
  std::vector<float> grad(kElements, 1.0f);
  EXPECT_THAT(client_->Push({View("w", grad), View("w", grad)}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("push: \"w\" is named more than once; push the sum once")));
  std::vector<float> got(kElements);
  EXPECT_THAT(client_->PushPull({View("w", grad), View("w", grad)}, {View("w", got)}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  auto info = client_->Describe({"w"});
  ASSERT_THAT(info.status(), IsOk());
  EXPECT_EQ((*info)[0].version, 0u);
  // The next push is this worker's round 1 (the pull waits for it).
  ASSERT_THAT(client_->Push({View("w", grad)}), IsOk());
  ASSERT_THAT(client_->Pull({View("w", got)}), IsOk());
  info = client_->Describe({"w"});
  ASSERT_THAT(info.status(), IsOk());
  EXPECT_EQ((*info)[0].version, 1u);
}

// PushPull in one call: a push with PushHeader.pull replies, once its
// round completes, with the values a pull of its seq would read.
TEST_F(PullLimitTest, APushAskingForItsValuesRepliesWithTheRoundsValues) {
  ServerOptions so;
  so.mode = Mode::kSync;
  so.num_workers = 2;
  so.reduction = Reduction::kSum;
  so.optimizer.kind = OptimizerKind::kSum;
  StartWith(so);
  Wire wire(server_->address());
  ASSERT_TRUE(wire.Register(1, 7).ok());
  pb::PushHeader push = PushOf(1);
  push.set_pull(true);
  std::vector<float> grad(kElements, 2.0f);
  std::vector<grpc::Slice> payload;
  payload.emplace_back(grad.data(), kElements * 4, grpc::Slice::STATIC_SLICE);
  wire.Start(kPushMethod, EncodeFramed(push, std::move(payload)));
  // Round 1 needs worker 0 too: the reply holds its reply bytes meanwhile.
  ASSERT_TRUE(WaitFor([&] {
    return Metric(*server_, "deepnex_ps_pending_reply_bytes") == kElements * 4;
  }));
  EXPECT_EQ(wire.Pending(), 1);
  std::vector<float> mine(kElements, 3.0f);
  ASSERT_THAT(client_->Push({View("w", mine)}), IsOk());
  ASSERT_TRUE(WaitFor([&] { return wire.Count(grpc::StatusCode::OK) == 1; }));
  pb::PullHeader header;
  PayloadReader values;
  ASSERT_THAT(DecodeFramed(wire.Response(0), &header, &values), IsOk());
  ASSERT_EQ(header.versions_size(), 1);
  EXPECT_EQ(header.versions(0), 1u);
  std::vector<float> got(kElements);
  ASSERT_EQ(values.remaining(), kElements * 4);
  values.Read(got.data(), kElements * 4);
  EXPECT_EQ(got, std::vector<float>(kElements, 6.0f));  // 1 + 2 + 3
  // Let go once the server is done sending, which may be after we have it.
  EXPECT_TRUE(WaitFor([&] { return Metric(*server_, "deepnex_ps_pending_reply_bytes") == 0; }));

  // Naming a partition twice is refused, as for a pull.
  pb::PushHeader twice = push;
  *twice.add_slices() = SliceOf("w", 0, 0, kElements, 3);
  std::vector<grpc::Slice> both;
  both.emplace_back(grad.data(), kElements * 4, grpc::Slice::STATIC_SLICE);
  both.emplace_back(grad.data(), kElements * 4, grpc::Slice::STATIC_SLICE);
  grpc::Status s = wire.Call1(kPushMethod, EncodeFramed(twice, std::move(both)));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(),
              HasSubstr("push of \"w\" part 0: slices 0 and 1 name the same partition"));
}

// A request whose client checked the whole push for NaN and Inf says so,
// and the server does not scan it a second time (a push of 64 MiB in 16
// requests was scanned twice). Without the word, the server refuses it.
TEST_F(PullLimitTest, APushItsClientCheckedWholeIsNotScannedAgain) {
  ServerOptions so;
  so.mode = Mode::kAsync;
  so.num_workers = 2;
  so.optimizer.kind = OptimizerKind::kSum;
  StartWith(so);
  Wire wire(server_->address());
  ASSERT_TRUE(wire.Register(1, 7).ok());
  std::vector<float> grad(kElements, 2.0f);
  grad[5] = std::numeric_limits<float>::infinity();
  auto push = [&](bool finite_checked) {
    pb::PushHeader header = PushOf(1);
    header.set_finite_checked(finite_checked);
    std::vector<grpc::Slice> payload;
    payload.emplace_back(grad.data(), kElements * 4, grpc::Slice::STATIC_SLICE);
    return wire.Call1(kPushMethod, EncodeFramed(header, std::move(payload)));
  };
  grpc::Status s = push(false);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("element 5 is NaN or Inf"));
  ASSERT_TRUE(push(true).ok());
  std::vector<float> got(kElements), want(kElements, 3.0f);  // 1 + 2
  want[5] = std::numeric_limits<float>::infinity();
  ASSERT_THAT(client_->Pull({View("w", got)}), IsOk());
  EXPECT_EQ(got, want);
}

TEST_F(PullLimitTest, APullSeqThatWouldWrapTheRoundIsRefused) {
  StartWith({});
  Wire wire(server_->address());
  ASSERT_TRUE(wire.Register(0, 7).ok());
  grpc::Status s = wire.Call1(kPull, Plain(PullOf(1, 0, 7, ~0ull)));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("pull: seq 18446744073709551615 is out of range"));
}

TEST_F(PullLimitTest, APullReplyOverTheCapIsRefused) {
  ServerOptions so;
  so.max_pull_reply_bytes = 1 << 20;
  StartWith(so);
  std::vector<float> b(16, 1.0f);
  ASSERT_THAT(client_->Init({View("b", b)}), IsOk());
  Wire wire(server_->address());
  pb::PullRequest req = PullOf(1);
  *req.add_slices() = SliceOf("b", 0, 0, 16);  // 64 bytes past the cap
  grpc::Status s = wire.Call1(kPull, Plain(req));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(),
              HasSubstr("pull: the reply would hold more than 1048576 bytes "
                        "(max_pull_reply_bytes) at slice 1 (\"b\" part 0)"));
  std::vector<float> got(kElements);
  EXPECT_THAT(client_->Pull({View("w", got)}), IsOk());  // exactly the cap
}

TEST_F(PullLimitTest, RepliesHeldForOneConnectionAreBoundedAndFreedWhenItGoes) {
  ServerOptions so;
  so.mode = Mode::kSync;
  so.num_workers = 2;
  so.max_pending_reply_bytes = 8 << 20;
  StartWith(so);
  // Worker 1 pushes round 1 and never comes back for round 1's other half:
  // its pulls of round 1 wait, each to hold a 1 MiB reply.
  Wire wire(server_->address());
  ASSERT_TRUE(wire.Register(1, 7).ok());
  pb::PushHeader push = PushOf(1);
  std::vector<float> grad(kElements, 0.0f);
  std::vector<grpc::Slice> payload;
  payload.emplace_back(grad.data(), kElements * 4, grpc::Slice::STATIC_SLICE);
  ASSERT_TRUE(wire.Call1(kPushMethod, EncodeFramed(push, std::move(payload))).ok());

  for (int i = 0; i < 400; ++i) wire.Start(kPull, Plain(PullOf(1, 1, 7, 1)));
  ASSERT_TRUE(WaitFor([&] {
    return wire.Count(grpc::StatusCode::RESOURCE_EXHAUSTED) == 392;
  })) << wire.Count(grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(wire.Pending(), 8);  // held, waiting for round 1
  EXPECT_THAT(wire.FirstMessage(grpc::StatusCode::RESOURCE_EXHAUSTED),
              HasSubstr("already has 8388608 bytes of pull replies held on the server, "
                        "and 1048576 more would pass max_pending_reply_bytes (8388608)"));
  EXPECT_EQ(Metric(*server_, "deepnex_ps_pending_reply_bytes"), 8 << 20);

  // Another connection is not held back by this one.
  std::vector<float> got(kElements);
  EXPECT_THAT(client_->Pull({View("w", got)}), IsOk());

  wire.CancelAll();
  EXPECT_TRUE(WaitFor([&] {
    return Metric(*server_, "deepnex_ps_pending_reply_bytes") == 0;
  }));
}

// A pull sent as a stream whose reply is never read: the client's
// transport stops taking the reply once the stream's window is full, and the
// rest stays on the server.
class UnreadPull final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  UnreadPull(grpc::GenericStub* stub, const grpc::ByteBuffer& request) : request_(request) {
    stub->PrepareBidiStreamingCall(&ctx_, kPull, grpc::StubOptions(), this);
    StartWriteLast(&request_, grpc::WriteOptions());
    StartCall();
  }
  void Cancel() { ctx_.TryCancel(); }
  void OnDone(const grpc::Status& s) override {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = s;
    done_ = true;
    cv_.notify_all();
  }
  grpc::Status Await() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    return status_;
  }
  bool done() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  // The call's code once done; OK before.
  grpc::StatusCode code() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_ ? status_.error_code() : grpc::StatusCode::OK;
  }

 private:
  grpc::ClientContext ctx_;
  grpc::ByteBuffer request_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  grpc::Status status_;
};

TEST_F(PullLimitTest, UnreadRepliesCountAgainstTheirConnection) {
  ServerOptions so;
  so.max_pending_reply_bytes = 8 << 20;
  StartWith(so);
  // A fixed 64 KiB stream window: a 1 MiB reply that is not read stays on
  // the server.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
  auto channel = grpc::CreateCustomChannel(server_->address(),
                                           grpc::InsecureChannelCredentials(), args);
  grpc::GenericStub stub(channel);
  constexpr int kPulls = 400;
  std::vector<std::unique_ptr<UnreadPull>> pulls;
  for (int i = 0; i < kPulls; ++i) {
    pulls.push_back(std::make_unique<UnreadPull>(&stub, Plain(PullOf(1))));
  }
  auto exhausted = [&] {
    int n = 0;
    for (auto& p : pulls) n += p->code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
    return n;
  };
  ASSERT_TRUE(WaitFor([&] { return exhausted() == kPulls - 8; })) << exhausted();
  EXPECT_EQ(Metric(*server_, "deepnex_ps_pending_reply_bytes"), 8 << 20);
  int done = 0;
  for (auto& p : pulls) done += p->done();
  EXPECT_EQ(done, kPulls - 8);  // the 8 held are unread, not finished

  for (auto& p : pulls) p->Cancel();
  for (auto& p : pulls) p->Await();
  EXPECT_TRUE(WaitFor([&] {
    return Metric(*server_, "deepnex_ps_pending_reply_bytes") == 0;
  }));
}

TEST(PsHardeningTest, AServerKeepsTheFirstPositionAClientGivesIt) {
  ServerOptions so;
  so.num_workers = 2;
  auto server = Start(so);
  Wire wire(server->address());
  grpc::Status s = wire.Register(0, 7, 2, 2);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "register: server_index 2 of num_servers 2");
  ASSERT_TRUE(wire.Register(0, 7, 1, 2).ok());  // the first position given
  ASSERT_TRUE(wire.Register(1, 8, 1, 2).ok());
  ASSERT_TRUE(wire.Register(1, 9).ok());  // none given: nothing to check
  for (auto [index, count] : {std::pair<uint32_t, uint32_t>{0, 2}, {1, 3}, {0, 1}}) {
    s = wire.Register(1, 10, index, count);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(),
                HasSubstr(absl::StrCat("worker 1 lists this server as servers[", index, "] of ",
                                       count, ", but worker 0 listed it as servers[1] of 2")));
  }
  ASSERT_TRUE(wire.Register(0, 11, 1, 2).ok());  // still serving
}

// A stats request naming one key of 1024 parts 100000 times: the server
// looked up its parts once per repeat (12 s, 0.8 GB; a million repeats in
// 3 MB would have taken the machine's memory). Each key counts once.
TEST(PsHardeningTest, AStatsRequestRepeatingAKeyCostsOneLookup) {
  ServerOptions so;
  so.num_workers = 2;
  auto server = Start(so);
  ClientOptions co;
  co.partition_bytes = 64;
  auto client = Connect(*server, 0, co);
  std::vector<float> v(16384, 0.0f);
  ASSERT_THAT(client->Init({View("a", v)}), IsOk());
  ASSERT_THAT(client->Push({View("a", v)}), IsOk());
  Wire wire(server->address());
  pb::StatsRequest req;
  for (int i = 0; i < 100000; ++i) req.add_keys("a");
  req.set_worker(0);
  pb::StatsReply reply;
  grpc::ClientContext ctx;
  // A bound a hundred times what it takes, so that the old lookups fail it.
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  ASSERT_TRUE(wire.stub().Stats(&ctx, req, &reply).ok());
  EXPECT_THAT(reply.awaited(), ::testing::ElementsAre(1));  // worker 1 pushed nothing
  // A worker id out of range asks nothing.
  req.set_worker(7);
  grpc::ClientContext again;
  ASSERT_TRUE(wire.stub().Stats(&again, req, &reply).ok());
  EXPECT_THAT(reply.awaited(), ::testing::IsEmpty());
}

TEST(PsHardeningTest, PushesOutOfOrderAreBoundedPerWorkerAndDroppedWhenTheirCallersGo) {
  ServerOptions so;
  so.mode = Mode::kAsync;
  so.max_deferred_push_bytes = 1 << 20;
  auto server = Start(so);
  auto client = Connect(*server, 0);
  std::vector<float> v(1024, 0.0f);  // 4 KiB kept per push
  ASSERT_THAT(client->Init({View("w", v)}), IsOk());

  Wire wire(server->address());
  ASSERT_TRUE(wire.Register(0, 7).ok());
  std::vector<float> grad(1024, 1.0f);
  for (uint64_t seq = 2; seq <= 2001; ++seq) {  // seq 1 never comes
    pb::PushHeader push;
    push.set_worker_id(0);
    push.set_incarnation(7);
    *push.add_slices() = SliceOf("w", 0, 0, 1024, seq);
    std::vector<grpc::Slice> payload;
    payload.emplace_back(grad.data(), 4096, grpc::Slice::STATIC_SLICE);
    wire.Start(kPushMethod, EncodeFramed(push, std::move(payload)));
  }
  ASSERT_TRUE(WaitFor([&] {
    return wire.Count(grpc::StatusCode::RESOURCE_EXHAUSTED) == 2000 - 256;
  })) << wire.Count(grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(wire.Pending(), 256);
  EXPECT_THAT(wire.FirstMessage(grpc::StatusCode::RESOURCE_EXHAUSTED),
              HasSubstr("push: worker 0 already has 1048576 bytes of pushes kept waiting "
                        "for an earlier push or round, and 4096 more would pass "
                        "max_deferred_push_bytes (1048576)"));
  EXPECT_EQ(Metric(*server, "deepnex_ps_deferred_push_bytes"), 1 << 20);

  wire.CancelAll();
  EXPECT_TRUE(WaitFor([&] {
    return Metric(*server, "deepnex_ps_deferred_push_bytes") == 0;
  }));
}

// A checkpoint_dir in a fresh temporary directory.
class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ps_hardening_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    dir_ = root_ + "/ckpt";
  }
  void TearDown() override { std::system(("rm -rf '" + root_ + "'").c_str()); }

  static bool Exists(const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0;
  }

  std::string WriteTokens() {
    std::string path = root_ + "/tokens";
    std::ofstream f(path);
    f << "tok-admin root admin\n"
         "tok-alice alice user\n"
         "tok-a job-a-runner user job-a\n"
         "tok-b job-b-runner user job-b\n";
    return path;
  }

  std::unique_ptr<Client> Observer(const Server& server, const std::string& token) {
    ClientOptions co;
    co.token = token;
    return Connect(server, -1, co);
  }

  std::string root_, dir_;
};

TEST_F(CheckpointTest, ANameIsWrittenInsideTheCheckpointDirAndAPathIsRefused) {
  ServerOptions so;
  so.checkpoint_dir = dir_;
  auto server = Start(so);
  auto client = Connect(*server, 0);
  std::vector<float> v = {1, 2};
  ASSERT_THAT(client->Init({View("w", v)}), IsOk());

  for (const std::string name : {"../evil", "/tmp/evil", "a/b", "..", ".", "x\n"}) {
    EXPECT_THAT(client->Checkpoint(name),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a plain name")))
        << name;
  }
  EXPECT_FALSE(Exists(root_ + "/evil"));
  EXPECT_FALSE(Exists(root_ + "/ps.ckpt"));

  ASSERT_THAT(client->Checkpoint("snap-1"), IsOk());
  EXPECT_TRUE(Exists(dir_ + "/snap-1/ps.ckpt"));
  ASSERT_THAT(client->Checkpoint(""), IsOk());
  EXPECT_TRUE(Exists(dir_ + "/ps.ckpt"));

  // The wait is the server's thread's: bounded.
  pb::CheckpointRequest req;
  req.set_name("late");
  req.set_timeout_ms(1ull << 63);
  pb::CheckpointReply reply;
  grpc::ClientContext ctx;
  Wire wire(server->address());
  grpc::Status s = wire.stub().Checkpoint(&ctx, req, &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("timeout_ms 9223372036854775808 is over an hour"));
  EXPECT_FALSE(Exists(dir_ + "/late"));

  // A server without a checkpoint_dir writes nowhere on request.
  auto bare = Start({});
  auto other = Connect(*bare, 0);
  EXPECT_THAT(other->Checkpoint("snap-1"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no checkpoint_dir")));
}

// A checkpoint taken while an init was between its claim and its values (a
// large tensor's write) held the tensor unready and claimed by nobody: after
// a restore every init waited for "the first initializer" until its
// deadline. The first init after the restore claims it anew.
// A claim of no tensor is how an older client's claim reads (its one
// tensor went in a field now gone): refused, saying so, not answered with
// nothing won.
TEST(ClaimTest, AClaimOfNoTensorIsRefused) {
  auto server = Start({});
  Wire wire(server->address());
  pb::ClaimRequest req;
  req.set_worker_id(0);
  pb::ClaimReply reply;
  grpc::ClientContext ctx;
  grpc::Status s = wire.stub().Claim(&ctx, req, &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(),
            "init: the claim names no tensor (is the client older than this server?)");
}

TEST_F(CheckpointTest, ATensorWhoseInitTheCheckpointCaughtMidwayIsClaimedAnew) {
  ServerOptions so;
  so.mode = Mode::kAsync;
  auto server = Start(so);
  {
    Wire wire(server->address());
    pb::ClaimRequest req;
    req.set_worker_id(0);
    pb::TensorMeta* meta = req.add_metas();
    meta->set_key("w");
    meta->set_dtype(static_cast<int>(DType::kFloat32));
    meta->add_shape(2);
    meta->set_num_parts(1);
    pb::ClaimReply reply;
    grpc::ClientContext ctx;
    ASSERT_TRUE(wire.stub().Claim(&ctx, req, &reply).ok());
    ASSERT_EQ(reply.won_size(), 1);
    ASSERT_TRUE(reply.won(0));
  }
  ASSERT_THAT(server->Checkpoint(dir_, std::chrono::seconds(10)).status(), IsOk());
  server.reset();
  so.restore_dir = dir_;
  server = Start(so);
  ClientOptions co;
  co.timeout = std::chrono::seconds(5);
  auto client = Connect(*server, 0, co);
  std::vector<float> v = {1, 2}, got(2);
  ASSERT_THAT(client->Init({View("w", v)}), IsOk());
  ASSERT_THAT(client->Pull({View("w", got)}), IsOk());
  EXPECT_EQ(got, v);
}

TEST_F(CheckpointTest, AtMostFourCheckpointCallsWaitAtOnce) {
  ServerOptions so;
  so.checkpoint_dir = dir_;
  so.num_workers = 2;
  auto server = Start(so);
  auto c0 = Connect(*server, 0);
  auto c1 = Connect(*server, 1);
  std::vector<float> v(4, 0.0f);
  ASSERT_THAT(c0->Init({View("a", v), View("b", v)}), IsOk());
  // "a" completes round 1 and "b" waits for worker 1, so a checkpoint, cut
  // at round 1, waits for "b".
  ASSERT_THAT(c0->Push({View("a", v), View("b", v)}), IsOk());
  ASSERT_THAT(c1->Push({View("a", v)}), IsOk());
  Wire wire(server->address());
  pb::CheckpointRequest req;
  req.set_name("cut");
  req.set_timeout_ms(60000);
  for (int i = 0; i < 5; ++i) wire.Start(kCheckpoint, Plain(req));
  ASSERT_TRUE(WaitFor([&] { return wire.Count(grpc::StatusCode::RESOURCE_EXHAUSTED) == 1; }));
  EXPECT_THAT(wire.FirstMessage(grpc::StatusCode::RESOURCE_EXHAUSTED),
              HasSubstr("checkpoint: 4 checkpoint calls are already in progress"));
  EXPECT_EQ(wire.Pending(), 4);
  ASSERT_THAT(c1->Push({View("b", v)}), IsOk());
  ASSERT_TRUE(WaitFor([&] { return wire.Count(grpc::StatusCode::OK) == 4; }));
  EXPECT_TRUE(Exists(dir_ + "/cut/ps.ckpt"));
}

TEST_F(CheckpointTest, CheckpointNeedsAnAdminOrTheJobsToken) {
  ServerOptions so;
  so.checkpoint_dir = dir_;
  so.token_file = WriteTokens();
  so.job_id = "job-a";
  auto server = Start(so);
  EXPECT_THAT(Observer(*server, "tok-alice")->Checkpoint("s"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("\"alice\" is neither an admin nor this job's token")));
  EXPECT_FALSE(Exists(dir_ + "/s"));
  EXPECT_THAT(Observer(*server, "tok-alice")->Stats().status(), IsOk());
  EXPECT_THAT(Observer(*server, "tok-admin")->Checkpoint("s"), IsOk());
  EXPECT_THAT(Observer(*server, "tok-a")->Checkpoint("t"), IsOk());
  EXPECT_TRUE(Exists(dir_ + "/t/ps.ckpt"));
  EXPECT_THAT(Observer(*server, "tok-b")->Checkpoint("u"),
              StatusIs(absl::StatusCode::kPermissionDenied));

  // A token given alone is the job's.
  ServerOptions lone;
  lone.checkpoint_dir = dir_ + "/lone";
  lone.token = "s3cret";
  auto lone_server = Start(lone);
  EXPECT_THAT(Observer(*lone_server, "s3cret")->Checkpoint(""), IsOk());
  EXPECT_TRUE(Exists(dir_ + "/lone/ps.ckpt"));
}

TEST_F(CheckpointTest, JobTokensAreRefusedByAServerOfNoJob) {
  ServerOptions so;
  so.token_file = WriteTokens();  // no job_id
  auto server = Start(so);
  EXPECT_THAT(Observer(*server, "tok-b")->Stats().status(),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("the token of \"job-b-runner\" is for job \"job-b\", and "
                                 "this parameter server belongs to no job")));
  ClientOptions co;
  co.token = "tok-a";
  co.servers = {server->address()};
  EXPECT_THAT(Client::Create(co).status(), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(Observer(*server, "tok-alice")->Stats().status(), IsOk());
  EXPECT_THAT(Observer(*server, "tok-admin")->Stats().status(), IsOk());
}

}  // namespace
}  // namespace deepnex::ps
