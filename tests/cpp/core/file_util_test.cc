#include "core/file_util.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/checksum.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::deepnex::test::TempDir;
using ::testing::HasSubstr;

std::string InUse(const std::string& dir, pid_t pid) {
  return "state \"" + dir + "\" is in use by pid " + std::to_string(pid) + " (" + dir +
         "/x.lock is locked)";
}

TEST(Crc32cTest, KnownVectors) {
  // RFC 3720, B.4: CRC-32C of 32 zero bytes and of "123456789".
  std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  // Continuation gives the same as one pass.
  EXPECT_EQ(Crc32c("6789", 4, Crc32c("12345", 5)), 0xE3069283u);
}

TEST(FileUtilTest, AtomicWriteReplacesTheFile) {
  TempDir tmp;
  ASSERT_FALSE(tmp.path().empty());
  std::string dir = tmp.path() + "/a/b";
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

// A write that fails midway (a full disk, here a file size limit) left its
// half file, PATH.tmp, taking the disk's last space until the next write.
TEST(FileUtilTest, AFailedWriteKeepsTheOldFileAndLeavesNoTemporary) {
  TempDir tmp;
  const std::string path = tmp.path() + "/ps.ckpt";
  ASSERT_THAT(WriteFileAtomically(path, "old"), IsOk());
  struct rlimit was;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &was), 0);
  struct sigaction ignore = {}, old_action;
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(sigaction(SIGXFSZ, &ignore, &old_action), 0);  // write() fails with EFBIG
  struct rlimit small = was;
  small.rlim_cur = 4096;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const absl::Status written = WriteFileAtomically(path, std::string(1 << 20, 'x'));
  setrlimit(RLIMIT_FSIZE, &was);
  sigaction(SIGXFSZ, &old_action, nullptr);
  EXPECT_THAT(written, StatusIs(absl::StatusCode::kInternal,
                                HasSubstr("cannot write \"" + path + ".tmp\": File too large")));
  EXPECT_EQ(ReadWholeFile(path, "file").value_or(""), "old");
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

// A name in a shared directory another user made first: a FIFO blocked its
// reader for good, a link to /dev/zero read until memory ran out.
TEST(FileUtilTest, ARegularFileIsReadAndAnythingElseRefusedAtOnce) {
  TempDir tmp;
  const std::string file = tmp.path() + "/file", fifo = tmp.path() + "/fifo",
                    zero = tmp.path() + "/zero", link = tmp.path() + "/link";
  ASSERT_THAT(WriteFileAtomically(file, "twelve bytes"), IsOk());
  ASSERT_EQ(symlink(file.c_str(), link.c_str()), 0);
  EXPECT_EQ(ReadRegularFile(file, "checkpoint", 12).value_or(""), "twelve bytes");
  EXPECT_EQ(ReadRegularFile(link, "checkpoint", 12).value_or(""), "twelve bytes");
  EXPECT_THAT(ReadRegularFile(file, "checkpoint", 11).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "checkpoint \"" + file + "\" is 12 bytes, more than the 11 one can be"));
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THAT(ReadRegularFile(fifo, "checkpoint", 1 << 20).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "checkpoint \"" + fifo +
                           "\" is not a regular file (a FIFO, socket or device)"));
  ASSERT_EQ(symlink("/dev/zero", zero.c_str()), 0);
  EXPECT_THAT(ReadRegularFile(zero, "checkpoint", 1 << 20).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not a regular file")));
  EXPECT_THAT(ReadRegularFile(tmp.path(), "checkpoint", 1 << 20).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("a directory")));
  EXPECT_THAT(ReadRegularFile(tmp.path() + "/missing", "checkpoint", 1).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing")));
}

TEST(FileUtilTest, AFileAnotherUserMayHaveWrittenIsNotRead) {
  // A checkpoint planted in a shared directory was restored whoever wrote it.
  TempDir tmp;
  const std::string file = tmp.path() + "/file";
  ASSERT_THAT(WriteFileAtomically(file, "twelve bytes", 0600), IsOk());
  ASSERT_EQ(chmod(file.c_str(), 0620), 0);
  EXPECT_THAT(ReadRegularFile(file, "checkpoint", 12).status(),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "checkpoint \"" + file +
                           "\" is writable by others than its owner (mode 0620): another user "
                           "may have written it (if it is yours: chown it, chmod go-w)"));
  ASSERT_EQ(chmod(file.c_str(), 0644), 0);
  EXPECT_EQ(ReadRegularFile(file, "checkpoint", 12).value_or(""), "twelve bytes");
  if (geteuid() != 0) GTEST_SKIP() << "giving a file to another user needs root";
  ASSERT_EQ(chown(file.c_str(), 65534, 65534), 0);
  EXPECT_THAT(ReadRegularFile(file, "checkpoint", 12).status(),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("\" belongs to uid 65534, not to this process's 0: another")));
}

// Another user's links where the files go (a probe, in a shared sticky
// directory): PATH.tmp -> a file of root's had a root ps overwrite that file
// with its checkpoint and rename the link over PATH; LOCK -> another had it
// hold the server's pid. Links are unlinked or refused, never followed.
TEST(FileUtilTest, LinksWhereTheFilesGoAreNeverFollowed) {
  TempDir tmp;
  const std::string victim = tmp.path() + "/victim";
  ASSERT_THAT(WriteFileAtomically(victim, "precious", 0600), IsOk());
  const std::string path = tmp.path() + "/ps.ckpt";
  ASSERT_EQ(symlink(victim.c_str(), (path + ".tmp").c_str()), 0);
  ASSERT_THAT(WriteFileAtomically(path, "checkpoint", 0600), IsOk());
  EXPECT_EQ(ReadWholeFile(victim, "victim").value_or(""), "precious");
  struct stat st;
  ASSERT_EQ(lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(ReadWholeFile(path, "checkpoint").value_or(""), "checkpoint");

  ASSERT_EQ(symlink(victim.c_str(), (tmp.path() + "/a.lock").c_str()), 0);
  EXPECT_THAT(DirectoryLock::Acquire(tmp.path(), "a.lock", "state"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("cannot open")));
  ASSERT_EQ(link(victim.c_str(), (tmp.path() + "/b.lock").c_str()), 0);
  EXPECT_THAT(DirectoryLock::Acquire(tmp.path(), "b.lock", "state"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("is not a plain file of its own")));
  EXPECT_EQ(ReadWholeFile(victim, "victim").value_or(""), "precious");
}

// /tmp/deepnex-UID made first by another user (a probe's, 0777) let them
// swap the job script a slurm job then ran as its victim.
TEST(FileUtilTest, AnOwnDirectoryIsThisUsersOrRefused) {
  TempDir tmp;
  const std::string made = tmp.path() + "/made";
  ASSERT_THAT(MakeOwnDirectory(made, "the run directory"), IsOk());
  struct stat st;
  ASSERT_EQ(lstat(made.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0711u);
  const std::string open_dir = tmp.path() + "/open";
  ASSERT_EQ(mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(chmod(open_dir.c_str(), 0777), 0);
  ASSERT_THAT(MakeOwnDirectory(open_dir, "the run directory"), IsOk());
  ASSERT_EQ(lstat(open_dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0711u);
  const std::string link = tmp.path() + "/link";
  ASSERT_EQ(symlink(made.c_str(), link.c_str()), 0);
  EXPECT_THAT(MakeOwnDirectory(link, "the run directory"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("the run directory \"" + link + "\" is not a directory")));
  if (geteuid() != 0) GTEST_SKIP() << "giving a directory to another user needs root";
  const std::string theirs = tmp.path() + "/theirs";
  ASSERT_EQ(mkdir(theirs.c_str(), 0777), 0);
  ASSERT_EQ(chown(theirs.c_str(), 65534, 65534), 0);
  EXPECT_THAT(MakeOwnDirectory(theirs, "the run directory"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("is a directory of uid 65534, not this user's (0): whoever "
                                 "made it could replace what is written there")));
}

TEST(DirectoryLockTest, ASecondHolderFailsNamingTheFirstsPid) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string sub = dir.path() + "/made";  // created by Acquire
  ASSERT_OK_AND_ASSIGN(auto held, DirectoryLock::Acquire(sub, "x.lock", "state"));
  EXPECT_EQ(held->path(), sub + "/x.lock");
  std::ifstream in(sub + "/x.lock");
  std::string pid;
  std::getline(in, pid);
  EXPECT_EQ(pid, std::to_string(getpid()));
  // flock is per open file: the same process is refused as well.
  EXPECT_THAT(DirectoryLock::Acquire(sub, "x.lock", "state"),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(DirectoryLock::Acquire(sub, "x.lock", "state").status().message(),
            InUse(sub, getpid()));
  // Another file in the same directory is another lock.
  EXPECT_THAT(DirectoryLock::Acquire(sub, "y.lock", "state"), IsOk());
  held.reset();
  EXPECT_THAT(DirectoryLock::Acquire(sub, "x.lock", "state"), IsOk());
}

TEST(DirectoryLockTest, ALockIsFreeAfterItsHolderIsKilled) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto lock = DirectoryLock::Acquire(dir.path(), "x.lock", "state");
    char c = lock.ok() ? '1' : '0';
    (void)!write(ready[1], &c, 1);
    pause();
    _exit(0);
  }
  close(ready[1]);
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  close(ready[0]);
  ASSERT_EQ(c, '1');
  EXPECT_EQ(DirectoryLock::Acquire(dir.path(), "x.lock", "state").status().message(),
            InUse(dir.path(), child));
  ASSERT_EQ(kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  ASSERT_OK_AND_ASSIGN(auto lock, DirectoryLock::Acquire(dir.path(), "x.lock", "state"));
}

TEST(DirectoryLockTest, AnUnusableDirectoryNamesIt) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string file = dir.path() + "/file";
  std::ofstream(file) << "x";
  EXPECT_THAT(DirectoryLock::Acquire(file, "x.lock", "state"),
              StatusIs(absl::StatusCode::kInternal, HasSubstr(file)));
}

}  // namespace
}  // namespace deepnex
