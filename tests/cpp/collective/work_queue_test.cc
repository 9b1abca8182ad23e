// The serial work queue of the communicators: order, who runs a collective,
// and that a lazy one nobody waits for still runs.
#include "collective/work_queue.h"

#include <atomic>
#include <string>
#include <thread>

#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::collective {
namespace {

using ::deepnex::test::StatusIs;
using ::deepnex::test::WaitFor;
using ::testing::HasSubstr;
using std::chrono::milliseconds;
using std::chrono::seconds;

// Long enough that the queue's thread never takes a lazy collective itself
// within a test.
constexpr auto kNever = std::chrono::microseconds(std::chrono::hours(1));

// The thread that ran a collective: lazy ones waited for at once run on
// the waiting thread; others start on the queue's own, without a waiter.
std::thread::id RanOn(bool lazy) {
  SerialQueue queue(kNever);
  std::atomic<bool> ran{false};
  std::thread::id ran_on;
  auto work = queue.Enqueue(
      [&] {
        ran_on = std::this_thread::get_id();
        ran = true;
        return absl::OkStatus();
      },
      lazy);
  if (lazy) {
    EXPECT_OK(work->Wait());
  } else {
    EXPECT_TRUE(WaitFor([&] { return ran.load(); }, seconds(30), "the collective to run"));
    EXPECT_OK(work->Wait());
  }
  return ran_on;
}

TEST(SerialQueueTest, WaitRunsALazyCollectiveOnTheWaitingThread) {
  EXPECT_EQ(RanOn(/*lazy=*/true), std::this_thread::get_id());
}

TEST(SerialQueueTest, TheQueueThreadStartsACollectiveThatIsNotLazyAtOnce) {
  EXPECT_NE(RanOn(/*lazy=*/false), std::this_thread::get_id());
}

TEST(SerialQueueTest, LazyCollectiveNobodyWaitsForStillRuns) {
  SerialQueue queue(milliseconds(1));
  std::atomic<bool> ran{false};
  auto work = queue.Enqueue(
      [&] {
        ran = true;
        return absl::OkStatus();
      },
      /*lazy=*/true);
  EXPECT_TRUE(WaitFor([&] { return ran.load(); }, seconds(30), "the lazy collective to run"));
  ASSERT_OK(work->Wait(milliseconds(30000)));
}

TEST(SerialQueueTest, DoneHandsALazyCollectiveToTheQueueThread) {
  SerialQueue queue(kNever);
  std::atomic<bool> on_other_thread{false};
  const auto me = std::this_thread::get_id();
  auto work = queue.Enqueue(
      [&] {
        on_other_thread = std::this_thread::get_id() != me;
        return absl::OkStatus();
      },
      /*lazy=*/true);
  EXPECT_TRUE(WaitFor([&] { return work->Done(); }, seconds(30), "Done()"));
  EXPECT_TRUE(on_other_thread.load());
}

TEST(SerialQueueTest, AWaiterRunsNothingAheadOfARunningCollective) {
  SerialQueue queue(kNever);
  std::atomic<bool> a_started{false}, release_a{false};
  std::string order;  // written by one collective at a time
  auto a = queue.Enqueue([&] {
    a_started = true;
    EXPECT_TRUE(WaitFor([&] { return release_a.load(); }, seconds(30), "release"));
    order += "A";
    return absl::OkStatus();
  });
  ASSERT_TRUE(WaitFor([&] { return a_started.load(); }, seconds(30), "A to start"));
  auto b = queue.Enqueue(
      [&] {
        order += "B";
        return absl::OkStatus();
      },
      /*lazy=*/true);
  std::thread waiter([&] { EXPECT_OK(b->Wait()); });
  release_a = true;
  waiter.join();
  ASSERT_OK(a->Wait());
  EXPECT_EQ(order, "AB");
}

TEST(SerialQueueTest, CloseAbortsQueuedLazyCollectives) {
  auto queue = std::make_unique<SerialQueue>(kNever);
  std::atomic<bool> a_started{false}, release_a{false};
  auto a = queue->Enqueue([&] {
    a_started = true;
    EXPECT_TRUE(WaitFor([&] { return release_a.load(); }, seconds(30), "release"));
    return absl::OkStatus();
  });
  ASSERT_TRUE(WaitFor([&] { return a_started.load(); }, seconds(30), "A to start"));
  bool b_ran = false;
  auto b = queue->Enqueue(
      [&] {
        b_ran = true;
        return absl::OkStatus();
      },
      /*lazy=*/true);
  std::thread closer([&] { queue->Close(); });
  release_a = true;
  closer.join();
  ASSERT_OK(a->Wait());
  EXPECT_THAT(b->Wait(), StatusIs(absl::StatusCode::kAborted, HasSubstr("destroyed")));
  EXPECT_FALSE(b_ran);
  EXPECT_THAT(queue->Enqueue([] { return absl::OkStatus(); })->Wait(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("closed")));
}

}  // namespace
}  // namespace deepnex::collective
