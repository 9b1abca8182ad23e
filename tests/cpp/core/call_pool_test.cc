#include "core/call_pool.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "gtest/gtest.h"

namespace deepnex {
namespace {

using std::chrono::milliseconds;

// Calls that each wait for all of the others finish only if none waits for
// a thread behind another: the pool gives every call its own.
TEST(CallPoolTest, EveryCallRunsAtOnceEvenWhenEachWaitsForTheOthers) {
  constexpr int kCalls = 8;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  std::atomic<int> done{0};
  CallPool pool(milliseconds(60000));
  for (int round = 0; round < 2; ++round) {  // the second reuses the idle threads
    {
      std::lock_guard<std::mutex> lock(mu);
      arrived = 0;
    }
    for (int i = 0; i < kCalls; ++i) {
      ASSERT_TRUE(pool.Run([&] {
        std::unique_lock<std::mutex> lock(mu);
        ++arrived;
        cv.notify_all();
        if (cv.wait_for(lock, std::chrono::seconds(30), [&] { return arrived % kCalls == 0; })) {
          ++done;
        }
      }));
    }
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return arrived == kCalls; }));
  }
  pool.Shutdown();
  EXPECT_EQ(done.load(), 2 * kCalls);
}

TEST(CallPoolTest, ShutdownWaitsForTheCallsTakenAndRefusesNewOnes) {
  CallPool pool(milliseconds(10));
  std::atomic<bool> finished{false};
  ASSERT_TRUE(pool.Run([&] {
    std::this_thread::sleep_for(milliseconds(200));
    finished = true;
  }));
  pool.Shutdown();
  EXPECT_TRUE(finished.load());
  EXPECT_FALSE(pool.Run([] {}));
  pool.Shutdown();  // idempotent
}

TEST(CallPoolTest, IdleThreadsEndAndNewCallsStillRun) {
  CallPool pool(milliseconds(1));
  std::atomic<int> ran{0};
  ASSERT_TRUE(pool.Run([&] { ++ran; }));
  std::this_thread::sleep_for(milliseconds(50));  // past the idle time: that thread ended
  ASSERT_TRUE(pool.Run([&] { ++ran; }));
  pool.Shutdown();
  EXPECT_EQ(ran.load(), 2);
}

}  // namespace
}  // namespace deepnex
