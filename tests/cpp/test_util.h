// Waiting in tests. A test that depends on something another thread or
// process does waits for the very condition it asserts next, with a generous
// deadline; never on a sleep or on the order of output, which a loaded or a
// fast machine both upset:
//
//   ASSERT_TRUE(WaitFor([&] { return alloc->QueueLength() == 1; }, 60s,
//                       "bob's request in the queue"));
#ifndef DEEPNEX_TESTS_TEST_UTIL_H_
#define DEEPNEX_TESTS_TEST_UTIL_H_

#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace deepnex::test {

// Polls `done` every 10 ms until it holds. After `timeout`, a failure that
// says what was awaited and for how long.
inline ::testing::AssertionResult WaitFor(const std::function<bool()>& done,
                                          std::chrono::milliseconds timeout,
                                          const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) {
      return ::testing::AssertionFailure() << "waited " << timeout.count() << " ms for " << what;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return ::testing::AssertionSuccess();
}

}  // namespace deepnex::test

#endif  // DEEPNEX_TESTS_TEST_UTIL_H_
