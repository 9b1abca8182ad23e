// One partition on its own: the order in which a round's completions run,
// which is the order the server's replies go out.
#include "ps/partition.h"

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/grpc_util.h"
#include "deepnex/ps.pb.h"
#include "gtest/gtest.h"
#include "ps/membership.h"

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

class LoggedPull final : public PullSink {
 public:
  LoggedPull(Log* log, int worker, size_t count) : values(count), log_(log), worker_(worker) {}
  char* Destination(size_t) override { return reinterpret_cast<char*>(values.data()); }
  void SliceReady(size_t, uint64_t version) override {
    log_->Add("pull " + std::to_string(worker_) + " at " + std::to_string(version));
  }
  void Fail(const absl::Status& s) override { log_->Add("pull failed: " + s.ToString()); }
  bool Finished() const override { return false; }

  std::vector<float> values;  // where the pull copies to

 private:
  Log* const log_;
  const int worker_;
};

// Pushes `grad` into `part` as `worker`'s push `seq`, and runs what it
// completes.
void Push(Partition& part, int worker, uint64_t seq, const std::vector<float>& grad, Log* log) {
  grpc::Slice slice(grad.data(), grad.size() * sizeof(float));
  grpc::ByteBuffer framed = EncodeFramed(proto::PushHeader(), {slice});
  proto::PushHeader header;
  PayloadReader payload;
  ASSERT_TRUE(DecodeFramed(framed, &header, &payload).ok());
  Completions done;
  part.Push(worker, /*incarnation=*/1, seq, "k", /*check_finite=*/true, &payload,
            std::make_shared<LoggedPush>(log, worker), 0, &done);
  RunAll(done);
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

}  // namespace
}  // namespace deepnex::ps
