#include "deepnex/status.h"

#include <memory>
#include <string>
#include <utility>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

absl::Status Step(bool fail, int* calls) {
  ++*calls;
  if (fail) return absl::NotFoundError("step failed");
  return absl::OkStatus();
}

absl::Status TwoSteps(bool fail_first, bool fail_second, int* calls) {
  DEEPNEX_RETURN_IF_ERROR(Step(fail_first, calls));
  DEEPNEX_RETURN_IF_ERROR(Step(fail_second, calls));
  return absl::AbortedError("reached the end");
}

TEST(ReturnIfErrorTest, ReturnsTheFirstErrorAndStops) {
  int calls = 0;
  EXPECT_THAT(TwoSteps(true, false, &calls),
              StatusIs(absl::StatusCode::kNotFound, "step failed"));
  EXPECT_EQ(calls, 1);
  calls = 0;
  EXPECT_THAT(TwoSteps(false, true, &calls),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(calls, 2);
  calls = 0;
  EXPECT_THAT(TwoSteps(false, false, &calls),
              StatusIs(absl::StatusCode::kAborted, "reached the end"));
  EXPECT_EQ(calls, 2);
}

TEST(ReturnIfErrorTest, EvaluatesItsArgumentOnce) {
  int calls = 0;
  auto f = [&]() -> absl::Status {
    DEEPNEX_RETURN_IF_ERROR(Step(false, &calls));
    return absl::OkStatus();
  };
  EXPECT_THAT(f(), IsOk());
  EXPECT_EQ(calls, 1);
}

TEST(ReturnIfErrorTest, WorksInAnUnbracedIf) {
  auto f = [](bool check) -> absl::Status {
    int calls = 0;
    if (check)
      DEEPNEX_RETURN_IF_ERROR(Step(true, &calls));
    else
      return absl::OkStatus();
    return absl::InternalError("unreachable");
  };
  EXPECT_THAT(f(true), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(f(false), IsOk());
}

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) {
    return absl::InvalidArgumentError("x=" + std::to_string(x) + " is odd");
  }
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  DEEPNEX_ASSIGN_OR_RETURN(int half, Half(x));
  DEEPNEX_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

TEST(AssignOrReturnTest, DeclaresAndAssigns) {
  EXPECT_THAT(Quarter(8), IsOk());
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_THAT(Quarter(7),
              StatusIs(absl::StatusCode::kInvalidArgument, "x=7 is odd"));
  EXPECT_THAT(Quarter(6),
              StatusIs(absl::StatusCode::kInvalidArgument, "x=3 is odd"));
}

absl::Status AssignToExisting(int x, int* out) {
  DEEPNEX_ASSIGN_OR_RETURN(*out, Half(x));
  return absl::OkStatus();
}

TEST(AssignOrReturnTest, AssignsToAnLvalueOnlyOnSuccess) {
  int out = -1;
  EXPECT_THAT(AssignToExisting(10, &out), IsOk());
  EXPECT_EQ(out, 5);
  EXPECT_THAT(AssignToExisting(3, &out),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(out, 5);
}

absl::StatusOr<std::unique_ptr<std::string>> MakeName(bool ok) {
  if (!ok) return absl::UnavailableError("no name");
  return std::make_unique<std::string>("fc1.weight");
}

absl::StatusOr<std::string> UseName(bool ok) {
  DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<std::string> name, MakeName(ok));
  return *name + "!";
}

TEST(AssignOrReturnTest, MovesMoveOnlyValues) {
  EXPECT_EQ(*UseName(true), "fc1.weight!");
  EXPECT_THAT(UseName(false), StatusIs(absl::StatusCode::kUnavailable));
}

absl::StatusOr<int> TwoOnDifferentLines(int a, int b) {
  DEEPNEX_ASSIGN_OR_RETURN(int x, Half(a));
  DEEPNEX_ASSIGN_OR_RETURN(int y, Half(b));
  return x + y;
}

TEST(AssignOrReturnTest, SeveralInOneFunction) {
  EXPECT_EQ(*TwoOnDifferentLines(4, 6), 5);
  EXPECT_THAT(TwoOnDifferentLines(4, 5),
              StatusIs(absl::StatusCode::kInvalidArgument, "x=5 is odd"));
}

// The matchers themselves, on both Status and StatusOr, and their
// descriptions.
TEST(MatchersTest, IsOk) {
  EXPECT_THAT(absl::OkStatus(), IsOk());
  EXPECT_THAT(absl::StatusOr<int>(3), IsOk());
  EXPECT_THAT(absl::InternalError("x"), Not(IsOk()));
  EXPECT_THAT(absl::StatusOr<int>(absl::InternalError("x")), Not(IsOk()));
  EXPECT_OK(absl::OkStatus());
  ASSERT_OK(absl::StatusOr<std::string>("y"));
}

TEST(MatchersTest, StatusIs) {
  absl::Status s = absl::NotFoundError("key \"fc1\" is not there");
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound, HasSubstr("fc1")));
  EXPECT_THAT(
      s, StatusIs(absl::StatusCode::kNotFound, "key \"fc1\" is not there"));
  EXPECT_THAT(s, Not(StatusIs(absl::StatusCode::kInternal)));
  EXPECT_THAT(s, Not(StatusIs(absl::StatusCode::kNotFound, HasSubstr("fc2"))));
  EXPECT_THAT(absl::OkStatus(), StatusIs(absl::StatusCode::kOk));
  absl::StatusOr<int> so = absl::AbortedError("membership changed");
  EXPECT_THAT(so,
              StatusIs(absl::StatusCode::kAborted, StartsWith("membership")));
  EXPECT_THAT(absl::StatusOr<int>(1), StatusIs(absl::StatusCode::kOk));
}

TEST(MatchersTest, DescribeAndExplain) {
  ::testing::Matcher<absl::Status> m =
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("fc1"));
  EXPECT_EQ(::testing::DescribeMatcher<absl::Status>(m),
            "has status code NOT_FOUND and a message that has substring "
            "\"fc1\"");
  ::testing::StringMatchResultListener listener;
  EXPECT_FALSE(m.MatchAndExplain(absl::InternalError("boom"), &listener));
  EXPECT_EQ(listener.str(), "whose code is INTERNAL");

  ::testing::Matcher<absl::StatusOr<int>> ok = IsOk();
  EXPECT_EQ(::testing::DescribeMatcher<absl::StatusOr<int>>(ok), "is OK");
}

TEST(MatchersTest, AssertOkAndAssign) {
  ASSERT_OK_AND_ASSIGN(int q, Quarter(12));
  EXPECT_EQ(q, 3);
  std::unique_ptr<std::string> name;
  ASSERT_OK_AND_ASSIGN(name, MakeName(true));
  EXPECT_EQ(*name, "fc1.weight");
}

}  // namespace
}  // namespace deepnex
