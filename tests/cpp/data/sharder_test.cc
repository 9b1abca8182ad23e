#include "deepnex/data/sharder.h"

#include <algorithm>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex::data {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

Sharder Make(uint64_t size, int num_shards, int shard, Remainder remainder = Remainder::kPad,
             uint64_t seed = 7, bool shuffle = true) {
  SharderOptions o;
  o.size = size;
  o.num_shards = num_shards;
  o.shard = shard;
  o.remainder = remainder;
  o.seed = seed;
  o.shuffle = shuffle;
  absl::StatusOr<Sharder> s = Sharder::Create(o);
  EXPECT_THAT(s, IsOk());
  return *std::move(s);
}

TEST(SharderTest, DropShardsAreDisjointEqualAndCoverAllButTheRemainder) {
  for (uint64_t epoch : {0, 1, 5}) {
    std::set<uint64_t> seen;
    for (int k = 0; k < 4; ++k) {
      std::vector<uint64_t> idx = Make(103, 4, k, Remainder::kDrop).Indices(epoch);
      ASSERT_EQ(idx.size(), 25u);
      for (uint64_t i : idx) {
        EXPECT_LT(i, 103u);
        EXPECT_TRUE(seen.insert(i).second) << "index " << i << " in two shards";
      }
    }
    EXPECT_EQ(seen.size(), 100u);
  }
}

TEST(SharderTest, PadShardsAreEqualAndCoverEverything) {
  std::vector<uint64_t> all;
  for (int k = 0; k < 4; ++k) {
    std::vector<uint64_t> idx = Make(103, 4, k).Indices(3);
    ASSERT_EQ(idx.size(), 26u);
    all.insert(all.end(), idx.begin(), idx.end());
  }
  std::set<uint64_t> distinct(all.begin(), all.end());
  EXPECT_EQ(distinct.size(), 103u);
  EXPECT_EQ(all.size(), 104u);
  // The one pad repeats the permutation's first index.
  EXPECT_EQ(all.back(), Make(103, 4, 0).Permutation(3).front());
}

TEST(SharderTest, PadWrapsMoreThanOnceWhenSmallerThanTheShardCount) {
  std::vector<uint64_t> all;
  for (int k = 0; k < 5; ++k) {
    std::vector<uint64_t> idx = Make(2, 5, k, Remainder::kPad, 0, false).Indices(0);
    all.insert(all.end(), idx.begin(), idx.end());
  }
  EXPECT_THAT(all, ElementsAre(0, 1, 0, 1, 0));
}

TEST(SharderTest, WithoutShuffleEachShardIsAContiguousBlock) {
  EXPECT_THAT(Make(10, 3, 1, Remainder::kDrop, 0, false).Indices(4), ElementsAre(3, 4, 5));
  EXPECT_THAT(Make(10, 3, 2, Remainder::kPad, 0, false).Indices(4), ElementsAre(8, 9, 0, 1));
}

TEST(SharderTest, SameSeedAndEpochGiveTheSamePermutationEverywhere) {
  // Pinned values: a change here breaks resumed jobs and mixed-platform
  // jobs; the Python test checks the same numbers with its own splitmix64.
  EXPECT_THAT(Make(10, 1, 0, Remainder::kPad, 42).Permutation(0),
              ElementsAre(8, 0, 2, 5, 7, 6, 9, 3, 4, 1));
  Sharder a = Make(1000, 2, 0), b = Make(1000, 2, 0);
  EXPECT_EQ(a.Permutation(2), b.Permutation(2));
}

TEST(SharderTest, EpochsAndSeedsDiffer) {
  Sharder s = Make(1000, 2, 0);
  EXPECT_NE(s.Permutation(0), s.Permutation(1));
  EXPECT_NE(s.Indices(0), s.Indices(1));
  EXPECT_NE(s.Permutation(0), Make(1000, 2, 0, Remainder::kPad, 8).Permutation(0));
  std::vector<uint64_t> p = s.Permutation(1);
  std::sort(p.begin(), p.end());
  for (uint64_t i = 0; i < p.size(); ++i) ASSERT_EQ(p[i], i);
}

TEST(SharderTest, NextWalksEpochsInBatches) {
  Sharder s = Make(20, 2, 1);
  std::vector<uint64_t> e0 = s.Indices(0), e1 = s.Indices(1);
  std::vector<uint64_t> got = s.Next(4);
  EXPECT_EQ(got, std::vector<uint64_t>(e0.begin(), e0.begin() + 4));
  EXPECT_EQ(s.position(), 4u);
  got = s.Next(100);  // stops at the end of the epoch
  EXPECT_EQ(got, std::vector<uint64_t>(e0.begin() + 4, e0.end()));
  EXPECT_EQ(s.epoch(), 1u);
  EXPECT_EQ(s.position(), 0u);
  EXPECT_EQ(s.Next(3), std::vector<uint64_t>(e1.begin(), e1.begin() + 3));
}

TEST(SharderTest, ResumeFromACursorGivesExactlyTheRest) {
  Sharder first = Make(50, 3, 2, Remainder::kDrop);
  std::vector<uint64_t> taken = first.Next(5);
  std::vector<uint64_t> more = first.Next(2);
  taken.insert(taken.end(), more.begin(), more.end());
  uint64_t epoch = first.epoch(), position = first.position();

  Sharder resumed = Make(50, 3, 2, Remainder::kDrop);
  ASSERT_THAT(resumed.Seek(epoch, position), IsOk());
  std::vector<uint64_t> rest = resumed.Next(1000);
  taken.insert(taken.end(), rest.begin(), rest.end());
  EXPECT_EQ(taken, resumed.Indices(0));
  EXPECT_EQ(resumed.epoch(), 1u);
}

TEST(SharderTest, SeekToTheEndIsTheNextEpoch) {
  Sharder s = Make(10, 2, 0);
  ASSERT_THAT(s.Seek(3, 5), IsOk());
  EXPECT_EQ(s.epoch(), 4u);
  EXPECT_EQ(s.position(), 0u);
  EXPECT_THAT(s.Seek(3, 6), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("position: 6 is past the shard's 5")));
}

TEST(SharderTest, BadInputsNameTheFieldAndValue) {
  SharderOptions o;
  o.size = 10;
  o.num_shards = 0;
  EXPECT_THAT(Sharder::Create(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("num_shards: 0")));
  o.num_shards = -2;
  EXPECT_THAT(Sharder::Create(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("num_shards: -2")));
  o.num_shards = 4;
  o.shard = 4;
  EXPECT_THAT(Sharder::Create(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("shard: 4 is out of range [0, 4)")));
  o.shard = -1;
  EXPECT_THAT(Sharder::Create(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("shard: -1")));
  o.shard = 0;
  o.size = 3;
  o.remainder = Remainder::kDrop;
  EXPECT_THAT(Sharder::Create(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("size: 3 is below num_shards 4")));
  o.size = 0;
  o.remainder = Remainder::kPad;
  EXPECT_THAT(Sharder::Create(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("size: 0")));
  EXPECT_THAT(ParseRemainder("keep"), StatusIs(absl::StatusCode::kInvalidArgument,
                                               HasSubstr("remainder: \"keep\"")));
  EXPECT_THAT(ParseRemainder("drop"), IsOk());
}

}  // namespace
}  // namespace deepnex::data
