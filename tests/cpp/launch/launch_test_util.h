// Shared by the launch tests: which backends can run here and how, and small
// helpers to watch the processes a container starts.
//
// FixtureFor(backend) is the one hook per backend. The contract tests in
// launcher_test.cc run against every backend whose fixture has no `skip`:
// each backend's branch fills LauncherOptions (engine socket, Slurm env, ...)
// and the image its containers use, from environment variables that the
// ctest fixture starting the engine sets (see tests/cpp/CMakeLists.txt), or
// says in `skip` why the backend cannot run.
#ifndef DEEPNEX_TESTS_LAUNCH_LAUNCH_TEST_UTIL_H_
#define DEEPNEX_TESTS_LAUNCH_LAUNCH_TEST_UTIL_H_

#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "deepnex/launch/launcher.h"
#include "launch/cgroup.h"
#include "test_util.h"

namespace deepnex::launch::test {

struct BackendFixture {
  LauncherOptions options;
  // The image of every contract test's container; commands are plain POSIX
  // sh and busybox-level tools, so a busybox image serves.
  std::string image = "host";
  // An image that does not exist (the bad-input test); empty: the backend
  // has no image to be missing.
  std::string missing_image;
  // Whether the backend enforces spec.memory here, so that a container
  // past it ends oom_killed (the OOM test skips otherwise, with the reason).
  bool memory_limits = true;
  // Whether the containers' cgroups are "<cgroup_parent>/<run name>" under
  // this process's cgroups, so the tests can look for leftovers there.
  bool cgroups = false;
  // Non-empty: why the backend cannot run here (the test skips with it).
  std::string skip;
  // Contract cases that cannot hold on this backend, by test name, with why
  // (the case skips with it).
  std::map<std::string, std::string> unsupported;
  // What EnvAsGranted's container prints of its GPU variables for a grant
  // of GPUs 0 and 1.
  std::string granted_gpu_env = "C=0,1 N=GPU-test-0,GPU-test-1";
  // The node of EnvAsGranted's grant: one the backend can place on.
  std::string node = "n0";
};

inline std::string EnvOr(const char* name, const std::string& fallback = "") {
  const char* v = getenv(name);
  return v != nullptr ? v : fallback;
}

inline BackendFixture FixtureFor(const std::string& backend) {
  BackendFixture f;
  f.options.backend = backend;
  if (backend == "process") {
    f.missing_image = "/nonexistent/deepnex-rootfs";
    // Without a writable cgroup tree it runs plain processes, unlimited.
    f.cgroups = f.memory_limits = Cgroup::Usable().ok();
  } else if (backend == "oci") {
    f.missing_image = "/nonexistent/deepnex-rootfs";
    f.cgroups = true;
    f.skip = ProbeBackends(f.options)["oci"];
  } else if (backend == "docker") {
    f.options.docker.socket = EnvOr("DEEPNEX_TEST_DOCKER_SOCKET");
    f.image = EnvOr("DEEPNEX_TEST_DOCKER_IMAGE");
    f.missing_image = "localhost/deepnex-no-such-image:latest";
    if (f.options.docker.socket.empty() || f.image.empty()) {
      f.skip = "DEEPNEX_TEST_DOCKER_SOCKET and DEEPNEX_TEST_DOCKER_IMAGE are not set "
               "(the ctest fixture that starts podman's service sets them)";
    } else {
      // The fixture hands out the path even when podman could not start.
      f.skip = ProbeBackends(f.options)["docker"];
    }
    f.unsupported["PastMemoryLimitIsOomKilled"] =
        "podman 4.3 on cgroup v1 reports OOMKilled false (exit 137) for a container the "
        "kernel OOM-killed, and records the kill nowhere the API shows";
  } else if (backend == "slurm") {
    const std::string conf = EnvOr("DEEPNEX_TEST_SLURM_CONF");
    if (conf.empty()) {
      f.skip = "DEEPNEX_TEST_SLURM_CONF is not set (the ctest fixture that starts Slurm sets it)";
    } else {
      f.options.slurm.env["SLURM_CONF"] = conf;
    }
    // Slurm picks the GPUs and sets CUDA_VISIBLE_DEVICES itself (0,1 on the
    // idle test cluster); the grant's UUIDs may name other GPUs, so
    // NVIDIA_VISIBLE_DEVICES is not passed on.
    f.granted_gpu_env = "C=0,1 N=";
    // The job goes to the grant's node (--nodelist): the test cluster's one
    // node, named as tests/launch/slurm.sh names it (hostname -s).
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    f.node = std::string(host).substr(0, std::string(host).find('.'));
    f.unsupported["ASecondStopSendsNoSecondTermAndMayKillSooner"] =
        "Stop is scancel: Slurm signals the job itself, after its own KillWait rather than "
        "the caller's grace, and a second scancel of a cancelled job does nothing";
    f.unsupported["PastMemoryLimitIsOomKilled"] =
        "the test cluster does not enforce --mem (TaskPlugin=task/none, no memory cgroup), "
        "so nothing is OOM-killed";
  } else {
    f.skip = "no test fixture for backend \"" + backend + "\"";
  }
  return f;
}

// A token unlikely to appear in any other process's command line, so a test
// can find the processes its container started on this host (inside any
// namespace) by their argv.
inline std::string UniqueToken() {
  std::random_device rd;
  return std::to_string(100000 + rd() % 800000000);
}

// The live (not zombie) processes on this host with `token` in their argv.
inline std::vector<pid_t> ProcessesWithArg(const std::string& token) {
  std::vector<pid_t> found;
  DIR* dir = opendir("/proc");
  if (dir == nullptr) return found;
  while (struct dirent* e = readdir(dir)) {
    const pid_t pid = atoi(e->d_name);
    if (pid <= 0 || pid == getpid()) continue;
    const std::string base = std::string("/proc/") + e->d_name;
    std::ifstream stat(base + "/stat");
    std::string line;
    std::getline(stat, line);
    size_t close = line.rfind(')');
    if (close == std::string::npos || close + 2 >= line.size() || line[close + 2] == 'Z') continue;
    std::ifstream in(base + "/cmdline", std::ios::binary);
    std::string arg;
    while (std::getline(in, arg, '\0')) {
      if (arg.find(token) != std::string::npos) {
        found.push_back(pid);
        break;
      }
    }
  }
  closedir(dir);
  return found;
}

// Whether `done` held within `timeout` (see ::deepnex::test::WaitFor, which
// also says what was awaited).
inline bool WaitUntil(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  return static_cast<bool>(::deepnex::test::WaitFor(done, timeout, ""));
}

}  // namespace deepnex::launch::test

#endif  // DEEPNEX_TESTS_LAUNCH_LAUNCH_TEST_UTIL_H_
