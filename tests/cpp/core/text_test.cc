#include "core/text.h"

#include <string>

#include "gtest/gtest.h"

namespace deepnex {
namespace {

TEST(TextTest, CutTextKeepsWholeCharacters) {
  EXPECT_EQ(CutText("short", 10), "short");
  EXPECT_EQ(CutText("abcdef", 3), "abc... (3 more bytes)");
  // "é" is two bytes: a cut inside it keeps neither.
  EXPECT_EQ(CutText("a\xC3\xA9z", 2), "a... (3 more bytes)");
}

TEST(TextTest, QuotedEscapesAndCuts) {
  EXPECT_EQ(Quoted("plain"), "\"plain\"");
  EXPECT_EQ(Quoted("a\nb\"c"), "\"a\\nb\\\"c\"");
  EXPECT_EQ(Quoted(std::string(70, 'x')), "\"" + std::string(64, 'x') + "\"...");
  EXPECT_EQ(Quoted("abcdef", 3), "\"abc\"...");
}

TEST(TextTest, IsUtf8TakesWellFormedTextOnly) {
  for (const char* good : {"", "ascii", "\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80",
                           "\xF4\x8F\xBF\xBF"}) {
    EXPECT_TRUE(IsUtf8(good)) << Quoted(good);
  }
  for (const char* bad : {"\xFF\xFE", "\xC3", "\xC3(", "\xC0\xAF" /* overlong '/' */,
                          "\xE0\x80\xAF" /* overlong */, "\xED\xA0\x80" /* surrogate */,
                          "\xF4\x90\x80\x80" /* past U+10FFFF */, "\xF8\x88\x80\x80\x80"}) {
    EXPECT_FALSE(IsUtf8(bad)) << Quoted(bad);
  }
}

}  // namespace
}  // namespace deepnex
