#include "core/file_util.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;

TEST(Crc32cTest, KnownVectors) {
  // RFC 3720, B.4: CRC-32C of 32 zero bytes and of "123456789".
  std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  // Continuation gives the same as one pass.
  EXPECT_EQ(Crc32c("6789", 4, Crc32c("12345", 5)), 0xE3069283u);
}

TEST(FileUtilTest, AtomicWriteReplacesTheFile) {
  std::string dir = ::testing::TempDir() + "/file_util_test/a/b";
  ASSERT_THAT(MakeDirectories(dir), IsOk());
  std::string path = dir + "/f";
  ASSERT_THAT(WriteFileAtomically(path, "one"), IsOk());
  ASSERT_THAT(WriteFileAtomically(path, "two"), IsOk());
  auto got = ReadWholeFile(path, "test file");
  ASSERT_THAT(got.status(), IsOk());
  EXPECT_EQ(*got, "two");
  EXPECT_THAT(ReadWholeFile(dir + "/missing", "test file").status(),
              StatusIs(absl::StatusCode::kNotFound, ::testing::HasSubstr("missing")));
}

}  // namespace
}  // namespace deepnex
