// The checkpoint file on its own: what is written reads back the same, a
// damaged or foreign file is refused with what is wrong with it, and a
// Checkpoint call's name stays a directory inside checkpoint_dir.
#include "ps/checkpoint.h"

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <functional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_matchers.h"

namespace deepnex::ps {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::HasSubstr;

class CheckpointFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ps_checkpoint_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    dir_ = root_ + "/a/b";  // not there yet: the write makes it
  }
  void TearDown() override { std::system(("rm -rf '" + root_ + "'").c_str()); }

  static bool Exists(const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0;
  }
  static std::string Read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

  // A sync server "ps" with 2 workers, holding part 1 of "w" (3 float32
  // values at offset 4, optimizer state m and v) at round 7.
  static proto::CheckpointFile File() {
    proto::CheckpointFile file;
    file.set_name("ps");
    file.set_mode("sync");
    file.set_num_workers(2);
    file.set_round(7);
    file.add_incarnations(11);
    file.add_incarnations(0);
    proto::TensorMeta* meta = file.add_metas();
    meta->set_key("w");
    meta->set_dtype(static_cast<int>(DType::kFloat32));
    meta->add_shape(7);
    meta->set_num_parts(2);
    PartitionConfig config;
    config.num_workers = 2;
    std::unique_ptr<Partition> part = Partition::Create(config, DType::kFloat32, 4, 3);
    PartitionState state;
    state.version = 7;
    state.step = 3;
    state.values = std::string(12, '\x01');
    state.m = std::string(12, '\x02');
    state.v = std::string(12, '\x03');
    state.workers = {{11, 2, 8}, {0, 1, 1}};
    AddPartitionRecord("w", 1, *part, std::move(state), &file);
    return file;
  }

  std::string root_, dir_;
};

TEST_F(CheckpointFileTest, WrittenFileReadsBackTheSameAndLeavesNoTemporary) {
  const proto::CheckpointFile file = File();
  ASSERT_THAT(WriteCheckpointFile(dir_, file), IsOk());
  EXPECT_EQ(CheckpointPath(dir_, "ps"), dir_ + "/ps.ckpt");
  EXPECT_TRUE(Exists(dir_ + "/ps.ckpt"));
  EXPECT_FALSE(Exists(dir_ + "/ps.ckpt.tmp"));
  ASSERT_OK_AND_ASSIGN(proto::CheckpointFile back,
                       ReadCheckpointFile(dir_, "ps", Mode::kSync, 2, OptimizerKind::kSgd));
  EXPECT_EQ(back.SerializeAsString(), file.SerializeAsString());

  const proto::PartitionRecord& r = back.parts(0);
  EXPECT_EQ(r.key(), "w");
  EXPECT_EQ(r.part(), 1u);
  EXPECT_EQ(r.offset(), 4u);
  EXPECT_EQ(r.count(), 3u);
  EXPECT_EQ(r.dtype(), static_cast<int>(DType::kFloat32));
  PartitionState s = StateOf(r);
  EXPECT_EQ(s.version, 7u);
  EXPECT_EQ(s.step, 3u);
  EXPECT_EQ(s.values, std::string(12, '\x01'));
  EXPECT_EQ(s.m, std::string(12, '\x02'));
  EXPECT_EQ(s.v, std::string(12, '\x03'));
  ASSERT_EQ(s.workers.size(), 2u);
  EXPECT_EQ(s.workers[0].incarnation, 11u);
  EXPECT_EQ(s.workers[0].first_round, 2u);
  EXPECT_EQ(s.workers[0].next_seq, 8u);
  EXPECT_EQ(s.workers[1].incarnation, 0u);
}

TEST_F(CheckpointFileTest, RewriteReplacesTheWholeFile) {
  proto::CheckpointFile file = File();
  ASSERT_THAT(WriteCheckpointFile(dir_, file), IsOk());
  file.set_round(8);
  file.clear_parts();
  ASSERT_THAT(WriteCheckpointFile(dir_, file), IsOk());
  ASSERT_OK_AND_ASSIGN(proto::CheckpointFile back,
                       ReadCheckpointFile(dir_, "ps", Mode::kSync, 2, OptimizerKind::kSgd));
  EXPECT_EQ(back.round(), 8u);
  EXPECT_EQ(back.parts_size(), 0);
}

TEST_F(CheckpointFileTest, MissingFileIsNotFound) {
  EXPECT_THAT(ReadCheckpointFile(dir_, "ps", Mode::kSync, 2, OptimizerKind::kSgd),
              StatusIs(absl::StatusCode::kNotFound));
}

// A new user's server restored without its --name: "No such file or
// directory", not a word of the ps0.ckpt beside it.
TEST_F(CheckpointFileTest, MissingFileNamesTheOtherNamesThere) {
  proto::CheckpointFile file = File();
  for (const char* name : {"ps1", "ps0"}) {
    file.set_name(name);
    ASSERT_THAT(WriteCheckpointFile(dir_, file), IsOk());
  }
  EXPECT_THAT(ReadCheckpointFile(dir_, "ps", Mode::kSync, 2, OptimizerKind::kSgd),
              StatusIs(absl::StatusCode::kNotFound,
                       "checkpoint \"" + dir_ + "/ps.ckpt\" cannot be read: No such file or "
                       "directory; the directory holds the checkpoints of servers named "
                       "\"ps0\", \"ps1\": is this server's name one of them?"));
}

TEST_F(CheckpointFileTest, DamagedFileIsDataLoss) {
  ASSERT_THAT(WriteCheckpointFile(dir_, File()), IsOk());
  const std::string path = dir_ + "/ps.ckpt";
  std::string bytes = Read(path);
  bytes[bytes.size() - 1] ^= 0x40;
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  auto read = ReadCheckpointFile(dir_, "ps", Mode::kSync, 2, OptimizerKind::kSgd);
  EXPECT_THAT(read, StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(read.status().message(),
            "checkpoint \"" + path + "\" is damaged: checksum mismatch");
}

TEST_F(CheckpointFileTest, FileOfAnotherModeOrWorkerCountIsRefusedNamingBoth) {
  ASSERT_THAT(WriteCheckpointFile(dir_, File()), IsOk());
  const std::string path = dir_ + "/ps.ckpt";
  auto mode = ReadCheckpointFile(dir_, "ps", Mode::kAsync, 2, OptimizerKind::kSgd);
  EXPECT_THAT(mode, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(mode.status().message(), "checkpoint \"" + path +
                                         "\" is of a sync server with 2 workers, this one is "
                                         "async with 2");
  auto workers = ReadCheckpointFile(dir_, "ps", Mode::kSync, 3, OptimizerKind::kSgd);
  EXPECT_EQ(workers.status().message(), "checkpoint \"" + path +
                                            "\" is of a sync server with 2 workers, this one "
                                            "is sync with 3");
}

TEST_F(CheckpointFileTest, RecordWithTheWrongNumberOfValuesIsDataLoss) {
  const std::string path = dir_ + "/ps.ckpt";
  proto::CheckpointFile file = File();
  file.mutable_parts(0)->set_m(std::string(8, '\0'));  // m must match the values
  ASSERT_THAT(WriteCheckpointFile(dir_, file), IsOk());
  auto read = ReadCheckpointFile(dir_, "ps", Mode::kSync, 2, OptimizerKind::kSgd);
  EXPECT_THAT(read, StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(read.status().message(),
            "checkpoint \"" + path + "\": \"w\" part 1 has the wrong number of values");
}

// A file is refused for what Init would refuse: the clients that a restored
// server describes its tensors to trust those descriptions (a num_parts of
// 4e9 had a client loop past its timeout into 6.9 GB; 0 left pulls empty).
TEST_F(CheckpointFileTest, TensorsAndRecordsInitWouldRefuseAreDataLoss) {
  const std::string at = "checkpoint \"" + dir_ + "/ps.ckpt\": ";
  const std::vector<std::pair<std::function<void(proto::CheckpointFile&)>, std::string>> cases = {
      {[](auto& f) { f.mutable_metas(0)->set_num_parts(0); },
       "tensor \"w\": num_parts 0 for 7 elements; must be 1..7"},
      {[](auto& f) { f.mutable_metas(0)->set_num_parts(4000000000u); },
       "tensor \"w\": num_parts 4000000000 for 7 elements; must be 1..7"},
      {[](auto& f) { f.mutable_metas(0)->set_dtype(77); }, "tensor \"w\": unknown dtype 77"},
      {[](auto& f) { f.mutable_metas(0)->set_shape(0, -7); },
       "tensor \"w\": negative dimension -7"},
      {[](auto& f) { f.mutable_metas(0)->add_shape(1ll << 61); },
       "tensor \"w\": 16140901064495857664 elements are more than 2^64 bytes"},
      {[](auto& f) { f.mutable_metas(0)->add_shape(1ll << 62); },
       "tensor \"w\": the shape has more than 2^64 elements"},
      {[](auto& f) { *f.add_metas() = f.metas(0); }, "tensor \"w\" twice"},
      {[](auto& f) { f.mutable_parts(0)->set_key("v"); }, "\"v\" part 1: no such tensor"},
      {[](auto& f) { f.mutable_parts(0)->set_dtype(99); }, "\"w\" part 1: dtype 99, its meta says 1"},
      {[](auto& f) { f.mutable_parts(0)->set_part(2); },
       "\"w\" part 2: outside the tensor's 2 parts"},
      {[](auto& f) { f.mutable_parts(0)->set_count(4); },
       "\"w\" part 1: got 4 elements at offset 4; 2 parts of [7] float32 make it 3 at offset 4"},
      {[](auto& f) { f.mutable_parts(0)->set_count((1ull << 62) + 3); },
       "\"w\" part 1: got 4611686018427387907 elements at offset 4; 2 parts of [7] float32 "
       "make it 3 at offset 4"},
      {[](auto& f) { *f.add_parts() = f.parts(0); }, "\"w\" part 1 twice"},
  };
  for (const auto& [damage, want] : cases) {
    proto::CheckpointFile file = File();
    damage(file);
    ASSERT_THAT(WriteCheckpointFile(dir_, file), IsOk());
    auto read = ReadCheckpointFile(dir_, "ps", Mode::kSync, 2, OptimizerKind::kSgd);
    EXPECT_THAT(read, StatusIs(absl::StatusCode::kDataLoss)) << want;
    EXPECT_EQ(std::string(read.status().message()), at + want);
  }
}

// Another kind of optimizer would read the state as its own (Adam's first
// moment as SGD's momentum); a file from before the kind was kept says none.
TEST_F(CheckpointFileTest, FileOfAnotherOptimizerKindIsRefusedNamingBoth) {
  proto::CheckpointFile file = File();
  file.set_optimizer("adam");
  ASSERT_THAT(WriteCheckpointFile(dir_, file), IsOk());
  EXPECT_THAT(ReadCheckpointFile(dir_, "ps", Mode::kSync, 2, OptimizerKind::kAdam), IsOk());
  auto read = ReadCheckpointFile(dir_, "ps", Mode::kSync, 2, OptimizerKind::kSgd);
  EXPECT_THAT(read, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(read.status().message(),
            "checkpoint \"" + dir_ + "/ps.ckpt\" is of a server whose optimizer is adam, this "
            "one's is sgd; restore it with the same kind of optimizer");
  file.clear_optimizer();
  ASSERT_THAT(WriteCheckpointFile(dir_, file), IsOk());
  EXPECT_THAT(ReadCheckpointFile(dir_, "ps", Mode::kSync, 2, OptimizerKind::kSgd), IsOk());
}

TEST(CheckpointDirForTest, EmptyNameIsTheDirectoryAndAPlainNameIsInsideIt) {
  ASSERT_OK_AND_ASSIGN(std::string same, CheckpointDirFor("/ck", ""));
  EXPECT_EQ(same, "/ck");
  ASSERT_OK_AND_ASSIGN(std::string dir, CheckpointDirFor("/ck", "before-upgrade_2.a"));
  EXPECT_EQ(dir, "/ck/before-upgrade_2.a");
  ASSERT_OK_AND_ASSIGN(std::string longest, CheckpointDirFor("/ck", std::string(255, 'n')));
  EXPECT_EQ(longest, "/ck/" + std::string(255, 'n'));
}

TEST(CheckpointDirForTest, NameThatIsNotPlainIsRefusedQuotingIt) {
  const std::string why =
      "\" is not a plain name (letters, digits, '.', '-', '_'; not \".\" or \"..\"; at most "
      "255): it names a directory inside the server's checkpoint_dir, never a path";
  for (const std::string name : {".", "..", "a/b", "../up", "/abs", "sp ace"}) {
    auto dir = CheckpointDirFor("/ck", name);
    EXPECT_THAT(dir, StatusIs(absl::StatusCode::kInvalidArgument)) << name;
    EXPECT_EQ(dir.status().message(), "checkpoint: name \"" + name + why) << name;
  }
  EXPECT_EQ(CheckpointDirFor("/ck", "a\nb").status().message(),
            "checkpoint: name \"a\\nb" + why);
  EXPECT_EQ(CheckpointDirFor("/ck", std::string(256, 'n')).status().message(),
            "checkpoint: name \"" + std::string(256, 'n') + why);
}

}  // namespace
}  // namespace deepnex::ps
