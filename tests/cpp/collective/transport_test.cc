#include "collective/transport.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::collective {
namespace {

using ::testing::HasSubstr;
using test::StatusIs;

bool Exists(const std::string& name) {
  struct stat st;
  return stat(absl::StrCat("/dev/shm", name).c_str(), &st) == 0;
}

// Sets a /dev/shm entry's times `age` into the past.
void Age(const std::string& name, std::chrono::seconds age) {
  const timespec t{time(nullptr) - age.count(), 0};
  const timespec times[2] = {t, t};
  ASSERT_EQ(utimensat(AT_FDCWD, absl::StrCat("/dev/shm", name).c_str(), times, 0), 0);
}

// A segment whose creator died before its neighbours mapped it (a job
// cancelled at rendezvous) holds no lock: the next Create removes it once
// it is old enough. A live creator's segment, and a young one whose creator
// may be about to lock it, stay.
TEST(ShmSegmentTest, CreateRemovesSegmentsOfDeadCreatorsOnly) {
  const std::string dead = absl::StrCat("/", ShmSegment::kPrefix, "test-dead-", getpid());
  const std::string young = absl::StrCat("/", ShmSegment::kPrefix, "test-young-", getpid());
  for (const std::string& name : {dead, young}) {
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0) << name;
    close(fd);  // what a process's death leaves: the name, and no lock
  }
  Age(dead, std::chrono::seconds(60));
  ASSERT_OK_AND_ASSIGN(auto live, ShmSegment::Create(1, 4096));
  Age(live->name(), std::chrono::seconds(60));

  ASSERT_OK_AND_ASSIGN(auto next, ShmSegment::Create(1, 4096, std::chrono::seconds(30)));
  EXPECT_FALSE(Exists(dead));
  EXPECT_TRUE(Exists(young));
  EXPECT_TRUE(Exists(live->name()));
  EXPECT_TRUE(Exists(next->name()));

  const std::string next_name = next->name();
  live->Unlink();
  next.reset();
  EXPECT_FALSE(Exists(live->name()));
  EXPECT_FALSE(Exists(next_name));
  shm_unlink(young.c_str());
}

// Open maps the segment a neighbour named in the store. One that is not
// this user's alone may be another user's, who would read every tensor
// written into it; one whose header promised rings past its end had the
// Links copy outside the mapping (the old Open checked neither).
TEST(ShmSegmentTest, OpenTakesOnlyThisUsersOwnWellFormedSegments) {
  ASSERT_OK_AND_ASSIGN(auto seg, ShmSegment::Create(2, 4096));
  const std::string name = seg->name();
  ASSERT_OK(ShmSegment::Open(name).status());
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(fchmod(fd, 0666), 0);
  EXPECT_THAT(ShmSegment::Open(name).status(),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("with mode 0666")));
  ASSERT_EQ(fchmod(fd, 0600), 0);

  // The header: magic, stripes (u32), pad, ring_bytes (u64).
  void* base = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(base, MAP_FAILED);
  auto* stripes = reinterpret_cast<uint32_t*>(static_cast<char*>(base) + 8);
  auto* ring_bytes = reinterpret_cast<uint64_t*>(static_cast<char*>(base) + 16);
  const uint32_t good_stripes = *stripes;
  const uint64_t good_ring_bytes = *ring_bytes;
  for (auto [s, r] : {std::pair<uint32_t, uint64_t>{2, uint64_t{1} << 40}, {16, good_ring_bytes},
                      {0, good_ring_bytes}, {2, ~uint64_t{0} - 100}, {2, good_ring_bytes + 64}}) {
    *stripes = s;
    *ring_bytes = r;
    EXPECT_THAT(ShmSegment::Open(name).status(),
                StatusIs(absl::StatusCode::kUnavailable, HasSubstr("is garbled")))
        << s << " rings of " << r;
  }
  *stripes = good_stripes;
  *ring_bytes = good_ring_bytes;
  ASSERT_OK(ShmSegment::Open(name).status());
  munmap(base, 4096);

  if (geteuid() == 0) {
    ASSERT_EQ(fchown(fd, 65534, 65534), 0);
    EXPECT_THAT(ShmSegment::Open(name).status(),
                StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("belongs to uid 65534")));
  }
  close(fd);
  seg.reset();
  EXPECT_FALSE(Exists(name));
}

}  // namespace
}  // namespace deepnex::collective
