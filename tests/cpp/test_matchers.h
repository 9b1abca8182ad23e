// gMock matchers for absl::Status and absl::StatusOr<T> (Debian's abseil
// ships none):
//
//   EXPECT_THAT(DoIt(), IsOk());
//   EXPECT_THAT(ParseByteSize("x"),
//   StatusIs(absl::StatusCode::kInvalidArgument)); EXPECT_THAT(s,
//   StatusIs(absl::StatusCode::kNotFound, HasSubstr("fc1")));
//   ASSERT_OK_AND_ASSIGN(uint64_t n, ParseByteSize("8GiB"));
//
// Each works on absl::Status and on any absl::StatusOr<T>. The matchers live
// in deepnex::test (not deepnex::testing, which would hide ::testing inside
// namespace deepnex); tests say `using ::deepnex::test::IsOk;`.
#ifndef DEEPNEX_TESTS_TEST_MATCHERS_H_
#define DEEPNEX_TESTS_TEST_MATCHERS_H_

#include <ostream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

// Lets gtest print a StatusOr in failure messages (abseil added its own
// PrintTo after this release).
#if defined(ABSL_LTS_RELEASE_VERSION) && ABSL_LTS_RELEASE_VERSION <= 20220623
namespace absl {
template <typename T>
void PrintTo(const StatusOr<T>& status_or, std::ostream* os) {
  if (status_or.ok()) {
    *os << "OK: " << ::testing::PrintToString(*status_or);
  } else {
    *os << status_or.status();
  }
}
}  // namespace absl
#endif

namespace deepnex::test {
namespace internal {

inline const absl::Status& GetStatus(const absl::Status& status) {
  return status;
}
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

class IsOkMatcher {
 public:
  template <typename T>
  bool MatchAndExplain(const T& value,
                       ::testing::MatchResultListener* listener) const {
    return GetStatus(value).ok();
  }
  void DescribeTo(std::ostream* os) const { *os << "is OK"; }
  void DescribeNegationTo(std::ostream* os) const { *os << "is not OK"; }
};

class StatusIsMatcher {
 public:
  StatusIsMatcher(absl::StatusCode code,
                  ::testing::Matcher<const std::string&> message)
      : code_(code), message_(std::move(message)) {}

  template <typename T>
  bool MatchAndExplain(const T& value,
                       ::testing::MatchResultListener* listener) const {
    const absl::Status& status = GetStatus(value);
    if (status.code() != code_) {
      *listener << "whose code is " << absl::StatusCodeToString(status.code());
      return false;
    }
    std::string message(status.message());
    ::testing::StringMatchResultListener inner;
    if (!message_.MatchAndExplain(message, &inner)) {
      *listener << "whose message does not match";
      if (!inner.str().empty()) *listener << ", " << inner.str();
      return false;
    }
    return true;
  }
  void DescribeTo(std::ostream* os) const {
    *os << "has status code " << absl::StatusCodeToString(code_)
        << " and a message that ";
    message_.DescribeTo(os);
  }
  void DescribeNegationTo(std::ostream* os) const {
    *os << "has a status code other than " << absl::StatusCodeToString(code_)
        << " or a message that ";
    message_.DescribeNegationTo(os);
  }

 private:
  absl::StatusCode code_;
  ::testing::Matcher<const std::string&> message_;
};

}  // namespace internal

// Matches an OK absl::Status or an absl::StatusOr<T> holding a value.
inline ::testing::PolymorphicMatcher<internal::IsOkMatcher> IsOk() {
  return ::testing::MakePolymorphicMatcher(internal::IsOkMatcher());
}

// Matches a status with `code`, whatever its message.
inline ::testing::PolymorphicMatcher<internal::StatusIsMatcher> StatusIs(
    absl::StatusCode code) {
  return ::testing::MakePolymorphicMatcher(
      internal::StatusIsMatcher(code, ::testing::A<const std::string&>()));
}

// Matches a status with `code` and a message matching `message` (a matcher
// such as HasSubstr("x"), or a string for equality).
template <typename MessageMatcher>
::testing::PolymorphicMatcher<internal::StatusIsMatcher> StatusIs(
    absl::StatusCode code, MessageMatcher&& message) {
  return ::testing::MakePolymorphicMatcher(internal::StatusIsMatcher(
      code, ::testing::MatcherCast<const std::string&>(
                std::forward<MessageMatcher>(message))));
}

}  // namespace deepnex::test

#define DEEPNEX_TEST_CONCAT_INNER_(a, b) a##b
#define DEEPNEX_TEST_CONCAT_(a, b) DEEPNEX_TEST_CONCAT_INNER_(a, b)

#define EXPECT_OK(expr) EXPECT_THAT((expr), ::deepnex::test::IsOk())
#define ASSERT_OK(expr) ASSERT_THAT((expr), ::deepnex::test::IsOk())

// `lhs` is a declaration or an lvalue; `rexpr` an absl::StatusOr<T>. Fails the
// test (fatally) when it holds an error, or moves the value into `lhs`.
#define ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  ASSERT_OK_AND_ASSIGN_IMPL_(            \
      DEEPNEX_TEST_CONCAT_(deepnex_test_statusor_, __LINE__), lhs, rexpr)
#define ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, rexpr)   \
  auto statusor = (rexpr);                                 \
  ASSERT_THAT(statusor.status(), ::deepnex::test::IsOk()); \
  lhs = std::move(statusor).value()

#endif  // DEEPNEX_TESTS_TEST_MATCHERS_H_
