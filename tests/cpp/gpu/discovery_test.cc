// NVML discovery without a driver, the local node, and node files.
#include "deepnex/gpu/discovery.h"

#include <dlfcn.h>
#include <unistd.h>

#include <fstream>

#include "absl/strings/str_cat.h"
#include "deepnex/gpu/allocator.h"
#include "deepnex/units.h"
#include "gmock/gmock.h"
#include "gpu/gpu_test_util.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex::gpu {
namespace {

using ::deepnex::test::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using namespace ::deepnex::gpu::test;  // NOLINT

TEST(Discovery, MissingNvmlIsZeroGpusNotAnError) {
  LocalGpus local = DiscoverLocalGpus("libnvidia-ml-that-does-not-exist.so.1");
  EXPECT_TRUE(local.gpus.empty());
  EXPECT_TRUE(local.links.empty());
  EXPECT_EQ(local.summary, "0 GPUs (NVML not found)");
}

TEST(Discovery, GpuMemoryByProcessWithoutNvmlIsEmpty) {
  EXPECT_TRUE(GpuMemoryByProcess("libnvidia-ml-that-does-not-exist.so.1").empty());
  // Asked again, the cached failure answers the same.
  EXPECT_TRUE(GpuMemoryByProcess("libnvidia-ml-that-does-not-exist.so.1").empty());
  // This process holds no CUDA context, so NVML (where present) lists no
  // memory of it.
  for (const auto& [gpu, by_pid] : GpuMemoryByProcess()) {
    EXPECT_EQ(by_pid.count(getpid()), 0u) << "GPU " << gpu;
  }
}

TEST(Discovery, ThisMachine) {
  LocalGpus local = DiscoverLocalGpus();
  std::cout << "local GPUs: " << local.summary << "\n";
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    EXPECT_EQ(local.summary, "0 GPUs (NVML not found)");
    EXPECT_TRUE(local.gpus.empty());
  } else {
    dlclose(lib);
    for (size_t i = 0; i < local.gpus.size(); ++i) {
      EXPECT_GT(local.gpus[i].memory, 0u);
      EXPECT_FALSE(local.gpus[i].uuid.empty());
      EXPECT_EQ(local.links[i][i], GpuLink::kSelf);
    }
  }
}

TEST(Discovery, LocalNodeServesCpuWork) {
  ASSERT_OK_AND_ASSIGN(Node node, LocalNode("here"));
  EXPECT_EQ(node.name, "here");
  EXPECT_GT(node.cpus, 0);
  EXPECT_GT(node.memory, 0u);
  ASSERT_OK_AND_ASSIGN(auto alloc, Allocator::Create());
  ASSERT_OK(alloc->AddNode(node));
  ASSERT_OK_AND_ASSIGN(Allocation a, alloc->Allocate(Exclusive("alice", 0, 1)));
  EXPECT_EQ(a.node, "here");
}

constexpr char kGood[] = R"({
  "nodes": [
    {"name": "n1", "cpus": 64, "memory": "512GiB", "mode": "shared",
     "labels": {"gpu": "h100"}, "gpus": {"count": 8, "memory": "80GiB"}},
    {"name": "n2", "cpus": 32, "memory": 274877906944,
     "gpus": [{"memory": "40GiB", "uuid": "GPU-aaa", "numa_node": 0, "switch_id": 0},
              {"memory": "40GiB", "uuid": "GPU-bbb", "numa_node": 1, "switch_id": 1}]}
  ]
})";

TEST(NodesFile, ParsesBothGpuForms) {
  ASSERT_OK_AND_ASSIGN(std::vector<Node> nodes, ParseNodesJson(kGood, "nodes.json"));
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[0].name, "n1");
  EXPECT_EQ(nodes[0].mode, Mode::kShared);
  EXPECT_EQ(nodes[0].gpus.size(), 8u);
  EXPECT_EQ(nodes[0].gpus[7].memory, 80 * kGiB);
  EXPECT_EQ(nodes[0].labels.at("gpu"), "h100");
  EXPECT_EQ(nodes[1].memory, 256 * kGiB);
  EXPECT_EQ(nodes[1].mode, Mode::kExclusive);
  EXPECT_EQ(nodes[1].gpus[1].uuid, "GPU-bbb");
  EXPECT_EQ(nodes[1].gpus[1].switch_id, 1);
  ASSERT_OK_AND_ASSIGN(auto alloc, Allocator::Create());
  for (const auto& n : nodes) ASSERT_OK(alloc->AddNode(n));
  EXPECT_EQ(alloc->Nodes().size(), 2u);
}

TEST(NodesFile, SyntaxErrorNamesTheLine) {
  EXPECT_THAT(ParseNodesJson("{\n  \"nodes\": [\n    {\"name\": \"n1\",, }\n  ]\n}", "bad.json"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("bad.json: line 3, column"), HasSubstr("syntax error"))));
}

TEST(NodesFile, BadFieldsNameThePathAndValue) {
  auto parse = [](const std::string& node) {
    return ParseNodesJson(R"({"nodes": [{"name": "ok", "cpus": 1, "memory": "1GiB"}, )" + node +
                              "]}",
                          "f.json");
  };
  EXPECT_THAT(parse(R"({"name": "n", "cpus": 4, "memory": "8GiB", "gpus": [{"memory": "80XB"}]})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("f.json"), HasSubstr("nodes[1].gpus[0].memory"),
                             HasSubstr("\"80XB\""))));
  EXPECT_THAT(parse(R"({"name": "n", "cpus": 4, "memory": "0"})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("nodes[1].memory: must be positive, got 0")));
  EXPECT_THAT(parse(R"({"name": "n", "cpus": -2, "memory": "8GiB"})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("nodes[1].cpus: -2 is out of range")));
  EXPECT_THAT(parse(R"({"name": "n", "cpus": 4, "memory": "8GiB", "gpu": 3})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("nodes[1]: unknown key \"gpu\"")));
  EXPECT_THAT(parse(R"({"name": "n", "cpus": 4, "memory": "8GiB", "mode": "fast"})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("nodes[1].mode: unknown mode \"fast\"")));
  EXPECT_THAT(parse(R"({"name": "n", "memory": "8GiB"})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nodes[1]: missing \"cpus\"")));
  EXPECT_THAT(parse(R"({"name": "ok", "cpus": 4, "memory": "8GiB"})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("nodes[1].name: duplicate node name \"ok\"")));
  EXPECT_THAT(parse(R"({"name": 7, "cpus": 4, "memory": "8GiB"})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("nodes[1].name: expected a string, got 7")));
}

// A size means in a nodes file what it means to the CLI (ParseByteSize):
// "24 GB" is 24 * 1000^3 bytes, shown as 22.4GiB.
TEST(NodesFile, SizesAreReadAsTheCliReadsThem) {
  ASSERT_OK_AND_ASSIGN(
      std::vector<Node> nodes,
      ParseNodesJson(R"({"nodes": [{"name": "n", "cpus": 4, "memory": " 24 GB",
                                    "gpus": {"count": 2, "memory": "24 GB"}}]})",
                     "f.json"));
  ASSERT_OK_AND_ASSIGN(uint64_t cli, ParseByteSize("24GB", "--gpu-memory"));
  EXPECT_EQ(cli, 24000000000u);
  EXPECT_EQ(nodes[0].memory, cli);
  ASSERT_EQ(nodes[0].gpus.size(), 2u);
  EXPECT_EQ(nodes[0].gpus[1].memory, cli);
  EXPECT_EQ(FormatByteSize(nodes[0].gpus[1].memory), "22.4GiB");
  for (const char* bad : {"10 XB", "-1G", "1.5.2G", "99999999999999TiB"}) {
    EXPECT_THAT(ParseNodesJson(absl::StrCat(R"({"nodes": [{"name": "n", "cpus": 4, "memory": ")",
                                            bad, R"("}]})"),
                               "f.json"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("f.json: nodes[0].memory: \"", bad,
                                                "\" is not a byte size ("))));
  }
}

TEST(NodesFile, LoadsAFileAndRefusesAMissingOne) {
  TempDir dir;
  const std::string path = dir.path() + "/nodes.json";
  std::ofstream(path) << kGood;
  ASSERT_OK_AND_ASSIGN(std::vector<Node> nodes, LoadNodesFile(path));
  EXPECT_EQ(nodes.size(), 2u);
  EXPECT_THAT(LoadNodesFile(dir.path() + "/nope.json"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope.json")));
}

}  // namespace
}  // namespace deepnex::gpu
