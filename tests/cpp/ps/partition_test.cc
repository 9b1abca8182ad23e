// One partition on its own: the order in which a round's completions run,
// which is the order the server's replies go out, replies that reference
// the values while rounds go on, and the pull replies made of them.
#include "ps/partition.h"

#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/grpc_util.h"
#include "deepnex/ps.pb.h"
#include "gtest/gtest.h"
#include "ps/calls.h"
#include "ps/membership.h"
#include "ps/values.h"

namespace deepnex::ps {
namespace {

// What the sinks saw, in order.
struct Log {
  std::mutex mu;
  std::vector<std::string> events;
  void Add(std::string e) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back(std::move(e));
  }
};

class LoggedPush final : public PushSink {
 public:
  LoggedPush(Log* log, int worker) : log_(log), worker_(worker) {}
  void SliceApplied(size_t) override { log_->Add("push " + std::to_string(worker_)); }
  void Fail(const absl::Status& s) override { log_->Add("push failed: " + s.ToString()); }
  bool Finished() const override { return false; }

 private:
  Log* const log_;
  const int worker_;
};

// Takes float32 values; by reference when `shares` and the partition can.
class LoggedPull final : public PullSink {
 public:
  LoggedPull(Log* log, int worker, size_t count, bool shares = false)
      : values(count), log_(log), worker_(worker), shares_(shares) {}
  bool Shares() const override { return shares_; }
  char* Destination(size_t) override { return reinterpret_cast<char*>(values.data()); }
  void SliceReady(size_t, uint64_t version) override {
    log_->Add("pull " + std::to_string(worker_) + " at " + std::to_string(version));
  }
  void SliceShared(size_t, SharedBytes bytes, uint64_t version) override {
    held = std::move(bytes);
    std::memcpy(values.data(), held.data, held.size);
    log_->Add("pull " + std::to_string(worker_) + " shared at " + std::to_string(version));
  }
  void Fail(const absl::Status& s) override { log_->Add("pull failed: " + s.ToString()); }
  bool Finished() const override { return false; }

  std::vector<float> values;  // where the pull copies to
  SharedBytes held;           // what it was given by reference

 private:
  Log* const log_;
  const int worker_;
  const bool shares_;
};

// A push's values as the server reads them: `slice`, framed.
PayloadReader Payload(grpc::Slice slice) {
  grpc::ByteBuffer framed = EncodeFramed(proto::PushHeader(), {std::move(slice)});
  proto::PushHeader header;
  PayloadReader payload;
  EXPECT_TRUE(DecodeFramed(framed, &header, &payload).ok());
  return payload;
}

// Pushes `payload` into `part` as `worker`'s push `seq`, and runs what it
// completes.
void Push(Partition& part, int worker, uint64_t seq, PayloadReader payload, Log* log) {
  Completions done;
  part.Push(worker, /*incarnation=*/1, seq, "k", /*check_finite=*/true, &payload,
            std::make_shared<LoggedPush>(log, worker), 0, &done);
  RunAll(done);
}

void Push(Partition& part, int worker, uint64_t seq, const std::vector<float>& grad, Log* log) {
  Push(part, worker, seq, Payload(grpc::Slice(grad.data(), grad.size() * sizeof(float))), log);
}

TEST(PartitionTest, ARoundAnswersTheWorkersThatWaitedBeforeThePushThatClosedIt) {
  Membership membership(2, std::chrono::seconds(60), LeasePolicy::kShrink);
  membership.Register(0, 1);
  membership.Register(1, 1);
  PartitionConfig config;
  config.num_workers = 2;
  config.reduction = Reduction::kMean;
  config.optimizer.lr = 0.5;
  config.membership = &membership;
  std::unique_ptr<Partition> part = Partition::Create(config, DType::kFloat32, 0, 4);
  Log log;
  // Worker 0 pushes and waits for the round; worker 1's push closes it.
  Push(*part, 0, 1, {1, 2, 3, 4}, &log);
  auto pull0 = std::make_shared<LoggedPull>(&log, 0, 4);
  Completions done;
  part->Pull(0, 1, /*last_seq=*/1, pull0, 0, &done);
  RunAll(done);
  Push(*part, 1, 1, {3, 2, 1, 0}, &log);
  auto pull1 = std::make_shared<LoggedPull>(&log, 1, 4);
  part->Pull(1, 1, 1, pull1, 0, &done);
  RunAll(done);
  // Worker 0's values go out before worker 1 hears that its push was
  // taken (in a PushPull, before its values): otherwise worker 1 starts
  // the next round first and the two take turns at waiting.
  EXPECT_EQ(log.events, (std::vector<std::string>{"push 0", "pull 0 at 1", "push 1",
                                                  "pull 1 at 1"}));
  // The mean gradient is 2 everywhere; 0 - 0.5 x 2.
  EXPECT_EQ(pull0->values, (std::vector<float>{-1, -1, -1, -1}));
  EXPECT_EQ(pull1->values, pull0->values);
}

// The float32 values a reply was given by reference.
std::vector<float> Held(const LoggedPull& pull) {
  const float* v = reinterpret_cast<const float*>(pull.held.data);
  return std::vector<float>(v, v + pull.held.size / sizeof(float));
}

TEST(PartitionTest, RepliesReferenceTheValuesAndUpdatesWriteAroundTheOnesStillHeld) {
  Membership membership(1, std::chrono::seconds(60), LeasePolicy::kShrink);
  membership.Register(0, 1);
  PartitionConfig config;
  config.optimizer.lr = 0.5;
  config.membership = &membership;
  const size_t n = Partition::kShareMinBytes / sizeof(float);
  std::unique_ptr<Partition> part = Partition::Create(config, DType::kFloat32, 0, n);
  Log log;
  const std::vector<float> grad(n, 2.0f);  // each round takes 0.5 x 2 = 1 off
  auto round = [&](uint64_t seq) {
    Push(*part, 0, seq, grad, &log);
    auto pull = std::make_shared<LoggedPull>(&log, 0, n, /*shares=*/true);
    Completions done;
    part->Pull(0, 1, seq, pull, 0, &done);
    RunAll(done);
    return pull;
  };
  auto all = [n](float v) { return std::vector<float>(n, v); };
  std::shared_ptr<LoggedPull> a = round(1);
  ASSERT_NE(a->held.owner, nullptr);
  EXPECT_EQ(Held(*a), all(-1));
  // Round 2 goes to another buffer; what `a` holds stays round 1's.
  std::shared_ptr<LoggedPull> b = round(2);
  EXPECT_NE(b->held.data, a->held.data);
  EXPECT_EQ(Held(*a), all(-1));
  EXPECT_EQ(Held(*b), all(-2));
  // Once `a` lets go, round 3 reuses its buffer: no allocation.
  const char* first = a->held.data;
  a.reset();
  std::shared_ptr<LoggedPull> c = round(3);
  EXPECT_EQ(c->held.data, first);
  EXPECT_EQ(Held(*b), all(-2));
  EXPECT_EQ(Held(*c), all(-3));
  // With no reply holding them, the values are updated in place.
  b.reset();
  c.reset();
  std::shared_ptr<LoggedPull> d = round(4);
  EXPECT_EQ(d->held.data, first);
  EXPECT_EQ(Held(*d), all(-4));
  EXPECT_EQ(log.events.back(), "pull 0 shared at 4");

  // A dtype stored converted, or a slice under kShareMinBytes, goes as a copy.
  for (auto [dtype, count] : {std::pair{DType::kFloat16, n}, std::pair{DType::kFloat32, n - 1}}) {
    std::unique_ptr<Partition> other = Partition::Create(config, dtype, 0, count);
    auto pull = std::make_shared<LoggedPull>(&log, 0, n, /*shares=*/true);
    Completions done;
    other->Pull(kObserver, 0, 0, pull, 0, &done);
    RunAll(done);
    EXPECT_EQ(pull->held.owner, nullptr);
    EXPECT_EQ(log.events.back(), "pull 0 at 0");
  }
}

// A push's float32 values in a buffer of their own, framed by a slice that
// records when the server lets go of it.
struct Tracked {
  Tracked(size_t count, float value, size_t skew = 0) : bytes(count * sizeof(float) + skew) {
    for (size_t i = 0; i < count; ++i) std::memcpy(&bytes[skew + 4 * i], &value, 4);
    slice = grpc::Slice(bytes.data() + skew, count * sizeof(float),
                        [](void* self) { static_cast<Tracked*>(self)->released = true; }, this);
  }
  // The payload, once: the server's reference is then the only one.
  PayloadReader Take() { return Payload(std::move(slice)); }
  std::vector<char> bytes;
  grpc::Slice slice;
  bool released = false;
};

// `workers` registered workers (incarnation 1) whose rounds are summed and
// applied at lr 1.
struct Summing {
  explicit Summing(int workers) : membership(workers, std::chrono::seconds(60),
                                             LeasePolicy::kShrink) {
    for (int w = 0; w < workers; ++w) membership.Register(w, 1);
    config.num_workers = workers;
    config.reduction = Reduction::kSum;
    config.optimizer.lr = 1;
    config.membership = &membership;
  }
  Membership membership;
  PartitionConfig config;
};

// What worker `worker` pulls once its push `seq` is applied.
std::vector<float> Pulled(Partition& part, int worker, uint64_t seq, Log* log) {
  auto pull = std::make_shared<LoggedPull>(log, worker, part.count());
  Completions done;
  part.Pull(worker, 1, seq, pull, 0, &done);
  RunAll(done);
  return pull->values;
}

TEST(PartitionTest, RoundsHoldTwoBigPushesWhereTheyCameAndAddTheRestIntoTheirSum) {
  Summing setup(4);
  const size_t n = Partition::kShareMinBytes / sizeof(float);
  std::unique_ptr<Partition> part = Partition::Create(setup.config, DType::kFloat32, 0, n);
  Log log;
  std::vector<std::unique_ptr<Tracked>> pushes;
  for (int w = 0; w < 4; ++w) pushes.push_back(std::make_unique<Tracked>(n, w + 1.0f));
  for (int w = 0; w < 3; ++w) Push(*part, w, 1, pushes[w]->Take(), &log);
  // The first two are referenced until the round is applied; the third
  // was added into the round's sum.
  EXPECT_FALSE(pushes[0]->released);
  EXPECT_FALSE(pushes[1]->released);
  EXPECT_TRUE(pushes[2]->released);
  Push(*part, 3, 1, pushes[3]->Take(), &log);
  EXPECT_TRUE(pushes[0]->released);
  EXPECT_TRUE(pushes[1]->released);
  EXPECT_EQ(Pulled(*part, 0, 1, &log), std::vector<float>(n, -10.0f));  // 0 - (1+2+3+4)
}

TEST(PartitionTest, APushIsCopiedWhenItsBytesAreLentMisalignedOrSmall) {
  Summing setup(2);
  const size_t n = Partition::kShareMinBytes / sizeof(float);
  for (int c = 0; c < 3; ++c) {
    SCOPED_TRACE(c);
    const size_t count = c == 2 ? n - 1 : n;
    std::unique_ptr<Partition> part = Partition::Create(setup.config, DType::kFloat32, 0, count);
    Log log;
    Tracked first(count, 1.0f, /*skew=*/c == 1 ? 2 : 0);
    PayloadReader payload = first.Take();
    if (c == 0) payload.set_lent();  // as a shared-memory region is
    Push(*part, 0, 1, std::move(payload), &log);
    EXPECT_TRUE(first.released);
    // A lent region is the client's again once its push is answered; what
    // it writes there next is not the push.
    std::memset(first.bytes.data(), 0xff, first.bytes.size());
    Tracked second(count, 2.0f);
    Push(*part, 1, 1, second.Take(), &log);
    EXPECT_EQ(Pulled(*part, 0, 1, &log), std::vector<float>(count, -3.0f));
  }
}

TEST(PartitionTest, AHeldPushWithNaNIsRefusedAndLetGoAtOnce) {
  Summing setup(2);
  const size_t n = Partition::kShareMinBytes / sizeof(float);
  std::unique_ptr<Partition> part = Partition::Create(setup.config, DType::kFloat32, 0, n);
  Log log;
  Tracked bad(n, 1.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(&bad.bytes[4 * 7], &nan, 4);
  Push(*part, 0, 1, bad.Take(), &log);
  EXPECT_TRUE(bad.released);
  ASSERT_EQ(log.events.size(), 1u);
  EXPECT_NE(log.events[0].find("element 7 is NaN or Inf"), std::string::npos) << log.events[0];
  // The round is as it was: the retried push and worker 1's complete it.
  Tracked retry(n, 1.0f);
  Push(*part, 0, 1, retry.Take(), &log);
  EXPECT_FALSE(retry.released);
  Push(*part, 1, 1, std::vector<float>(n, 4.0f), &log);
  EXPECT_TRUE(retry.released);
  EXPECT_EQ(Pulled(*part, 0, 1, &log), std::vector<float>(n, -5.0f));
}

// A push that wants its values as it leaves them in `into` (as a PushPull
// through shared memory does, where they came from).
class ServedPush final : public PushSink {
 public:
  ServedPush(Log* log, char* into) : log_(log), into_(into) {}
  void SliceApplied(size_t) override { log_->Add("push"); }
  void Fail(const absl::Status& s) override { log_->Add("push failed: " + s.ToString()); }
  bool Finished() const override { return false; }
  char* ValuesAsApplied(size_t) override { return into_; }
  void SliceServed(size_t, uint64_t version) override {
    log_->Add("served at " + std::to_string(version));
  }

 private:
  Log* const log_;
  char* const into_;
};

// In async mode a push's values, as it leaves them, are written where its
// sink asks as it is applied, over several chunks, even where they
// overwrite the push's own values as they are read (shared memory replies
// in the region the push came in); served before the push is reported.
// A sync push's reply waits for its round, and is pulled as before.
TEST(PartitionTest, AnAsyncPushWritesItsValuesAsAppliedWhereItsSinkAsks) {
  Summing setup(1);
  setup.config.mode = Mode::kAsync;
  const size_t n = 40000;  // several chunks
  std::unique_ptr<Partition> part = Partition::Create(setup.config, DType::kFloat32, 0, n);
  Log log;
  std::vector<float> region(n);
  for (size_t i = 0; i < n; ++i) region[i] = static_cast<float>(i);
  auto push = [&](uint64_t seq, std::shared_ptr<PushSink> sink) {
    PayloadReader payload =
        Payload(grpc::Slice(region.data(), n * sizeof(float), grpc::Slice::STATIC_SLICE));
    Completions done;
    part->Push(0, 1, seq, "k", true, &payload, std::move(sink), 0, &done);
    RunAll(done);
  };
  push(1, std::make_shared<ServedPush>(&log, reinterpret_cast<char*>(region.data())));
  std::vector<float> want(n);
  for (size_t i = 0; i < n; ++i) want[i] = -static_cast<float>(i);  // 0 - 1 x g
  EXPECT_EQ(region, want);
  EXPECT_EQ(Pulled(*part, 0, 1, &log), want);
  EXPECT_EQ(log.events, (std::vector<std::string>{"served at 1", "push", "pull 0 at 1"}));

  // A push whose sink asks for nothing is only applied.
  std::fill(region.begin(), region.end(), 1.0f);
  push(2, std::make_shared<LoggedPush>(&log, 0));
  EXPECT_EQ(log.events.back(), "push 0");
  for (float& w : want) w -= 1;
  EXPECT_EQ(Pulled(*part, 0, 2, &log), want);

  // Sync: the reply waits for the round, and is pulled.
  Summing sync(1);
  part = Partition::Create(sync.config, DType::kFloat32, 0, n);
  log.events.clear();
  push(1, std::make_shared<ServedPush>(&log, reinterpret_cast<char*>(region.data())));
  EXPECT_EQ(log.events, (std::vector<std::string>{"push"}));
  EXPECT_EQ(region, std::vector<float>(n, 1.0f));
}

// The finite check, for every dtype, on runs from empty to past four
// vectors' worth (the unrolled blocks and the tail after them), at every
// position, unaligned: NaN, +Inf and -Inf are found wherever they are; the
// largest finite values of both signs, and the smallest denormal, are not.
TEST(ValuesTest, TheFiniteCheckFindsNaNAndInfAtEveryPositionOfEveryDType) {
  struct Kind {
    DType dtype;
    uint64_t finite_max, nan, inf, sign, denormal;
  };
  const Kind kinds[] = {
      {DType::kFloat32, 0x7f7fffff, 0x7fc00000, 0x7f800000, 0x80000000, 1},
      {DType::kFloat64, 0x7fefffffffffffff, 0x7ff8000000000001, 0x7ff0000000000000,
       0x8000000000000000, 1},
      {DType::kFloat16, 0x7bff, 0x7e00, 0x7c00, 0x8000, 1},
      {DType::kBFloat16, 0x7f7f, 0x7fc1, 0x7f80, 0x8000, 1},
  };
  for (const Kind& k : kinds) {
    const size_t elem = DTypeSize(k.dtype);
    for (size_t n = 0; n <= 80; ++n) {
      std::vector<char> buf(1 + n * elem);
      char* p = buf.data() + 1;  // not aligned for the dtype
      auto set = [&](size_t i, uint64_t bits) { std::memcpy(p + i * elem, &bits, elem); };
      for (size_t i = 0; i < n; ++i) {
        set(i, i % 3 == 0 ? k.finite_max : i % 3 == 1 ? (k.finite_max | k.sign) : k.denormal);
      }
      ASSERT_FALSE(AnyNonFiniteAt(k.dtype, p, n)) << static_cast<int>(k.dtype) << " n=" << n;
      for (size_t at = 0; at < n; ++at) {
        uint64_t was = 0;
        std::memcpy(&was, p + at * elem, elem);
        for (uint64_t bad : {k.nan, k.inf, k.inf | k.sign, k.nan | k.sign}) {
          set(at, bad);
          ASSERT_TRUE(AnyNonFiniteAt(k.dtype, p, n))
              << static_cast<int>(k.dtype) << " n=" << n << " at=" << at << " bits=" << bad;
        }
        set(at, was);
      }
    }
  }
}

// A reply of a copied slice, a shared one and another copied one: its
// payload is exactly the slices' bytes in order, after EncodeFramed's
// prefix kept whole (a bulk reply tells the client its size), and once the
// reply is gone, the shared values are let go and the copies' buffer is
// back in the pool for the next reply.
TEST(PullReplyTest, CarriesCopiesAndSharedValuesInOrderAndLetsGoOfThem) {
  auto pool = std::make_shared<ReplyBuffers>(1 << 20);
  const std::vector<uint64_t> offsets = {0, 8, 8 + 256};
  const uint64_t total = 8 + 256 + 8;
  auto response = std::make_unique<grpc::ByteBuffer>();
  auto call = std::make_shared<PullCall>(offsets, total, response.get(), pool, nullptr, 0);
  call->SetFinish([](const grpc::Status&) {});
  ASSERT_TRUE(call->Shares());
  char* buffer = call->Destination(0);
  std::memcpy(buffer, "AAAAAAAA", 8);
  std::memcpy(call->Destination(2), "CCCCCCCC", 8);
  auto values = std::make_shared<std::string>(256, 'B');
  std::weak_ptr<std::string> watch = values;
  call->SliceReady(2, 1);
  call->SliceShared(1, SharedBytes{values->data(), values->size(), values}, 1);
  values.reset();
  EXPECT_FALSE(watch.expired());  // the reply holds them
  call->SliceReady(0, 1);
  ASSERT_TRUE(call->Finished());

  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response->Dump(&slices).ok());
  ASSERT_EQ(slices.size(), 4u);  // the prefix, then one slice per run
  EXPECT_EQ(response->Length() - slices[0].size(), total);
  proto::PullHeader header;
  PayloadReader payload;
  ASSERT_TRUE(DecodeFramed(*response, &header, &payload).ok());
  std::string got(total, '\0');
  ASSERT_TRUE(payload.Read(got.data(), total));
  EXPECT_EQ(got, "AAAAAAAA" + std::string(256, 'B') + "CCCCCCCC");

  slices.clear();
  payload = PayloadReader();
  response.reset();
  call.reset();
  EXPECT_TRUE(watch.expired());
  std::unique_ptr<char[]> again = pool->Take(total);
  EXPECT_EQ(again.get(), buffer);
}

}  // namespace
}  // namespace deepnex::ps
