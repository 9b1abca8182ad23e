#include "collective/transport.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::collective {
namespace {

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

}  // namespace
}  // namespace deepnex::collective
