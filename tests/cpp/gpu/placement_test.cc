// Placement on its own: no allocator, no threads, no clock.
#include "gpu/placement.h"

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

class PlacementTest : public ::testing::Test {
 protected:
  NodeState* Add(Node node) {
    EXPECT_OK(placement_.Validate(&node));
    auto n = std::make_unique<NodeState>();
    n->spec = std::move(node);
    n->mode = n->spec.mode;
    const std::string name = n->spec.name;
    placement_.Add(std::move(n));
    return placement_.Find(name);
  }

  // Places one part of `r` and books it as the allocator would; the node's
  // name, or "" when it does not fit.
  std::string Grant(const Request& r, AllocRec* out = nullptr) {
    std::vector<int> pos;
    NodeState* n = placement_.Place(r, &pos);
    if (n == nullptr) return "";
    AllocRec rec;
    rec.num = next_num_++;
    rec.pos = pos;
    rec.a.user = r.user;
    rec.a.node = n->spec.name;
    for (int i : pos) {
      GrantedGpu g;
      g.exclusive = r.mode == Mode::kExclusive;
      g.memory = g.exclusive ? n->spec.gpus[i].memory : r.gpu_memory;
      rec.a.gpus.push_back(g);
    }
    rec.a.cpus = r.cpus;
    rec.a.memory = r.memory;
    placement_.Book(n, &rec);
    if (out != nullptr) *out = rec;
    return n->spec.name;
  }

  std::vector<int> Where(const Request& r) {
    std::vector<int> pos;
    EXPECT_NE(placement_.Place(r, &pos), nullptr);
    return pos;
  }

  Placement placement_;
  uint64_t next_num_ = 1;
};

TEST_F(PlacementTest, ExclusivePacksTheFullestNodeThatFitsAndSpreadsToTheEmptiest) {
  Add(MakeNode("a", 8));
  Add(MakeNode("b", 4));
  Add(MakeNode("c", 2));
  EXPECT_EQ(Grant(Exclusive("alice", 2)), "c");
  EXPECT_EQ(Grant(Exclusive("alice", 3)), "b");
  EXPECT_EQ(Grant(Exclusive("alice", 1)), "b");
  Request spread = Exclusive("bob", 1);
  spread.spread = true;
  EXPECT_EQ(Grant(spread), "a");
  EXPECT_EQ(Grant(Exclusive("bob", 8)), "");
  EXPECT_EQ(placement_.exclusive_index(), (Placement::ExclusiveIndex{{7, 0}}));
  EXPECT_TRUE(placement_.shared_index().empty());
}

TEST_F(PlacementTest, SeveralGpusComeFromOneSwitchThenOneNumaNode) {
  Node sw = MakeNode("sw", 5);
  const int switches[] = {0, 0, 0, 1, 1};
  for (int i = 0; i < 5; ++i) sw.gpus[i].switch_id = switches[i];
  Add(sw);
  // The smallest switch that holds both keeps the larger one whole.
  Request two = Exclusive("alice", 2);
  two.node = "sw";
  EXPECT_THAT(Where(two), ElementsAre(3, 4));

  Node numa = MakeNode("numa", 5);
  const int nodes[] = {0, 1, 1, 0, 0};
  for (int i = 0; i < 5; ++i) numa.gpus[i].numa_node = nodes[i];
  Add(numa);
  two.node = "numa";
  EXPECT_THAT(Where(two), ElementsAre(1, 2));
  // No group holds four: the first free ones.
  Request four = Exclusive("alice", 4);
  four.node = "numa";
  EXPECT_THAT(Where(four), ElementsAre(0, 1, 2, 3));
}

TEST_F(PlacementTest, SharedIsBestFitAndSpreadIsMostFree) {
  Add(MakeNode("s", 2, 80 * kGiB, Mode::kShared));
  AllocRec first;
  EXPECT_EQ(Grant(Shared("alice", 1, 50 * kGiB), &first), "s");
  EXPECT_THAT(first.pos, ElementsAre(0));  // index order breaks the tie
  EXPECT_EQ(first.a.env.at("DEEPNEX_GPU_MEMORY_LIMIT"), std::to_string(50 * kGiB));
  // 30GiB free on GPU 0 is the tightest fit for 20GiB.
  EXPECT_THAT(Where(Shared("bob", 1, 20 * kGiB)), ElementsAre(0));
  Request spread = Shared("bob", 1, 20 * kGiB);
  spread.spread = true;
  EXPECT_THAT(Where(spread), ElementsAre(1));
  EXPECT_THAT(Where(Shared("bob", 1, 40 * kGiB)), ElementsAre(1));
  EXPECT_EQ(placement_.shared_index(),
            (Placement::SharedIndex{{30 * kGiB, 0, 0}, {80 * kGiB, 0, 1}}));
}

TEST_F(PlacementTest, SelectorCordonPendingSwitchAndModeKeepRequestsOff) {
  NodeState* n = Add(MakeNode("n", 2, 80 * kGiB, Mode::kExclusive, 64, 512 * kGiB,
                              {{"rack", "r1"}}));
  Request r = Exclusive("alice", 1);
  r.selector = {{"rack", "r2"}};
  EXPECT_EQ(Grant(r), "");
  r.selector = {{"rack", "r1"}};
  EXPECT_EQ(Grant(Shared("alice", 1, kGiB)), "");  // an exclusive node
  placement_.SetMode(n, Mode::kShared, /*pending=*/true);
  EXPECT_EQ(Grant(r), "");
  EXPECT_EQ(Grant(Exclusive("alice", 0, 4)), "n");  // no GPUs: the mode does not matter
  placement_.SetMode(n, Mode::kExclusive, /*pending=*/false);
  placement_.SetFlags(n, /*cordoned=*/true, /*draining=*/false);
  EXPECT_EQ(Grant(Exclusive("alice", 0, 4)), "");
  placement_.SetFlags(n, false, false);
  EXPECT_EQ(Grant(r), "n");
}

TEST_F(PlacementTest, BookAndUnbookKeepCountersAndIndexes) {
  Add(MakeNode("n", 4, 80 * kGiB, Mode::kExclusive, 16, 64 * kGiB));
  AllocRec rec;
  ASSERT_EQ(Grant(Exclusive("alice", 2, 3, kGiB), &rec), "n");
  EXPECT_EQ(rec.a.id, "a1");
  EXPECT_EQ(rec.a.env.at("CUDA_VISIBLE_DEVICES"), "0,1");
  EXPECT_EQ(rec.a.env.at("NVIDIA_VISIBLE_DEVICES"), "GPU-n-0,GPU-n-1");
  EXPECT_EQ(rec.a.env.count("DEEPNEX_GPU_MEMORY_LIMIT"), 0u);
  NodeState* n = placement_.Find("n");
  NodeInfo info = placement_.Info(*n);
  EXPECT_THAT(info.gpu_allocations, ElementsAre(1, 1, 0, 0));
  EXPECT_THAT(info.gpu_memory_used, ElementsAre(80 * kGiB, 80 * kGiB, 0, 0));
  EXPECT_EQ(info.cpus_used, 3);
  EXPECT_EQ(info.memory_used, kGiB);
  EXPECT_THAT(info.allocation_ids, ElementsAre("a1"));
  EXPECT_EQ(n->free_gpus, 2);
  EXPECT_EQ(n->gpu_allocs, 1);
  EXPECT_EQ(placement_.exclusive_index(), (Placement::ExclusiveIndex{{2, 0}}));
  placement_.Unbook(n, rec);
  info = placement_.Info(*n);
  EXPECT_THAT(info.gpu_allocations, ElementsAre(0, 0, 0, 0));
  EXPECT_EQ(info.cpus_used, 0);
  EXPECT_EQ(info.memory_used, 0u);
  EXPECT_TRUE(info.allocation_ids.empty());
  EXPECT_EQ(placement_.exclusive_index(), (Placement::ExclusiveIndex{{4, 0}}));
  placement_.Remove(n);
  EXPECT_EQ(placement_.Find("n"), nullptr);
  EXPECT_TRUE(placement_.exclusive_index().empty());
}

TEST_F(PlacementTest, ReserveKeepsTheHeadsCapacityFromOthers) {
  Add(MakeNode("n", 2, 80 * kGiB, Mode::kExclusive, 8, 64 * kGiB));
  ASSERT_EQ(Grant(Exclusive("alice", 1)), "n");
  // The head needs both GPUs: the free one and the busy one are held.
  placement_.Reserve(Exclusive("head", 2, 6));
  EXPECT_EQ(Grant(Exclusive("bob", 1)), "");
  EXPECT_EQ(Grant(Exclusive("bob", 0, 3)), "");  // 8 - 6 held < 3
  EXPECT_EQ(Grant(Exclusive("bob", 0, 2)), "n");
  placement_.ClearReservations();
  EXPECT_EQ(Grant(Exclusive("bob", 1)), "n");
}

TEST_F(PlacementTest, InfeasibleSaysWhyARequestCanNeverFit) {
  EXPECT_THAT(placement_.Infeasible(Exclusive("alice", 1)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "the allocator has no nodes (add one with AddNode)"));
  Add(MakeNode("n", 2, 80 * kGiB, Mode::kExclusive, 8, 64 * kGiB, {{"rack", "r1"}}));
  EXPECT_OK(placement_.Infeasible(Exclusive("alice", 2)));
  EXPECT_THAT(placement_.Infeasible(Shared("alice", 1, 81 * kGiB)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "gpu_memory=81GiB is larger than any GPU (the largest has 80GiB)"));
  Request r = Exclusive("alice", 1);
  r.node = "zz";
  EXPECT_THAT(placement_.Infeasible(r),
              StatusIs(absl::StatusCode::kNotFound, "node: no node named \"zz\""));
  r.node = "";
  r.selector = {{"rack", "r9"}};
  EXPECT_THAT(placement_.Infeasible(r),
              StatusIs(absl::StatusCode::kNotFound,
                       "selector {rack=r9}: no node has these labels"));
  EXPECT_THAT(placement_.Infeasible(Shared("alice", 1, kGiB)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "mode=shared: a shared request needs a shared node, and every node that "
                       "could take it is exclusive (n)"));
  EXPECT_THAT(placement_.Infeasible(Exclusive("alice", 3)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       "no node can ever hold this request (alice asks 3 exclusive GPUs, 0 cpus, "
                       "0B memory per part): 1 node(s) match, none has 3 GPUs (the most on one: "
                       "2)"));
  // Each resource no node has is named, with the most one node has: a new
  // user's --memory 1TiB read as a GPU shortage did.
  EXPECT_THAT(placement_.Infeasible(Exclusive("alice", 0, 16, 1024 * kGiB)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       "no node can ever hold this request (alice asks 0 exclusive GPUs, 16 cpus, 1TiB "
                       "memory per part): 1 node(s) match, none has 16 cpus (the most on one: "
                       "8), 1TiB memory (the most on one: 64GiB)"));
}

TEST_F(PlacementTest, ShortageNamesTheResourceThatIsShortNow) {
  Add(MakeNode("n", 2, 80 * kGiB, Mode::kExclusive, 8, 64 * kGiB));
  EXPECT_EQ(placement_.Shortage(Exclusive("alice", 2)), "");
  Request gang = Exclusive("alice", 1);
  gang.replicas = 3;
  EXPECT_EQ(placement_.Shortage(gang), "waiting for room for all 3 parts of the gang at once");
  ASSERT_EQ(Grant(Exclusive("bob", 1, 8)), "n");
  EXPECT_EQ(placement_.Shortage(Exclusive("alice", 2, 1)),
            "waiting for 2 exclusive GPUs (at most 1 free on an eligible node) and 1 cpus (0 "
            "free on any eligible node)");
  placement_.SetFlags(placement_.Find("n"), true, false);
  EXPECT_EQ(placement_.Shortage(Exclusive("alice", 1)),
            "waiting for a node to take it (1 matching node(s), all cordoned or switching "
            "mode)");
}

TEST_F(PlacementTest, ValidateFillsGpuIdsAndRefusesDuplicates) {
  Node n = MakeNode("n", 2);
  ASSERT_OK(placement_.Validate(&n));
  EXPECT_EQ(n.gpus[1].index, 1);
  EXPECT_EQ(n.gpus[1].uuid, "GPU-n-1");
  Add(MakeNode("n", 2));
  Node again = MakeNode("n", 1);
  EXPECT_THAT(placement_.Validate(&again),
              StatusIs(absl::StatusCode::kAlreadyExists, "node n already exists"));
  Node other = MakeNode("m", 1);
  other.gpus[0].uuid = "GPU-n-0";
  EXPECT_THAT(placement_.Validate(&other),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       "node m: gpus[0].uuid=GPU-n-0 is already on node n"));
  Node bad = MakeNode("bad name", 1);
  EXPECT_THAT(placement_.Validate(&bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "node name \"bad name\": use 1-253 letters, digits, '-', '_', '.'"));
}

}  // namespace
}  // namespace deepnex::gpu
