// Which GPU device nodes a container's cgroup may open: v1's deny rules
// exactly, and v2's device program against a cgroup2 tree (the unified
// hierarchy that hybrid hosts mount beside v1), with device nodes made by
// mknod: the device program refuses an open with EPERM before any driver
// is asked; an allowed open of a major no driver serves gives ENXIO.
#include "launch/gpu_devices.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <utility>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_matchers.h"
#include "launch/launch_test_util.h"
#include "test_util.h"

namespace deepnex::launch {
namespace {

using ::deepnex::test::IsOk;
using ::testing::ElementsAre;

TEST(GpuDevices, V1DeniesEveryGpuMinorButTheGranted) {
  std::vector<std::string> rules = GpuDenyRules({1, 3});
  ASSERT_EQ(rules.size(), 252u);
  EXPECT_EQ(rules[0], "c 195:0 rwm");
  EXPECT_EQ(rules[1], "c 195:2 rwm");
  EXPECT_EQ(rules[2], "c 195:4 rwm");
  EXPECT_EQ(rules.back(), "c 195:253 rwm");
  EXPECT_EQ(GpuDenyRules({}).size(), 254u);
}

// The mount point of a cgroup2 hierarchy, or "".
std::string Cgroup2Mount() {
  std::ifstream in("/proc/self/mounts");
  std::string dev, dir, type, rest;
  while (in >> dev >> dir >> type && std::getline(in, rest)) {
    if (type == "cgroup2") return dir;
  }
  return "";
}

TEST(GpuDevices, V2ProgramRefusesTheGpusNotGrantedAndNothingElse) {
  const std::string mount = Cgroup2Mount();
  if (mount.empty() || geteuid() != 0) GTEST_SKIP() << "needs root and a cgroup2 mount";
  ::deepnex::test::TempDir scratch;
  // GPUs 0..2, nvidiactl, and /dev/null's numbers under another name.
  const std::vector<std::pair<std::string, dev_t>> nodes = {
      {"nvidia0", makedev(195, 0)}, {"nvidia1", makedev(195, 1)}, {"nvidia2", makedev(195, 2)},
      {"nvidiactl", makedev(195, 255)}, {"null", makedev(1, 3)}};
  for (const auto& [name, dev] : nodes) {
    const std::string path = scratch.path() + "/" + name;
    if (mknod(path.c_str(), S_IFCHR | 0666, dev) != 0) GTEST_SKIP() << "cannot mknod " << path;
  }
  const std::string cgroup = mount + "/deepnex-gpu-devices-test-" + test::UniqueToken();
  ASSERT_EQ(mkdir(cgroup.c_str(), 0755), 0) << cgroup << ": " << strerror(errno);
  absl::Cleanup remove = [&] { rmdir(cgroup.c_str()); };
  absl::Status attached = AttachGpuDeviceProgram(cgroup, {1});
  if (!attached.ok() && absl::StrContains(attached.message(), "Operation not permitted")) {
    GTEST_SKIP() << attached;
  }
  ASSERT_THAT(attached, IsOk());
  int report[2];
  ASSERT_EQ(pipe(report), 0);
  pid_t child = fork();
  if (child == 0) {
    // Joins the cgroup, then reports each open's errno (0: opened).
    std::ofstream(cgroup + "/cgroup.procs") << getpid() << std::flush;
    for (const auto& node : nodes) {
      int fd = open((scratch.path() + "/" + node.first).c_str(), O_RDWR);
      int err = fd < 0 ? errno : 0;
      if (fd >= 0) close(fd);
      (void)!write(report[1], &err, sizeof(err));
    }
    _exit(0);
  }
  close(report[1]);
  std::vector<int> errs;
  int err;
  while (read(report[0], &err, sizeof(err)) == sizeof(err)) errs.push_back(err);
  close(report[0]);
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_EQ(rmdir(cgroup.c_str()), 0) << strerror(errno);
  // GPU 1 and nvidiactl get past the program (no driver: ENXIO); GPUs 0 and
  // 2 are refused; /dev/null's numbers open.
  EXPECT_THAT(errs, ElementsAre(EPERM, ENXIO, EPERM, ENXIO, 0));
  // This process, outside the cgroup, is not restricted.
  int fd = open((scratch.path() + "/nvidia0").c_str(), O_RDWR);
  EXPECT_EQ(fd < 0 ? errno : 0, ENXIO);
}

}  // namespace
}  // namespace deepnex::launch
