// Every bad input of issue 5: the error code, a message naming the field and
// the value, and an unchanged state and ledger.
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "deepnex/gpu/allocator.h"
#include "gmock/gmock.h"
#include "gpu/gpu_test_util.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex::gpu {
namespace {

using ::deepnex::test::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace ::deepnex::gpu::test;  // NOLINT

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    AllocatorOptions o;
    o.state_dir = dir_.path();
    auto a = Allocator::Create(o);
    ASSERT_TRUE(a.ok()) << a.status();
    alloc_ = std::move(a).value();
    ASSERT_OK(alloc_->AddNode(MakeNode("n1", 8, 80 * kGiB, Mode::kExclusive, 64, 512 * kGiB,
                                       {{"gpu", "h100"}})));
    ASSERT_OK(alloc_->AddNode(MakeNode("n2", 4, 40 * kGiB)));
    ASSERT_OK(alloc_->Allocate(Exclusive("alice", 2, 4, kGiB)).status());
    Snap();
  }
  void Snap() {
    digest_ = alloc_->StateDigest();
    records_ = alloc_->LedgerRecords();
  }
  // The state and the ledger are what they were at the last Snap().
  void ExpectUnchanged() {
    EXPECT_EQ(alloc_->StateDigest(), digest_);
    EXPECT_EQ(alloc_->LedgerRecords(), records_);
    EXPECT_OK(alloc_->CheckInvariants());
  }

  TempDir dir_;
  std::unique_ptr<Allocator> alloc_;
  std::string digest_;
  uint64_t records_ = 0;
};

TEST_F(BadInput, ZeroGpuMemoryOnNode) {
  Node n = MakeNode("n3", 2);
  n.gpus[1].memory = 0;
  EXPECT_THAT(alloc_->AddNode(n), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("node n3: gpus[1].memory=0")));
  ExpectUnchanged();
}

TEST_F(BadInput, ZeroOrNegativeNodeCpusAndMemory) {
  Node n = MakeNode("n3", 2);
  n.cpus = 0;
  EXPECT_THAT(alloc_->AddNode(n),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("node n3: cpus=0")));
  n.cpus = -4;
  EXPECT_THAT(alloc_->AddNode(n),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("node n3: cpus=-4")));
  n.cpus = 4;
  n.memory = 0;
  EXPECT_THAT(alloc_->AddNode(n),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("node n3: memory=0")));
  ExpectUnchanged();
}

TEST_F(BadInput, BadNodeName) {
  EXPECT_THAT(alloc_->AddNode(MakeNode("bad name", 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"bad name\"")));
  EXPECT_THAT(alloc_->AddNode(MakeNode("", 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("node name \"\"")));
  ExpectUnchanged();
}

TEST_F(BadInput, BadNodeLabels) {
  Node n = MakeNode("n3", 1);
  const std::string key_rule = "use 1-253 letters, digits, '-', '_', '.', '/'";
  const std::string value_rule = "use at most 253 letters, digits, '-', '_', '.'";
  const std::pair<std::map<std::string, std::string>, std::string> bad[] = {
      {{{"", "x"}}, "node n3: label key \"\": " + key_rule},
      {{{"rack id", "r1"}}, "node n3: label key \"rack id\": " + key_rule},
      {{{std::string(300, 'k'), "v"}},
       "node n3: label key \"" + std::string(64, 'k') + "\"...: " + key_rule},
      {{{"rack", "r\n1"}}, "node n3: label rack=\"r\\n1\": " + value_rule},
      {{{"rack", std::string(254, 'v')}},
       "node n3: label rack=\"" + std::string(64, 'v') + "\"...: " + value_rule},
  };
  for (const auto& [labels, message] : bad) {
    n.labels = labels;
    EXPECT_THAT(alloc_->AddNode(n), StatusIs(absl::StatusCode::kInvalidArgument, message));
  }
  ExpectUnchanged();
  // Kubernetes-style keys, and an empty value, are labels.
  n.labels = {{"deepnex.io/agent", "true"}, {"gpu", "h100"}, {"spare", ""}};
  EXPECT_OK(alloc_->AddNode(n));
}

TEST_F(BadInput, DuplicateNodeName) {
  EXPECT_THAT(alloc_->AddNode(MakeNode("n1", 1)),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("node n1 already exists")));
  ExpectUnchanged();
}

TEST_F(BadInput, DuplicateGpuUuid) {
  Node n = MakeNode("n3", 1);
  n.gpus[0].uuid = "GPU-n1-0";
  EXPECT_THAT(alloc_->AddNode(n),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr("gpus[0].uuid=GPU-n1-0 is already on node n1")));
  ExpectUnchanged();
}

TEST_F(BadInput, NegativeCounts) {
  Request r = Exclusive("bob", -1);
  EXPECT_THAT(alloc_->Allocate(r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gpus=-1")));
  r = Exclusive("bob", 1, -2);
  EXPECT_THAT(alloc_->Allocate(r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cpus=-2")));
  r = Exclusive("bob", 1);
  r.replicas = 0;
  EXPECT_THAT(alloc_->AllocateGang(r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("replicas=0")));
  r.replicas = 1;
  r.mode = static_cast<Mode>(9);  // was reported as "mode=exclusive"
  EXPECT_THAT(alloc_->Allocate(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("mode=9 is not a Mode")));
  r.mode = Mode::kExclusive;
  r.lease = std::chrono::milliseconds(-5);
  EXPECT_THAT(alloc_->Allocate(r),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lease=-5ms")));
  // Its expiry wrapped negative (probe).
  r.lease = std::chrono::milliseconds::max();
  EXPECT_THAT(alloc_->Allocate(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("lease=9223372036854775807ms: must be "
                                                      "at most 1000000000000ms")));
  r.lease = std::chrono::milliseconds(0);
  AllocateOptions forever;
  forever.timeout = std::chrono::milliseconds::max();
  EXPECT_THAT(alloc_->Allocate(r, forever),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("timeout=9223372036854775807ms: must be at most")));
  ExpectUnchanged();
}

// A cast integer is no Mode: a probe's node of Mode(9) was added.
TEST_F(BadInput, NodeModeThatIsNoMode) {
  Node n = MakeNode("n3", 2);
  n.mode = static_cast<Mode>(9);
  EXPECT_THAT(alloc_->AddNode(n), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstr("node n3: mode=9 is not a Mode")));
  EXPECT_THAT(alloc_->SetNodeMode("n2", static_cast<Mode>(7)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mode=7 is not a Mode")));
  ExpectUnchanged();
}

TEST_F(BadInput, ZeroSizes) {
  EXPECT_THAT(alloc_->Allocate(Shared("bob", 1, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gpu_memory=0B")));
  EXPECT_THAT(alloc_->Allocate(Exclusive("bob", 0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("asks for nothing")));
  // GPU memory without GPUs: a new user's --gpu-memory 10gb alone read
  // "gpu_memory=9.3GiB with gpus=0", naming neither flag nor remedy.
  EXPECT_THAT(alloc_->Allocate(Shared("bob", 0, 10 * kGiB, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("gpu_memory=10GiB with gpus=0: GPU memory is asked per GPU "
                                 "(--gpu-memory with --gpus or --gpus-per-worker); ask for "
                                 "GPUs, or leave it out")));
  ExpectUnchanged();
}

TEST_F(BadInput, BadUser) {
  EXPECT_THAT(alloc_->Allocate(Exclusive("", 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("user \"\"")));
  ExpectUnchanged();
}

TEST_F(BadInput, GpuMemoryLargerThanAnyGpu) {
  ASSERT_OK(alloc_->AddNode(MakeNode("s1", 2, 24 * kGiB, Mode::kShared)));
  Snap();
  EXPECT_THAT(alloc_->Allocate(Shared("bob", 1, 100 * kGiB)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("gpu_memory=100GiB"), HasSubstr("largest has 80GiB"))));
  Request r = Exclusive("bob", 1);
  r.gpu_memory = 81 * kGiB;
  EXPECT_THAT(alloc_->Allocate(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("gpu_memory=81GiB")));
  ExpectUnchanged();
}

TEST_F(BadInput, SharedRequestWithOnlyExclusiveNodes) {
  EXPECT_THAT(alloc_->Allocate(Shared("bob", 1, kGiB)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("mode=shared"), HasSubstr("needs a shared node"),
                             HasSubstr("is exclusive (n1, n2)"))));
  ExpectUnchanged();
}

TEST_F(BadInput, UnknownNode) {
  Request r = Exclusive("bob", 1);
  r.node = "nope";
  EXPECT_THAT(alloc_->Allocate(r),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("node: no node named \"nope\"")));
  EXPECT_THAT(alloc_->SetNodeMode("nope", Mode::kShared),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"nope\"")));
  EXPECT_THAT(alloc_->Cordon("nope"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"nope\"")));
  EXPECT_THAT(alloc_->Drain("nope"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"nope\"")));
  EXPECT_THAT(alloc_->RemoveNode("nope"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"nope\"")));
  ExpectUnchanged();
}

TEST_F(BadInput, UnknownLabel) {
  Request r = Exclusive("bob", 1);
  r.selector = {{"gpu", "tpu"}};
  EXPECT_THAT(alloc_->Allocate(r), StatusIs(absl::StatusCode::kNotFound,
                                            HasSubstr("selector {gpu=tpu}: no node")));
  r.selector = {{"zone", "b"}};
  EXPECT_THAT(alloc_->Allocate(r),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("selector {zone=b}")));
  // One no label could ever match is not a search.
  r.selector = {{"zone", "b c"}};
  EXPECT_THAT(alloc_->Allocate(r),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("selector: label zone=\"b c\": use at most 253")));
  ExpectUnchanged();
}

TEST_F(BadInput, RequestNoNodeCanEverHold) {
  EXPECT_THAT(alloc_->Allocate(Exclusive("bob", 9)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("no node can ever hold")));
  EXPECT_THAT(alloc_->Allocate(Exclusive("bob", 1, 65)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("65 cpus")));
  ExpectUnchanged();
}

TEST_F(BadInput, QuotaBelowCurrentUseIsAllowedAndSaysSo) {
  Quota q;
  q.gpus = 1;
  ASSERT_OK_AND_ASSIGN(std::string note, alloc_->SetQuota("alice", q));
  EXPECT_THAT(note, HasSubstr("below current use (gpus 2 > 1)"));
  Snap();
  EXPECT_THAT(alloc_->Allocate(Exclusive("alice", 1)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("quota of alice: gpus 2 in use"),
                             HasSubstr("below current use"))));
  ExpectUnchanged();
}

TEST_F(BadInput, NegativeQuota) {
  Quota q;
  q.gpus = -1;
  EXPECT_THAT(alloc_->SetQuota("alice", q),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gpus=-1")));
  q.gpus.reset();
  q.cpus = -3;
  EXPECT_THAT(alloc_->SetDefaultQuota(q),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cpus=-3")));
  ExpectUnchanged();
}

TEST_F(BadInput, OverQuotaRequest) {
  Quota q;
  q.memory = 2 * kGiB;
  ASSERT_OK(alloc_->SetQuota("bob", q).status());
  Snap();
  EXPECT_THAT(alloc_->Allocate(Exclusive("bob", 1, 1, 3 * kGiB)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("quota of bob: memory 0B in use + 3GiB requested > quota 2GiB")));
  ExpectUnchanged();
}

TEST_F(BadInput, MalformedReleaseId) {
  // "a01" is no id of a1 (it released a1).
  for (const char* id : {"xyz", "a01", "g007", "a1x"}) {
    EXPECT_THAT(alloc_->Release(id),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat("id \"", id, "\" is not an allocation id"))));
  }
  // Well-formed but never issued: a typo, which must not read as released.
  for (const char* id : {"a999", "a0", "g999"}) {
    EXPECT_THAT(alloc_->Release(id),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr(std::string(id) + " was never issued")));
  }
  ExpectUnchanged();
}

// A hostile name (a newline, a terminal escape, bytes that are not UTF-8, a
// path, megabytes) is quoted, C-escaped and cut in the error that refuses
// it: it cannot forge a line of the CLI's output or of central's log, nor
// make a huge reply. Each had gone into the message raw and whole.
TEST_F(BadInput, HostileNamesAreQuotedInTheirErrors) {
  const std::string hostile = "../n1\nGranted a7 \x1b[2J\xff/";
  const std::string shown = "\"../n1\\nGranted a7 \\x1b[2J\\xff/\"";
  const std::string huge(1 << 20, 'n');
  auto quoted = [&](const std::string& prefix) {
    return AllOf(HasSubstr(prefix + shown), Not(HasSubstr("\n")), Not(HasSubstr("\x1b")));
  };
  Request r = Exclusive("bob", 1);
  r.node = hostile;
  EXPECT_THAT(alloc_->Allocate(r), StatusIs(absl::StatusCode::kNotFound,
                                            quoted("node: no node named ")));
  r.node = huge;
  const absl::Status cut = alloc_->Allocate(r).status();  // not printed: 1 MiB
  EXPECT_EQ(cut.code(), absl::StatusCode::kNotFound);
  EXPECT_LT(cut.message().size(), 200u);
  EXPECT_THAT(alloc_->SetNodeMode(hostile, Mode::kShared),
              StatusIs(absl::StatusCode::kNotFound, quoted("node: no node named ")));
  EXPECT_THAT(alloc_->RemoveNode(hostile),
              StatusIs(absl::StatusCode::kNotFound, quoted("node: no node named ")));
  EXPECT_THAT(alloc_->AddNode(MakeNode(hostile, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, quoted("node name ")));
  EXPECT_THAT(alloc_->Allocate(Exclusive(hostile, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, quoted("user ")));
  Request job = Exclusive("bob", 1);
  job.job = hostile;
  EXPECT_THAT(alloc_->Allocate(job), StatusIs(absl::StatusCode::kInvalidArgument, quoted("job ")));
  EXPECT_THAT(alloc_->SetQuota(hostile, Quota{}),
              StatusIs(absl::StatusCode::kInvalidArgument, quoted("user ")));
  EXPECT_THAT(alloc_->Release(hostile),
              StatusIs(absl::StatusCode::kInvalidArgument, quoted("id ")));
  ExpectUnchanged();
}

TEST_F(BadInput, RemoveBusyNode) {
  EXPECT_THAT(alloc_->RemoveNode("n2"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("holds a1")));
  ExpectUnchanged();
}

}  // namespace
}  // namespace deepnex::gpu
