#include "deepnex/data/sharder.h"

#include <algorithm>
#include <chrono>
#include <limits>
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
  // Past the last epoch the cursor could count to 2^63, a state that a
  // signed 64-bit checkpoint cannot hold.
  EXPECT_THAT(s.Seek(kMaxEpoch + 1, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       absl::StrCat("epoch: ", kMaxEpoch + 1, " is past the last epoch, ",
                                    kMaxEpoch)));
  ShardState from = s.state();
  from.epoch = uint64_t{1} << 63;
  EXPECT_THAT(s.Reshard(from, 2, 0), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("state.epoch: 9223372036854775808")));
  ASSERT_THAT(s.Seek(kMaxEpoch, 5), IsOk());
  EXPECT_EQ(s.epoch(), kMaxEpoch + 1);
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
  o.size = kMaxSharderSize + 1;
  EXPECT_THAT(Sharder::Create(o),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "size: 4294967297 items is more than a Sharder holds (4294967296: each "
                       "epoch's permutation is kept in memory, 8 bytes an item)"));
  EXPECT_THAT(ParseRemainder("keep"), StatusIs(absl::StatusCode::kInvalidArgument,
                                               HasSubstr("remainder: \"keep\"")));
  EXPECT_THAT(ParseRemainder("drop"), IsOk());
}


// A world of shards in lockstep: every step each takes one batch.
std::vector<Sharder> World(uint64_t size, int n, Remainder remainder = Remainder::kPad) {
  std::vector<Sharder> world;
  for (int k = 0; k < n; ++k) world.push_back(Make(size, n, k, remainder));
  return world;
}

// Steps every shard `steps` times by `batch`, adding what they yield to `seen`.
void Step(std::vector<Sharder>& world, int steps, uint64_t batch, std::multiset<uint64_t>* seen) {
  for (int i = 0; i < steps; ++i) {
    for (Sharder& s : world) {
      for (uint64_t x : s.Next(batch)) seen->insert(x);
    }
  }
}

// The world's shards re-sharded to `m` from shard 0's state (as rank 0
// broadcasts it).
std::vector<Sharder> Reshard(const std::vector<Sharder>& world, int m) {
  ShardState from = world[0].state();
  std::vector<Sharder> out;
  for (int k = 0; k < m; ++k) {
    Sharder s = world[k % world.size()];
    EXPECT_THAT(s.Reshard(from, m, k), IsOk());
    out.push_back(s);
  }
  return out;
}

// Takes the rest of the cursor's epoch from every shard in lockstep; checks
// that they end it together.
std::multiset<uint64_t> RestOfEpoch(std::vector<Sharder>& world, uint64_t batch) {
  std::multiset<uint64_t> rest;
  const uint64_t epoch = world[0].epoch();
  while (world[0].epoch() == epoch) {
    for (Sharder& s : world) {
      EXPECT_EQ(s.epoch(), epoch);
      for (uint64_t x : s.Next(batch)) rest.insert(x);
    }
  }
  for (const Sharder& s : world) EXPECT_EQ(s.epoch(), epoch + 1);
  return rest;
}

std::multiset<uint64_t> Unseen(uint64_t size, const std::multiset<uint64_t>& seen) {
  std::multiset<uint64_t> out;
  for (uint64_t i = 0; i < size; ++i) {
    if (seen.count(i) == 0) out.insert(i);
  }
  return out;
}

// Checks what the m shards of a re-sharded epoch handed out (`rest`) against
// the items no shard had (`unseen`): each once, every shard as many; kPad
// repeats a few (fewer than m), kDrop leaves a few out (fewer than m).
void ExpectEvenSplit(const std::multiset<uint64_t>& rest, const std::multiset<uint64_t>& unseen,
                     int m, Remainder remainder) {
  const uint64_t t = unseen.size(), n = static_cast<uint64_t>(m);
  const std::set<uint64_t> distinct(rest.begin(), rest.end());
  if (remainder == Remainder::kPad) {
    EXPECT_EQ(rest.size(), (t + n - 1) / n * n);
    EXPECT_EQ(distinct, std::set<uint64_t>(unseen.begin(), unseen.end()));
  } else {
    EXPECT_EQ(rest.size(), t / n * n);
    EXPECT_EQ(distinct.size(), rest.size());
    EXPECT_TRUE(std::includes(unseen.begin(), unseen.end(), rest.begin(), rest.end()));
  }
}

TEST(SharderReshardTest, SplitsTheEpochsRestOverANewWorldExactly) {
  struct Case {
    uint64_t size;
    int from, to, steps;
    uint64_t batch;
  };
  for (const Case& c : {Case{103, 1, 2, 5, 4}, Case{103, 2, 1, 3, 8}, Case{100, 4, 3, 2, 7},
                        Case{10, 4, 2, 2, 1}, Case{1000, 3, 7, 11, 9}, Case{7, 2, 5, 1, 2}}) {
    SCOPED_TRACE(testing::Message() << c.size << " items, " << c.from << " -> " << c.to);
    std::vector<Sharder> world = World(c.size, c.from);
    std::multiset<uint64_t> seen;
    Step(world, c.steps, c.batch, &seen);
    const uint64_t epoch = world[0].epoch();
    ASSERT_EQ(epoch, 0u);
    std::vector<Sharder> grown = Reshard(world, c.to);
    for (const Sharder& s : grown) EXPECT_EQ(s.Indices(epoch).size(), grown[0].epoch_length());
    // Each index of the epoch not yet handed out, a few of them twice.
    ExpectEvenSplit(RestOfEpoch(grown, c.batch), Unseen(c.size, seen), c.to, Remainder::kPad);
    // The next epoch is laid out for the new world as usual.
    for (int k = 0; k < c.to; ++k) {
      EXPECT_EQ(grown[k].Indices(epoch + 1), Make(c.size, c.to, k).Indices(epoch + 1));
      EXPECT_EQ(grown[k].state().ranges.size(), 0u);
    }
  }
}

TEST(SharderReshardTest, EverySmallWorldAndCursorTwiceOverIsExact) {
  // Sizes around the world sizes (padding that wraps, shards left empty),
  // every cursor of the first world, then one step and another world. (The
  // same world again is a resume, which keeps kPad's repeats.)
  for (uint64_t size : {1, 2, 3, 5, 7, 12}) {
    for (int n = 1; n <= 4; ++n) {
      for (int m = 1; m <= 4; ++m) {
        for (int l : {1, 3}) {
          if (m == n || l == m) continue;
          const uint64_t steps = (size + n - 1) / n;
          for (uint64_t p = 1; p < steps; ++p) {
            SCOPED_TRACE(testing::Message() << size << " items, " << n << " -> " << m << " at "
                                            << p << " -> " << l);
            std::vector<Sharder> world = World(size, n);
            std::multiset<uint64_t> seen;
            Step(world, static_cast<int>(p), 1, &seen);
            std::vector<Sharder> second = Reshard(world, m);
            if (second[0].epoch() == 0) Step(second, 1, 1, &seen);
            if (second[0].epoch() != 0) continue;  // that step ended the epoch
            std::vector<Sharder> third = Reshard(second, l);
            ExpectEvenSplit(RestOfEpoch(third, 2), Unseen(size, seen), l, Remainder::kPad);
          }
        }
      }
    }
  }
}

TEST(SharderReshardTest, ASecondReshardInTheSameEpochIsExactToo) {
  std::vector<Sharder> world = World(101, 2, Remainder::kDrop);
  std::multiset<uint64_t> seen;
  Step(world, 4, 3, &seen);
  std::vector<Sharder> three = Reshard(world, 3);
  ASSERT_FALSE(three[0].state().ranges.empty());
  Step(three, 2, 5, &seen);
  std::vector<Sharder> one = Reshard(three, 1);
  std::multiset<uint64_t> rest = RestOfEpoch(one, 4);
  // kDrop left out permutation position 100 of the epoch's 101 items, and
  // the 3-shard world the 1 of its 76 that 3 shards could not take evenly.
  std::multiset<uint64_t> unseen = Unseen(101, seen);
  unseen.erase(Make(101, 2, 0).Permutation(0)[100]);
  EXPECT_EQ(seen.size() + rest.size(), 99u);
  EXPECT_EQ(std::set<uint64_t>(rest.begin(), rest.end()).size(), rest.size());
  EXPECT_TRUE(std::includes(unseen.begin(), unseen.end(), rest.begin(), rest.end()));
}

TEST(SharderReshardTest, EveryBlockOfAReshardedEpochIsAsLongAsTheOthers) {
  // A torch DataLoader over a shard one item shorter took one batch fewer
  // than the other ranks, and DDP hung on the missing step. Unshuffled, 2
  // shards of 5 took 2 each (0, 1 and 5, 6): 2, 3, 4, 7, 8, 9 are left for 4
  // shards, blocks 2, 2, 1, 1 before the policy evens them.
  auto four = [](Remainder remainder) {
    std::vector<Sharder> world;
    for (int k = 0; k < 2; ++k) world.push_back(Make(10, 2, k, remainder, 7, false));
    std::multiset<uint64_t> seen;
    Step(world, 1, 2, &seen);
    EXPECT_EQ(seen, (std::multiset<uint64_t>{0, 1, 5, 6}));
    return Reshard(world, 4);
  };
  // kPad: the shorter blocks end with the rest's first items, as Horovod's
  // ElasticSampler pads.
  std::vector<Sharder> pad = four(Remainder::kPad);
  const std::vector<std::vector<uint64_t>> padded = {{2, 3}, {4, 7}, {8, 2}, {9, 3}};
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(pad[k].epoch_length(), 2u);
    EXPECT_EQ(pad[k].remaining(), 2u);
    EXPECT_EQ(pad[k].Indices(0), padded[k]) << k;
    EXPECT_EQ(pad[k].Next(1), std::vector<uint64_t>{padded[k][0]}) << k;
    EXPECT_EQ(pad[k].remaining(), 1u);
    EXPECT_EQ(pad[k].Next(1), std::vector<uint64_t>{padded[k][1]}) << k;
    EXPECT_EQ(pad[k].epoch(), 1u);
  }
  // kDrop: the longer blocks' last items (3 and 7) are left out.
  std::vector<Sharder> drop = four(Remainder::kDrop);
  const std::vector<std::vector<uint64_t>> dropped = {{2}, {4}, {8}, {9}};
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(drop[k].epoch_length(), 1u);
    EXPECT_EQ(drop[k].Next(5), dropped[k]) << k;
    EXPECT_EQ(drop[k].epoch(), 1u);
  }
}

TEST(SharderReshardTest, FewerItemsLeftThanShardsWithDropIsTheNextEpoch) {
  // Unshuffled, 2 shards of 5 took 4 each: 4 and 9 are left, fewer than 3
  // shards, and kDrop gives each shard as many: none. The cursor moves on
  // instead of laying out an epoch of no positions.
  std::vector<Sharder> world;
  for (int k = 0; k < 2; ++k) world.push_back(Make(10, 2, k, Remainder::kDrop, 7, false));
  std::multiset<uint64_t> seen;
  Step(world, 4, 1, &seen);
  std::vector<Sharder> three = Reshard(world, 3);
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(three[k].epoch(), 1u);
    EXPECT_EQ(three[k].position(), 0u);
    EXPECT_TRUE(three[k].state().ranges.empty());
    EXPECT_EQ(three[k].Indices(1), Make(10, 3, k, Remainder::kDrop, 7, false).Indices(1));
  }
  // With kPad the two are split over 3 shards, the first repeated.
  std::vector<Sharder> padded;
  for (int k = 0; k < 2; ++k) padded.push_back(Make(10, 2, k, Remainder::kPad, 7, false));
  Step(padded, 4, 1, &seen);
  std::vector<Sharder> pad = Reshard(padded, 3);
  EXPECT_EQ(pad[0].Indices(0), std::vector<uint64_t>{4});
  EXPECT_EQ(pad[1].Indices(0), std::vector<uint64_t>{9});
  EXPECT_EQ(pad[2].Indices(0), std::vector<uint64_t>{4});
}

TEST(SharderReshardTest, RemainingIsWhatNextYieldsToTheEpochsEnd) {
  // Python's len() was shard_size() whatever the cursor.
  Sharder s = Make(10, 2, 0);
  EXPECT_EQ(s.remaining(), 5u);
  s.Next(2);
  EXPECT_EQ(s.remaining(), 3u);
  s.Next(3);
  EXPECT_EQ(s.remaining(), 5u);  // the next epoch, whole
  // 2 shards of 5 took 2 each: 6 left over 4 shards, 2 each (kPad).
  std::vector<Sharder> world = World(10, 2);
  std::multiset<uint64_t> seen;
  Step(world, 1, 2, &seen);
  std::vector<Sharder> four = Reshard(world, 4);
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(four[k].remaining(), 2u) << k;
    EXPECT_EQ(four[k].Indices(0).size(), 2u) << k;
  }
  four[3].Next(1);
  EXPECT_EQ(four[3].remaining(), 1u);
}

TEST(SharderReshardTest, PadRepeatsAlreadyHandedOutAreLeftOut) {
  // 10 items, 4 shards of 3: shard 3's last two are the padding, repeating
  // permutation positions 0 and 1, which shard 0 has handed out.
  std::vector<Sharder> world = World(10, 4);
  std::multiset<uint64_t> seen;
  Step(world, 1, 2, &seen);
  std::vector<Sharder> two = Reshard(world, 2);
  std::vector<uint64_t> p = world[0].Permutation(0);
  EXPECT_EQ(two[0].state().ranges, (std::vector<std::pair<uint64_t, uint64_t>>{{2, 3}, {5, 6},
                                                                               {8, 9}}));
  // Three left for 2 shards: the first of them pads the second shard.
  EXPECT_EQ(two[1].Indices(0), (std::vector<uint64_t>{p[8], p[2]}));
  EXPECT_EQ(RestOfEpoch(two, 1), (std::multiset<uint64_t>{p[2], p[5], p[8], p[2]}));
}

TEST(SharderReshardTest, TheSameWorldResumesAndAnEpochStartIsLaidOutAsUsual) {
  std::vector<Sharder> world = World(50, 3);
  std::multiset<uint64_t> seen;
  Step(world, 2, 4, &seen);
  Sharder resumed = Make(50, 3, 1);
  ASSERT_THAT(resumed.Reshard(world[0].state(), 3, 1), IsOk());
  EXPECT_EQ(resumed.position(), 8u);
  EXPECT_EQ(resumed.Next(100), world[1].Next(100));

  Sharder fresh = Make(50, 3, 2);
  ASSERT_THAT(fresh.Seek(4, 0), IsOk());
  ASSERT_THAT(fresh.Reshard(fresh.state(), 2, 1), IsOk());
  EXPECT_EQ(fresh.epoch(), 4u);
  EXPECT_EQ(fresh.Next(1000), Make(50, 2, 1).Indices(4));
}

TEST(SharderReshardTest, AWorldOfManyBlocksOverManyRangesReshardsInLinearTime) {
  // 2^17 shards' blocks over 2^16 ranges: each block skipped the ranges
  // before it from the first one, 6e9 steps (9 s here); now one walk.
  constexpr uint64_t kSize = uint64_t{1} << 17;
  ShardState from;
  from.num_shards = static_cast<int>(kSize);
  for (uint64_t p = 0; p < kSize; p += 2) from.ranges.emplace_back(p, p + 1);
  Sharder s = Make(kSize, 2, 1);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_THAT(s.Reshard(from, 2, 1), IsOk());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  // Nothing was handed out: the new world takes every range's item.
  EXPECT_EQ(s.state().ranges, from.ranges);
  EXPECT_EQ(s.epoch_length(), kSize / 4);
}

TEST(SharderReshardTest, BadStatesAndWorldsNameTheFieldAndValue) {
  Sharder s = Make(10, 2, 0);
  ShardState from = s.state();
  EXPECT_THAT(s.Reshard(from, 0, 0), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("num_shards: 0")));
  EXPECT_THAT(s.Reshard(from, 2, 2), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("shard: 2 is out of range [0, 2)")));
  from.position = 6;
  EXPECT_THAT(s.Reshard(from, 3, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("state.position: 6 is past the epoch's 5 positions")));
  from.position = 0;
  from.num_shards = -1;
  EXPECT_THAT(s.Reshard(from, 3, 0), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("state.num_shards: -1")));
  from.num_shards = 2;
  from.ranges = {{3, 11}};
  EXPECT_THAT(s.Reshard(from, 3, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("state.ranges: [3, 11) is not a non-empty range within [0, 10)")));
  // Overlapping ranges handed their items out twice.
  from.ranges = {{0, 10}, {0, 10}};
  EXPECT_THAT(s.Reshard(from, 3, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("state.ranges: [0, 10) overlaps or precedes the range before")));
  // A world of 2^31 - 1 laid out a block per shard: 51 GB.
  from.ranges = {};
  from.num_shards = std::numeric_limits<int>::max();
  EXPECT_THAT(s.Reshard(from, 3, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("state.num_shards: 2147483647 is not in 1-65536")));
  // A failed reshard leaves the sharder as it was.
  EXPECT_EQ(s.options().num_shards, 2);
  EXPECT_EQ(s.position(), 0u);
}

}  // namespace
}  // namespace deepnex::data
