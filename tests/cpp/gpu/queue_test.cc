// The allocator's queue on its own: no allocator, no threads; time is
// passed in where it matters.
#include "gpu/queue.h"

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/gpu_test_util.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex::gpu {
namespace {

using ::deepnex::test::StatusIs;
using ::testing::ElementsAre;
using namespace ::deepnex::gpu::test;  // NOLINT
using namespace std::chrono_literals;   // NOLINT

Request Prioritized(const std::string& user, int priority) {
  Request r = Exclusive(user, 1);
  r.priority = priority;
  return r;
}

std::vector<std::string> Ids(const std::vector<PendingRequest>& pending) {
  std::vector<std::string> out;
  for (const PendingRequest& p : pending) out.push_back(p.id);
  return out;
}

TEST(RequestQueue, OrdersByPriorityThenArrival) {
  RequestQueue q;
  Waiter a, b, c;
  q.Push(&a, Prioritized("alice", 0), {});
  q.Push(&b, Prioritized("bob", 5), {});
  q.Push(&c, Prioritized("carol", 0), {});
  EXPECT_EQ(q.size(), 3u);
  EXPECT_EQ(q.head(), &b);
  EXPECT_EQ(q.Ahead(0), 3u);
  EXPECT_EQ(q.Ahead(5), 1u);
  EXPECT_EQ(q.Ahead(6), 0u);
  Placement none;
  const std::vector<PendingRequest> pending = q.Pending("", none, 5min);
  EXPECT_THAT(Ids(pending), ElementsAre("q2", "q1", "q3"));
  EXPECT_EQ(pending[2].position, 3u);
  EXPECT_EQ(pending[2].reason,
            "waiting for a node to take it (0 matching node(s), all cordoned or switching "
            "mode); behind 2 requests");
  // A user's entries keep their place in the whole queue.
  const std::vector<PendingRequest> carol = q.Pending("carol", none, 5min);
  ASSERT_EQ(carol.size(), 1u);
  EXPECT_EQ(carol[0].position, 3u);
  EXPECT_EQ(q.Remove(c), 2u);
  EXPECT_EQ(q.Remove(b), 0u);
  EXPECT_EQ(q.head(), &a);
}

TEST(RequestQueue, PumpOffersInOrderAndHoldsForTheHeadThatStays) {
  RequestQueue q;
  Waiter head, granted, refused;
  auto async = std::make_unique<Waiter>();
  async->answer = [](absl::StatusOr<std::vector<Allocation>>) {};
  q.Push(&head, Prioritized("head", 1), {});
  q.Push(&granted, Prioritized("granted", 0), {});
  q.Push(async.get(), Prioritized("async", 0), {});
  q.Push(&refused, Prioritized("refused", 0), {});
  std::vector<std::string> offered, held;
  const bool any = q.Pump(
      [&](Waiter* w) {
        offered.push_back(w->request.user);
        if (w->request.user == "granted") return Outcome::kGranted;
        if (w->request.user == "refused" || w->request.user == "async") {
          w->status = absl::PermissionDeniedError("no");
          return Outcome::kFailed;
        }
        return Outcome::kBusy;
      },
      [&](const Waiter& w) { held.push_back(w.request.user); });
  EXPECT_TRUE(any);
  EXPECT_THAT(offered, ElementsAre("head", "granted", "async", "refused"));
  EXPECT_THAT(held, ElementsAre("head"));
  EXPECT_EQ(q.size(), 1u);
  EXPECT_FALSE(head.done);
  EXPECT_TRUE(granted.done);
  EXPECT_TRUE(refused.done);
  // Only the asynchronous waiter is left to answer.
  ASSERT_TRUE(q.has_resolved());
  std::vector<Waiter*> resolved = q.TakeResolved();
  EXPECT_THAT(resolved, ElementsAre(async.get()));
  EXPECT_THAT(async->status, StatusIs(absl::StatusCode::kPermissionDenied, "no"));
  EXPECT_FALSE(q.has_resolved());
}

TEST(RequestQueue, AsynchronousWaitersTimeOutAreWithdrawnAndCancelled) {
  RequestQueue q;
  Waiter blocking;
  Waiter soon, later, other;
  for (Waiter* w : {&soon, &later, &other}) {
    w->answer = [](absl::StatusOr<std::vector<Allocation>>) {};
  }
  AllocateOptions five_ms, one_hour;
  five_ms.timeout = 5ms;
  one_hour.timeout = 1h;
  q.Push(&blocking, Exclusive("blocking", 1), five_ms);
  q.Push(&soon, Exclusive("alice", 1), five_ms);
  q.Push(&later, Exclusive("bob", 1), one_hour);
  q.Push(&other, Exclusive("carol", 1), {});
  // A blocking waiter times itself out; an asynchronous one is timed out
  // here, naming how many waited ahead of it.
  auto next = std::chrono::steady_clock::time_point::max();
  EXPECT_TRUE(q.ExpireAsync(soon.queued_at + 1s, &next));
  EXPECT_EQ(next, later.deadline);
  EXPECT_THAT(soon.status,
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       "timeout: waited 5ms in the queue (alice asks 1 exclusive GPU, 0 cpus, 0B "
                       "memory; 1 request(s) ahead of it) without free capacity"));
  EXPECT_EQ(q.size(), 3u);
  EXPECT_FALSE(q.Withdraw(1));  // the blocking one: its caller leaves by itself
  EXPECT_FALSE(q.Withdraw(2));  // timed out already
  EXPECT_TRUE(q.Withdraw(3));
  EXPECT_THAT(later.status, StatusIs(absl::StatusCode::kCancelled,
                                     "the request was withdrawn from the queue"));
  q.CancelAsync(absl::CancelledError("stop"));
  EXPECT_THAT(other.status, StatusIs(absl::StatusCode::kCancelled, "stop"));
  EXPECT_EQ(q.size(), 1u);
  EXPECT_EQ(q.head(), &blocking);
  EXPECT_THAT(q.TakeResolved(), ElementsAre(&soon, &later, &other));
}

TEST(RequestQueue, RefuseIfAnswersThoseThatCanNeverFit) {
  RequestQueue q;
  Waiter a, b;
  q.Push(&a, Exclusive("alice", 1), {});
  q.Push(&b, Exclusive("bob", 2), {});
  q.RefuseIf([](const Request& r) {
    return r.gpus > 1 ? absl::ResourceExhaustedError("too big") : absl::OkStatus();
  });
  EXPECT_FALSE(a.done);
  EXPECT_TRUE(b.done);
  EXPECT_THAT(b.status, StatusIs(absl::StatusCode::kResourceExhausted, "too big"));
  EXPECT_EQ(q.size(), 1u);
  EXPECT_FALSE(q.has_resolved());  // both block: nothing to answer
}

}  // namespace
}  // namespace deepnex::gpu
