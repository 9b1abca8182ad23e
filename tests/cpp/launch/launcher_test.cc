// The launcher's contract, run against every backend that can start here
// (LaunchContract), the process backend's own behaviour, and the bad inputs
// of the launch issue.
#include <limits.h>
#include <pwd.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "deepnex/launch/launcher.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "launch/backend.h"
#include "launch/cgroup.h"
#include "launch/procfs.h"
#include "launch/util.h"
#include "launch/launch_test_util.h"
#include "test_matchers.h"

namespace deepnex::launch {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::deepnex::test::WaitFor;
using ::testing::AnyOf;
using ::testing::Eq;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using namespace std::chrono_literals;
using test::BackendFixture;
using test::FixtureFor;

constexpr auto kWait = 60s;

int Count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

gpu::Allocation TwoGpus(const std::string& user) {
  gpu::Allocation a;
  a.id = "a-7";
  a.user = user;
  a.node = "n0";
  a.gpus = {{0, "GPU-test-0", 16ull << 30, true}, {1, "GPU-test-1", 16ull << 30, true}};
  a.cpus = 1;
  a.memory = 256 << 20;
  a.env = {{"CUDA_VISIBLE_DEVICES", "0,1"},
           {"NVIDIA_VISIBLE_DEVICES", "GPU-test-0,GPU-test-1"}};
  return a;
}

// The cgroups a launcher with id `launcher_id` has under the parent.
std::vector<std::string> CgroupsOf(const std::string& launcher_id) {
  std::vector<std::string> mine;
  for (const std::string& c : Cgroup::Children("deepnex")) {
    if (c.rfind(launcher_id + "-", 0) == 0) mine.push_back(c);
  }
  return mine;
}

class LaunchContract : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    fixture_ = FixtureFor(GetParam());
    if (!fixture_.skip.empty()) GTEST_SKIP() << GetParam() << ": " << fixture_.skip;
    // The contract's restarts follow their policy's backoff exactly.
    fixture_.options.restart_backoff_floor = 1ms;
    // "EnvAsGranted/slurm" -> "EnvAsGranted".
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    name = name.substr(0, name.find('/'));
    if (auto it = fixture_.unsupported.find(name); it != fixture_.unsupported.end()) {
      GTEST_SKIP() << GetParam() << ": " << it->second;
    }
    auto launcher = Launcher::Create(fixture_.options);
    ASSERT_THAT(launcher, IsOk());
    launcher_ = std::move(*launcher);
  }

  void TearDown() override {
    if (!launcher_) return;
    const std::string id = launcher_->id();
    launcher_.reset();
    // Whatever a test left, the destructor must have stopped.
    if (fixture_.cgroups) EXPECT_THAT(CgroupsOf(id), IsEmpty());
  }

  ContainerSpec Spec(const std::string& name, const std::string& script) {
    ContainerSpec spec;
    spec.name = name;
    spec.image = fixture_.image;
    spec.command = {"sh", "-c", script};
    return spec;
  }

  std::shared_ptr<Handle> StartOk(const ContainerSpec& spec) {
    auto h = launcher_->Start(spec);
    EXPECT_THAT(h, IsOk());
    return h.ok() ? *h : nullptr;
  }

  BackendFixture fixture_;
  std::unique_ptr<Launcher> launcher_;
};

TEST_P(LaunchContract, ExitCodePropagates) {
  auto h = StartOk(Spec("exit3", "echo hello; exit 3"));
  ASSERT_NE(h, nullptr);
  ASSERT_OK_AND_ASSIGN(ExitStatus e, h->Wait(kWait));
  EXPECT_EQ(e.reason, ExitReason::kExited);
  EXPECT_EQ(e.code, 3);
  EXPECT_EQ(e.restarts, 0);
  EXPECT_EQ(e.ToString(), "exited(3)");
  EXPECT_EQ(h->Status().state, State::kExited);
  ASSERT_OK_AND_ASSIGN(std::string logs, h->Logs());
  EXPECT_EQ(logs, "hello\n");
}

TEST_P(LaunchContract, EnvAsGranted) {
  ContainerSpec spec = Spec("env", "echo \"C=$CUDA_VISIBLE_DEVICES N=$NVIDIA_VISIBLE_DEVICES F=$FOO\"");
  spec.allocation = TwoGpus("alice");
  spec.allocation->node = fixture_.node;
  spec.env = {{"FOO", "bar baz"}};
  auto h = StartOk(spec);
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h->spec().user, "alice");
  EXPECT_EQ(h->spec().cpus, 1);
  EXPECT_EQ(h->spec().memory, 256u << 20);
  ASSERT_OK_AND_ASSIGN(ExitStatus e, h->Wait(kWait));
  EXPECT_TRUE(e.ok()) << e.ToString();
  ASSERT_OK_AND_ASSIGN(std::string logs, h->Logs());
  EXPECT_EQ(logs, fixture_.granted_gpu_env + " F=bar baz\n");
}

TEST_P(LaunchContract, StopEndsItSignaled) {
  auto h = StartOk(Spec("sleeper", "exec sleep 1000"));
  ASSERT_NE(h, nullptr);
  ASSERT_THAT(h->Stop(500ms), IsOk());
  ASSERT_OK_AND_ASSIGN(ExitStatus e, h->Wait(kWait));
  EXPECT_EQ(e.reason, ExitReason::kSignaled) << e.ToString();
  EXPECT_THAT(e.signal, AnyOf(Eq(SIGTERM), Eq(SIGKILL)));
  EXPECT_EQ(h->Status().state, State::kStopped);
  EXPECT_THAT(h->Stop(500ms), IsOk());  // idempotent
}

// An admin's stop after the user's, or central's reaper asking again: the
// container gets one TERM, as from kubelet, and the later, shorter grace
// brings the SIGKILL forward.
TEST_P(LaunchContract, ASecondStopSendsNoSecondTermAndMayKillSooner) {
  // The sleeps run in a subshell that ignores TERM, so that only the shell
  // sees it: its trap runs as the signal interrupts its wait.
  auto h = StartOk(Spec("stubborn", "trap 'echo TERM' TERM; "
                                    "(trap '' TERM; echo up; while :; do sleep 0.1; done) & "
                                    "while :; do wait; done"));
  ASSERT_NE(h, nullptr);
  auto logs = [&] { return h->Logs().value_or(""); };
  ASSERT_TRUE(WaitFor([&] { return logs() == "up\n"; }, kWait, "up"));
  const auto begin = std::chrono::steady_clock::now();
  std::thread first([&] { EXPECT_THAT(h->Stop(60s), IsOk()); });
  EXPECT_TRUE(WaitFor([&] { return logs() == "up\nTERM\n"; }, kWait, "the first TERM"))
      << logs();
  EXPECT_THAT(h->Stop(500ms), IsOk());
  first.join();
  EXPECT_LT(std::chrono::steady_clock::now() - begin, 30s);
  ASSERT_OK_AND_ASSIGN(ExitStatus e, h->Wait(kWait));
  EXPECT_EQ(e.ToString(), "signaled(SIGKILL)");
  EXPECT_EQ(logs(), "up\nTERM\n");
}

TEST_P(LaunchContract, PastMemoryLimitIsOomKilled) {
  if (!fixture_.memory_limits) GTEST_SKIP() << GetParam() << " does not enforce memory limits here";
  // The shell holds the 64 MB command substitution itself.
  ContainerSpec spec = Spec("hog", "x=$(head -c 64000000 /dev/zero | tr '\\0' a); echo ${#x}");
  spec.memory = 16 << 20;
  auto h = StartOk(spec);
  ASSERT_NE(h, nullptr);
  ASSERT_OK_AND_ASSIGN(ExitStatus e, h->Wait(kWait));
  EXPECT_EQ(e.reason, ExitReason::kOomKilled) << e.ToString();
  EXPECT_EQ(e.ToString(), "oom_killed");
}

TEST_P(LaunchContract, OnFailureRestartsExactlyThreeTimes) {
  ContainerSpec spec = Spec("flaky", "echo run; exit 1");
  ASSERT_OK_AND_ASSIGN(spec.restart, RestartPolicy::Parse("on-failure:3"));
  spec.restart.backoff = 100ms;
  std::mutex mu;
  std::vector<std::string> told;
  spec.on_restart = [&](const RestartEvent& event) {
    std::lock_guard<std::mutex> lock(mu);
    told.push_back(event.name + " " + event.ToString());
  };
  auto h = StartOk(spec);
  ASSERT_NE(h, nullptr);
  ASSERT_OK_AND_ASSIGN(ExitStatus e, h->Wait(kWait));
  EXPECT_EQ(e.reason, ExitReason::kExited);
  EXPECT_EQ(e.code, 1);
  EXPECT_EQ(e.restarts, 3);
  EXPECT_EQ(e.ToString(), "exited(1) after 3 restarts");
  ContainerStatus s = h->Status();
  EXPECT_EQ(s.restarts, 3);
  EXPECT_EQ(s.state, State::kExited);
  ASSERT_OK_AND_ASSIGN(std::string logs, h->Logs());
  EXPECT_EQ(logs, "run\nrun\nrun\nrun\n");  // four runs, logs kept across them
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_THAT(told, ::testing::ElementsAre("flaky exited(1); restarting (1/3) in 0.1s",
                                           "flaky exited(1); restarting (2/3) in 0.2s",
                                           "flaky exited(1); restarting (3/3) in 0.4s"));
}

TEST_P(LaunchContract, StopKillsTheWholeProcessTree) {
  const std::string token = test::UniqueToken();
  // A child shell and a grandchild sleep, neither ignoring anything.
  auto h = StartOk(Spec("tree", "sh -c 'sleep " + token + " & wait' & sleep " + token + "1 & wait"));
  ASSERT_NE(h, nullptr);
  // sh -c '...', its sleep, and the direct sleep.
  ASSERT_TRUE(test::WaitUntil([&] { return test::ProcessesWithArg(token).size() >= 3; }, 30s))
      << test::ProcessesWithArg(token).size() << " processes seen";
  ASSERT_THAT(h->Stop(500ms), IsOk());
  // Stop returns once the container's first process ended; the others were
  // signalled, and may take a moment to go.
  EXPECT_TRUE(WaitFor([&] { return test::ProcessesWithArg(token).empty(); }, kWait,
                      "the tree's processes to end"))
      << test::ProcessesWithArg(token).size() << " left";
}

TEST_P(LaunchContract, UsageOfABusyContainer) {
  ContainerSpec spec = Spec("busy", "while :; do :; done");
  spec.cpus = 0.5;
  auto h = StartOk(spec);
  ASSERT_NE(h, nullptr);
  Usage u;
  ASSERT_TRUE(test::WaitUntil(
      [&] {
        auto got = h->Usage();
        if (got.ok()) u = *got;
        return u.cpu_seconds >= 0.2;
      },
      30s))
      << "cpu_seconds " << u.cpu_seconds;
  EXPECT_GT(u.memory, 0u);
  EXPECT_GE(u.memory_peak, u.memory);
  EXPECT_GE(u.pids, 1);
  ASSERT_THAT(h->Stop(200ms), IsOk());
}

TEST_P(LaunchContract, NothingLeftAfterStopRemoveCleanup) {
  const std::string token = test::UniqueToken();
  auto h = StartOk(Spec("left", "sleep " + token + " & wait"));
  ASSERT_NE(h, nullptr);
  ASSERT_TRUE(test::WaitUntil([&] { return !test::ProcessesWithArg(token).empty(); }, 30s));
  EXPECT_THAT(launcher_->Remove("left"), StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_THAT(h->Stop(200ms), IsOk());
  ASSERT_THAT(launcher_->Remove("left"), IsOk());
  EXPECT_THAT(launcher_->Get("left"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(launcher_->List(), IsEmpty());
  // Killed, the sleep may still be on its way out; Cleanup would count it.
  EXPECT_TRUE(WaitFor([&] { return test::ProcessesWithArg(token).empty(); }, kWait,
                      "the sleep to end"));
  ASSERT_OK_AND_ASSIGN(int swept, launcher_->Cleanup(launcher_->id()));
  EXPECT_EQ(swept, 0);  // Stop and Remove left nothing to sweep
  if (fixture_.cgroups) EXPECT_THAT(CgroupsOf(launcher_->id()), IsEmpty());
}

TEST_P(LaunchContract, BadInputsAreRefusedAndTheLauncherGoesOn) {
  ContainerSpec good = Spec("good", "exit 0");
  ::deepnex::test::TempDir scratch;

  ContainerSpec spec = good;
  spec.command = {"deepnex-no-such-command", "x"};
  EXPECT_THAT(launcher_->Start(spec),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("deepnex-no-such-command")));

  if (!fixture_.missing_image.empty()) {
    spec = good;
    spec.image = fixture_.missing_image;
    EXPECT_THAT(launcher_->Start(spec), StatusIs(absl::StatusCode::kNotFound));
  }

  spec = good;
  spec.memory = 1024;
  EXPECT_THAT(launcher_->Start(spec),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("spec.memory: 1024 bytes is below the minimum 4MiB")));

  spec = good;
  spec.mounts = {{"data", "/data", true}};
  EXPECT_THAT(launcher_->Start(spec),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("spec.mounts[0].source: \"data\" is not an absolute path")));
  spec.mounts = {{scratch.path(), "data", true}};
  EXPECT_THAT(launcher_->Start(spec),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("spec.mounts[0].target: \"data\" is not an absolute path")));

  spec = good;
  spec.allocation = TwoGpus("alice");
  spec.user = "bob";
  EXPECT_THAT(launcher_->Start(spec),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("spec.user \"bob\" may not use allocation \"a-7\" of user "
                                 "\"alice\"")));

  auto h = StartOk(good);
  ASSERT_NE(h, nullptr);
  ASSERT_OK_AND_ASSIGN(ExitStatus e, h->Wait(kWait));
  EXPECT_TRUE(e.ok()) << e.ToString();
}

// Everything from `fd` until EOF (EIO: a pty whose other side is gone).
std::string ReadAll(int fd) {
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0 || (n < 0 && errno == EINTR)) {
    if (n > 0) out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// Sessions (#16): a command beside the container's, with its env, stdin,
// stdout, stderr and exit code; on a pty of the asked size.
TEST_P(LaunchContract, ExecRunsBesideTheCommand) {
  if (GetParam() == "docker" || GetParam() == "slurm") {
    GTEST_SKIP() << GetParam() << " has no exec";
  }
  ContainerSpec spec = Spec("box", "sleep 600");
  spec.env["GREETING"] = "hello";
  auto h = StartOk(spec);
  ASSERT_NE(h, nullptr);
  ASSERT_TRUE(WaitFor([&] { return h->Status().state == State::kRunning; }, kWait, "box running"));
  auto p = h->Exec(
      {.command = {"sh", "-c", "echo $GREETING ${TERM:-no-term}; cat; echo oops >&2; exit 3"}});
  ASSERT_THAT(p, IsOk());
  ASSERT_THAT((*p)->WriteInput("in\n"), IsOk());
  (*p)->CloseInput();
  std::string err;
  std::thread errors([&] { err = ReadAll((*p)->error_fd()); });
  EXPECT_EQ(ReadAll((*p)->output_fd()), "hello no-term\nin\n");
  errors.join();
  EXPECT_EQ(err, "oops\n");
  auto code = (*p)->Wait();
  ASSERT_THAT(code, IsOk());
  EXPECT_EQ(*code, 3);

  // runc exec --tty sizes the container's console from ours only after it
  // started the process, so under oci the size can still be 0 0 at first:
  // wait for it there, as a shell's SIGWINCH handler would see it. On a tty
  // a TERM, as docker exec -t gives (vi and less had none).
  auto tty = h->Exec({.command = {"sh", "-c",
                                  "while [ \"$(stty size)\" = \"0 0\" ]; do sleep 0.01; done; "
                                  "echo $TERM; stty size"},
                      .tty = true,
                      .rows = 30,
                      .cols = 100});
  ASSERT_THAT(tty, IsOk());
  EXPECT_EQ((*tty)->error_fd(), -1);
  EXPECT_EQ(ReadAll((*tty)->output_fd()), "xterm\r\n30 100\r\n");
  code = (*tty)->Wait();
  ASSERT_THAT(code, IsOk());
  EXPECT_EQ(*code, 0);

  ASSERT_THAT(h->Stop(1s), IsOk());
  EXPECT_THAT(h->Exec({.command = {"true"}}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_P(LaunchContract, ATermOfTheContainersOwnIsKeptOnATty) {
  if (GetParam() == "docker" || GetParam() == "slurm") {
    GTEST_SKIP() << GetParam() << " has no exec";
  }
  ContainerSpec spec = Spec("term", "sleep 600");
  spec.env["TERM"] = "vt100";
  auto h = StartOk(spec);
  ASSERT_NE(h, nullptr);
  ASSERT_TRUE(WaitFor([&] { return h->Status().state == State::kRunning; }, kWait, "running"));
  auto tty = h->Exec({.command = {"sh", "-c", "echo $TERM"}, .tty = true});
  ASSERT_THAT(tty, IsOk());
  EXPECT_EQ(ReadAll((*tty)->output_fd()), "vt100\r\n");
  EXPECT_THAT((*tty)->Wait(), IsOk());
  ASSERT_THAT(h->Stop(1s), IsOk());
}

INSTANTIATE_TEST_SUITE_P(Backends, LaunchContract,
                         ::testing::Values("process", "oci", "docker", "slurm"),
                         [](const auto& info) { return info.param; });

// The generic checks of Start and the process backend's own behaviour.
class ProcessLauncherTest : public ::testing::Test {
 protected:
  // For the tests of limits, which plain processes do not have.
  static bool SkipWithoutCgroups() {
    absl::Status usable = Cgroup::Usable();
    if (!usable.ok()) std::cerr << "no cgroups here: " << usable << "\n";
    return !usable.ok();
  }

  // Restarts as fast as a spec asks: most tests here are not about the
  // crash-loop floor.
  static LauncherOptions Fast() {
    LauncherOptions options;
    options.restart_backoff_floor = 1ms;
    return options;
  }

  void SetUp() override { Make(Fast()); }
  void TearDown() override {
    if (!launcher_) return;
    const std::string id = launcher_->id();
    launcher_.reset();
    EXPECT_THAT(CgroupsOf(id), IsEmpty());
  }

  void Make(LauncherOptions options) {
    options.backend = "process";
    launcher_.reset();
    auto launcher = Launcher::Create(options);
    ASSERT_THAT(launcher, IsOk());
    launcher_ = std::move(*launcher);
  }

  static ContainerSpec Spec(const std::string& name, const std::string& script) {
    ContainerSpec spec;
    spec.name = name;
    spec.command = {"sh", "-c", script};
    return spec;
  }

  ExitStatus Run(const ContainerSpec& spec, std::string* logs = nullptr) {
    auto h = launcher_->Start(spec);
    EXPECT_THAT(h, IsOk());
    if (!h.ok()) return {ExitReason::kLost};
    auto e = (*h)->Wait(kWait);
    EXPECT_THAT(e, IsOk());
    if (logs != nullptr) *logs = (*h)->Logs().value_or("");
    EXPECT_THAT(launcher_->Remove(spec.name), IsOk());
    return e.value_or(ExitStatus{ExitReason::kLost});
  }

  void ExpectStartFails(const ContainerSpec& spec, absl::StatusCode code,
                        const std::string& message) {
    EXPECT_THAT(launcher_->Start(spec), StatusIs(code, HasSubstr(message)));
    EXPECT_THAT(launcher_->Get(spec.name), StatusIs(absl::StatusCode::kNotFound));
  }

  std::unique_ptr<Launcher> launcher_;
  ::deepnex::test::TempDir scratch_;
};

TEST_F(ProcessLauncherTest, EnvIsExactlyTheSpecsPlusPathAndLauncherId) {
  ContainerSpec spec = Spec("env", "env | sort; pwd");
  spec.env = {{"A", "1"}, {"B", "two words"}};
  spec.working_dir = scratch_.path();
  std::string logs;
  EXPECT_TRUE(Run(spec, &logs).ok());
  std::string path = getenv("PATH");
  EXPECT_EQ(logs, "A=1\nB=two words\nDEEPNEX_LAUNCHER_ID=" + launcher_->id() + "\nPATH=" +
                      path + "\nPWD=" + scratch_.path() + "\n" + scratch_.path() + "\n");
}

TEST_F(ProcessLauncherTest, SignaledBySelf) {
  ExitStatus e = Run(Spec("self", "kill -USR1 $$"));
  EXPECT_EQ(e.reason, ExitReason::kSignaled);
  EXPECT_EQ(e.signal, SIGUSR1);
  EXPECT_EQ(e.ToString(), "signaled(SIGUSR1)");
}

TEST_F(ProcessLauncherTest, CommandNotFoundIsNotFoundAtStartNotExit127) {
  ContainerSpec spec = Spec("nf", "");
  spec.command = {"deepnex-no-such-command"};
  ExpectStartFails(spec, absl::StatusCode::kNotFound,
                   "command \"deepnex-no-such-command\" not found on PATH=");
  spec.env["PATH"] = scratch_.path();
  spec.command = {"sh", "-c", "true"};
  ExpectStartFails(spec, absl::StatusCode::kNotFound,
                   "command \"sh\" not found on PATH=" + scratch_.path());
  // Present but not executable.
  const std::string file = scratch_.path() + "/not-executable";
  std::ofstream(file) << "#!/bin/sh\n";
  spec.env.clear();
  spec.command = {file};
  ExpectStartFails(spec, absl::StatusCode::kNotFound, "not found or not executable");
  // Executable, but exec itself fails: reported at Start, not as exit 127.
  const std::string bad_interp = scratch_.path() + "/bad-interpreter";
  std::ofstream(bad_interp) << "#!/nonexistent/interpreter\n";
  chmod(bad_interp.c_str(), 0755);
  spec.command = {bad_interp};
  ExpectStartFails(spec, absl::StatusCode::kNotFound, "exec " + bad_interp + " failed");
  EXPECT_TRUE(Run(Spec("good", "exit 0")).ok());
}

TEST_F(ProcessLauncherTest, ImagesAreRefused) {
  ContainerSpec spec = Spec("img", "exit 0");
  spec.image = "/nonexistent/deepnex-rootfs";
  ExpectStartFails(spec, absl::StatusCode::kNotFound,
                   "spec.image: \"/nonexistent/deepnex-rootfs\" does not exist");
  spec.image = scratch_.path();
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument, "cannot use an image");
  EXPECT_TRUE(Run(Spec("good", "exit 0")).ok());
}

TEST_F(ProcessLauncherTest, BadSpecFields) {
  ContainerSpec spec = Spec("ok", "exit 0");
  spec.name = "-starts-with-dash";
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument, "spec.name: \"-starts-with-dash\"");
  spec.name = std::string(64, 'a');
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument, "at most 63 characters");
  spec = Spec("ok", "exit 0");
  spec.command.clear();
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument, "spec.command: empty");
  spec = Spec("ok", "exit 0");
  spec.working_dir = "relative/dir";
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.working_dir: \"relative/dir\" is not an absolute path");
  spec = Spec("ok", "exit 0");
  spec.cpus = -1;
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument, "spec.cpus: -1");
  spec.cpus = std::numeric_limits<double>::quiet_NaN();
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument, "spec.cpus: nan");
  spec = Spec("ok", "exit 0");
  spec.pids_limit = -5;
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument, "spec.pids_limit: -5 is negative");
  // Past what cgroups take, refused as the caller's mistake, not the
  // cgroup write's FailedPrecondition once half the container was set up.
  spec.pids_limit = int64_t{1} << 40;
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.pids_limit: 1099511627776 is more than the kernel's most processes "
                   "(4194304)");
  spec = Spec("ok", "exit 0");
  spec.cpus = 1e9;
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.cpus: 1e+09 is more than 65536 cores");
  // A NUL ends a C string: exec would have run with the argument or value
  // cut short at it, silently.
  spec = Spec("ok", "exit 0");
  spec.command.push_back(std::string("a\0b", 3));
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.command[3]: holds a NUL byte");
  spec = Spec("ok", "exit 0");
  spec.env["A"] = std::string("x\0y", 3);
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.env: the value of \"A\" holds a NUL byte");
  spec = Spec("ok", "exit 0");
  spec.labels["deepnex.launcher"] = "other";
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.labels: \"deepnex.launcher\" is set by the launcher");
  // A newline would forge a line of squeue's output, from which Slurm's
  // Cleanup cancels jobs: another user's, by the forged line's job id.
  const std::pair<std::string, std::string> bad_labels[] = {
      {"note", "x\n7 RUNNING deepnex.launcher=l1"},
      {"note", "a,deepnex.launcher=l1"},
      {"a=b", "c"},
      {"a b", "c"},
      {"", "c"},
      {std::string(254, 'k'), "c"},
      {"note", std::string(4097, 'v')},
  };
  for (const auto& [key, value] : bad_labels) {
    spec = Spec("ok", "exit 0");
    spec.labels[key] = value;
    ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                     key.empty() || key.size() > 253 || key.find_first_of("= ") != std::string::npos
                         ? "spec.labels: key \""
                         : "spec.labels: the value of \"note\"");
  }
  spec = Spec("ok", "exit 0");
  spec.labels["note"] = "x\n7";
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.labels: the value of \"note\" (\"x\\n7\") is not at most 4096 "
                   "characters without control characters or ','");
  // Near 2^64, Slurm's rounding up to whole MiB wrapped to --mem=0: all of
  // the node's memory.
  spec = Spec("ok", "exit 0");
  spec.memory = ~0ull - (1ull << 19) + 1;
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.memory: 18446744073709027328 bytes is more than ");
  spec = Spec("ok", "exit 0");
  for (int i = 0; i < 16; ++i) spec.labels[absl::StrCat("k", i)] = std::string(4094, 'v');
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.labels: 16 labels of 65542 bytes in all (keys and values); at most 65536");
  spec = Spec("ok", "exit 0");
  spec.env["A=B"] = "c";
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument, "spec.env: \"A=B\"");
  EXPECT_TRUE(Run(Spec("ok", "exit 0")).ok());
}

TEST_F(ProcessLauncherTest, WorkingDirIsADirectoryOnThisHost) {
  ContainerSpec spec = Spec("wd", "exit 0");
  spec.working_dir = scratch_.path() + "/missing";
  ExpectStartFails(spec, absl::StatusCode::kNotFound,
                   "spec.working_dir: \"" + spec.working_dir +
                       "\" is not a directory on this host");
  spec.working_dir = scratch_.path() + "/file";
  std::ofstream(spec.working_dir) << "not a directory\n";
  ExpectStartFails(spec, absl::StatusCode::kNotFound,
                   "spec.working_dir: \"" + spec.working_dir +
                       "\" is not a directory on this host");
  EXPECT_TRUE(Run(Spec("wd", "exit 0")).ok());
}

TEST_F(ProcessLauncherTest, BadRunAsAndNetworkFields) {
  ContainerSpec spec = Spec("ok", "exit 0");
  spec.run_as = RunAs{geteuid(), getegid(), "Not A Name", ""};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.run_as.user: \"Not A Name\" is not a user name ([a-z_][a-z0-9_-]*, "
                   "at most 32 characters)");
  spec.run_as = RunAs{geteuid(), getegid(), "alice", "relative"};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.run_as.home: \"relative\" is not an absolute path");
  spec = Spec("ok", "exit 0");
  spec.network_none = true;
  spec.host_network = true;
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.host_network: true contradicts spec.network_none: true");
  if (geteuid() != 0) {
    spec = Spec("ok", "exit 0");
    spec.run_as = RunAs{geteuid() + 1, getegid(), "", ""};
    ExpectStartFails(spec, absl::StatusCode::kPermissionDenied,
                     absl::StrCat("spec.run_as: uid ", geteuid() + 1, " gid ", getegid(),
                                  ": this launcher runs as uid ", geteuid()));
  }
  EXPECT_TRUE(Run(Spec("ok", "exit 0")).ok());
}

// A launcher's own uid needs no privilege: the user's own scripts keep
// running as themselves, with no new privileges.
TEST_F(ProcessLauncherTest, RunAsTheLaunchersOwnIds) {
  ContainerSpec spec =
      Spec("me", "id -u; id -g; echo $HOME $USER; pwd; grep NoNewPrivs /proc/self/status");
  spec.run_as = RunAs{geteuid(), getegid(), "me", scratch_.path()};
  std::string logs;
  EXPECT_TRUE(Run(spec, &logs).ok()) << logs;
  // Without a working_dir it starts at home, as a login does, not in the
  // launcher's directory.
  EXPECT_EQ(logs, absl::StrCat(geteuid(), "\n", getegid(), "\n", scratch_.path(), " me\n",
                               scratch_.path(), "\nNoNewPrivs:\t1\n"));
  // A home that is not there leaves "/", as login(1) does.
  spec = Spec("me2", "pwd");
  spec.run_as = RunAs{geteuid(), getegid(), "me", "/nonexistent/home"};
  EXPECT_TRUE(Run(spec, &logs).ok()) << logs;
  EXPECT_EQ(logs, "/\n");
  // None named (central maps users to uids only): the uid's in this host's
  // passwd, where that directory exists. Central's users started in "/",
  // HOME unwritable, though their home was there.
  const passwd* entry = getpwuid(geteuid());
  std::string home = entry != nullptr && entry->pw_dir != nullptr ? entry->pw_dir : "";
  struct stat st;
  if (home.empty() || home[0] != '/' || stat(home.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    home = "/";
  }
  spec = Spec("me3", "echo $HOME; pwd");
  spec.run_as = RunAs{geteuid(), getegid(), "me", ""};
  EXPECT_TRUE(Run(spec, &logs).ok()) << logs;
  EXPECT_EQ(logs, absl::StrCat(home, "\n", home, "\n"));
}

// The process backend as central drives it: root's launcher runs a user's
// process as that user's uid, which reads none of root's files and holds no
// capability.
TEST_F(ProcessLauncherTest, RunAsAnotherUidDropsRoot) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run as another uid";
  const std::string secret = scratch_.path() + "/token";
  std::ofstream(secret) << "admintok root admin\n";
  ASSERT_EQ(chmod(secret.c_str(), 0600), 0);
  ASSERT_EQ(chmod(scratch_.path().c_str(), 0755), 0);
  ContainerSpec spec = Spec("nobody", "id -u; id -G; cat " + secret +
                                          " 2>/dev/null || echo denied; "
                                          "grep -E '^(CapEff|NoNewPrivs)' /proc/self/status");
  spec.run_as = RunAs{65534, 65534, "", ""};
  std::string logs;
  EXPECT_TRUE(Run(spec, &logs).ok()) << logs;
  EXPECT_EQ(logs, "65534\n65534\ndenied\nCapEff:\t0000000000000000\nNoNewPrivs:\t1\n");
  // Its working directory is entered as the user.
  spec = Spec("nobody", "pwd");
  spec.run_as = RunAs{65534, 65534, "", ""};
  ASSERT_EQ(chmod(scratch_.path().c_str(), 0700), 0);
  spec.working_dir = scratch_.path();
  ExpectStartFails(spec, absl::StatusCode::kNotFound,
                   "spec.working_dir: cannot enter \"" + scratch_.path() + "\": Permission denied");
}

TEST_F(ProcessLauncherTest, NamedImages) {
  LauncherOptions options = Fast();
  options.images = {{"base", "host"}, {"rootfs", scratch_.path()}};
  Make(options);
  ContainerSpec spec = Spec("named", "echo ran");
  spec.image = "base";
  std::string logs;
  EXPECT_TRUE(Run(spec, &logs).ok());
  EXPECT_EQ(logs, "ran\n");
  // The name stands for its directory, which a process cannot use; the
  // error names it as given, not the directory on this host.
  spec.image = "rootfs";
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.image: \"rootfs\": the process backend runs on the host and cannot use "
                   "an image's files");
  spec.image = scratch_.path();
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.image: \"" + scratch_.path() + "\": the process backend");
}

TEST_F(ProcessLauncherTest, AllocationChecks) {
  ContainerSpec spec = Spec("gpu", "exit 0");
  spec.allocation = TwoGpus("alice");
  spec.env["CUDA_VISIBLE_DEVICES"] = "0,1,2";
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.env: CUDA_VISIBLE_DEVICES=\"0,1,2\" contradicts allocation \"a-7\" "
                   "(\"0,1\")");
  spec.env = {{"DEEPNEX_GPU_MEMORY_LIMIT", "1"}};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument, "(unset)");
  spec.env = {{"CUDA_VISIBLE_DEVICES", "0,1"}};  // repeating the grant is fine
  spec.cpus = 2;
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.cpus: 2 is more than allocation \"a-7\" grants (1)");
  spec.cpus = 0;
  spec.memory = 1ull << 30;
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.memory: 1GiB is more than allocation \"a-7\" grants (256MiB)");
  spec.memory = 0;
  spec.user = "bob";
  ExpectStartFails(spec, absl::StatusCode::kPermissionDenied, "\"bob\" may not use");
  spec.user = "alice";
  EXPECT_TRUE(Run(spec).ok());
}

// A grant of 0 CPUs or 0 memory is none, never "unlimited" (#12): a spec
// without limits is refused, and so is any limit above 0.
TEST_F(ProcessLauncherTest, AGrantOfZeroCpusOrMemoryStartsNothing) {
  ContainerSpec spec = Spec("gpu", "exit 0");
  spec.allocation = TwoGpus("alice");
  spec.allocation->cpus = 0;
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.cpus: allocation \"a-7\" grants 0 CPUs, and a container needs some "
                   "(allocate with cpus > 0)");
  spec.cpus = 64;
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.cpus: 64 is more than allocation \"a-7\" grants (0)");
  spec.cpus = 0;
  spec.allocation = TwoGpus("alice");
  spec.allocation->memory = 0;
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.memory: allocation \"a-7\" grants no memory, and a container needs "
                   "some (allocate with memory > 0)");
  spec.memory = 64 << 20;
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.memory: 64MiB is more than allocation \"a-7\" grants (0B)");
}

// A spec without limits gets the grant's whole CPUs and memory; one within
// the grant keeps its own.
TEST_F(ProcessLauncherTest, ASpecWithoutLimitsGetsTheGrants) {
  ContainerSpec spec = Spec("all", "exit 0");
  spec.allocation = TwoGpus("alice");
  spec.allocation->cpus = 2;
  ASSERT_OK_AND_ASSIGN(auto all, launcher_->Start(spec));
  EXPECT_EQ(all->spec().cpus, 2);
  EXPECT_EQ(all->spec().memory, 256u << 20);
  spec.name = "part";
  spec.cpus = 0.5;
  spec.memory = 64 << 20;
  ASSERT_OK_AND_ASSIGN(auto part, launcher_->Start(spec));
  EXPECT_EQ(part->spec().cpus, 0.5);
  EXPECT_EQ(part->spec().memory, 64u << 20);
  ASSERT_OK(all->Wait(kWait).status());
  ASSERT_OK(part->Wait(kWait).status());
}

TEST_F(ProcessLauncherTest, MountsOutsideTheAllowedRootsOrNotNormal) {
  LauncherOptions options;
  options.allowed_mount_roots = {scratch_.path()};
  Make(options);
  ASSERT_EQ(mkdir((scratch_.path() + "/data").c_str(), 0755), 0);
  ASSERT_EQ(symlink("/etc", (scratch_.path() + "/escape").c_str()), 0);
  ContainerSpec spec = Spec("m", "exit 0");
  spec.mounts = {{"/etc", "/etc", true}};
  ExpectStartFails(spec, absl::StatusCode::kPermissionDenied,
                   "spec.mounts[0].source: \"/etc\" is outside the allowed mount roots [" +
                       scratch_.path() + "]");
  // Checked where the symlink leads.
  spec.mounts = {{scratch_.path() + "/escape", "/x", true}};
  ExpectStartFails(spec, absl::StatusCode::kPermissionDenied,
                   "spec.mounts[0].source: \"" + scratch_.path() +
                       "/escape\" (\"/etc\") is outside");
  spec.mounts = {{scratch_.path() + "/data/../../", "/x", true}};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument, "is not lexically normal");
  spec.mounts = {{scratch_.path() + "/missing", "/x", true}};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.mounts[0].source: \"" + scratch_.path() + "/missing\" does not exist");
  spec.mounts = {{scratch_.path() + "/data", "/x/../y", true}};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.mounts[0].target: \"/x/../y\" is not lexically normal");
  const std::pair<std::string, std::string> runtime[] = {
      {"/proc", "/proc"}, {"/dev/", "/dev"}, {"/dev/shm", "/dev"}, {"/sys/fs/cgroup", "/sys"}};
  for (const auto& [target, dir] : runtime) {
    spec.mounts = {{scratch_.path() + "/data", target, true}};
    ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                     "spec.mounts[0].target: \"" + target + "\" is over the container's " + dir +
                         ", which the runtime mounts");
  }
  spec.mounts = {{scratch_.path() + "/data", "/", true}};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.mounts[0].target: \"/\" would cover the container's root");
  spec.mounts = {{scratch_.path() + "/data", "/devices", true}};  // not /dev
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument, "the process backend");
}

// A refused path is shown escaped (a newline or an escape sequence in it
// cannot forge a line or drive the terminal) and whole up to 1 KiB: cut at
// 64 bytes, a path under a CI run's long tmp dir lost the part that named it.
TEST_F(ProcessLauncherTest, RefusedPathsAndUsersAreEscapedAndWhole) {
  LauncherOptions options;
  options.allowed_mount_roots = {scratch_.path()};
  Make(options);
  const std::string odd = "/x\ny\x1b[2J";
  const std::string shown = "\"/x\\ny\\x1b[2J\"";
  const std::string missing = scratch_.path() + "/" + std::string(200, 'm');
  ContainerSpec spec = Spec("p", "exit 0");
  spec.mounts = {{missing, "/x", true}};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.mounts[0].source: \"" + missing + "\" does not exist");
  spec.mounts = {{scratch_.path() + odd, "/x", true}};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.mounts[0].source: \"" + scratch_.path() +
                       "/x\\ny\\x1b[2J\" does not exist");
  spec.mounts = {{scratch_.path(), "/proc" + odd, true}};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.mounts[0].target: \"/proc/x\\ny\\x1b[2J\" is over the container's /proc");
  spec.mounts = {{"rel" + odd, "/x", true}};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.mounts[0].source: \"rel/x\\ny\\x1b[2J\" is not an absolute path");
  // The process backend's own refusal of a mount.
  spec.mounts = {{scratch_.path(), odd + std::string(200, 't'), false}};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   " at \"/x\\ny\\x1b[2J" + std::string(200, 't') + "\";");
  spec = Spec("p", "exit 0");
  spec.working_dir = odd;
  ExpectStartFails(spec, absl::StatusCode::kNotFound,
                   "spec.working_dir: " + shown + " is not a directory on this host");
  spec.working_dir = missing;
  ExpectStartFails(spec, absl::StatusCode::kNotFound,
                   "spec.working_dir: \"" + missing + "\" is not a directory on this host");
  spec = Spec("p", "exit 0");
  spec.run_as = RunAs{geteuid(), getegid(), "a\nb\x1b[2J", ""};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.run_as.user: \"a\\nb\\x1b[2J\" is not a user name");
  EXPECT_TRUE(Run(Spec("p", "exit 0")).ok());
}

// A process has the host's files: a mount is taken only where it changes
// nothing, so that one command line serves the process and oci backends.
TEST_F(ProcessLauncherTest, OnlyMountsOntoThemselves) {
  const std::string data = scratch_.path() + "/data";
  ASSERT_EQ(mkdir(data.c_str(), 0755), 0);
  ASSERT_EQ(symlink(data.c_str(), (scratch_.path() + "/link").c_str()), 0);
  ContainerSpec spec = Spec("m", "cat " + data + "/f");
  std::ofstream(data + "/f") << "in-data\n";
  spec.mounts = {{data, data, false}};
  std::string logs;
  EXPECT_TRUE(Run(spec, &logs).ok());
  EXPECT_EQ(logs, "in-data\n");
  // The same directory under another name is still itself.
  spec.mounts = {{scratch_.path() + "/link", data, false}};
  EXPECT_TRUE(Run(spec).ok());
  spec.mounts = {{data, "/data", false}};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "spec.mounts[0]: the process backend runs on the host's files and cannot "
                   "mount \"" + data + "\" at \"/data\"; it takes only a writable mount of a "
                   "path onto itself");
  spec.mounts = {{data, data, true}};
  ExpectStartFails(spec, absl::StatusCode::kInvalidArgument,
                   "cannot mount \"" + data + "\" at \"" + data + "\" read-only");
}

// Made absolute at Create: the launcher's files stay where they were meant
// to be after the process changes its directory.
TEST_F(ProcessLauncherTest, ARelativeStateDirIsMadeAbsolute) {
  char cwd[PATH_MAX];
  ASSERT_NE(getcwd(cwd, sizeof cwd), nullptr);
  ASSERT_EQ(chdir(scratch_.path().c_str()), 0);
  LauncherOptions options;
  options.state_dir = "state";
  Make(options);
  ASSERT_EQ(chdir("/"), 0);
  std::string logs;
  EXPECT_TRUE(Run(Spec("rel", "echo hi"), &logs).ok());
  ASSERT_EQ(chdir(cwd), 0);
  EXPECT_EQ(logs, "hi\n");
  auto h = launcher_->Start(Spec("kept", "exit 0"));
  ASSERT_THAT(h, IsOk());
  EXPECT_TRUE(std::filesystem::exists(scratch_.path() + "/state/containers/kept/record.json"));
}

TEST_F(ProcessLauncherTest, NamesAreUniqueUntilRemoved) {
  auto h = launcher_->Start(Spec("dup", "sleep 1000"));
  ASSERT_THAT(h, IsOk());
  EXPECT_THAT(launcher_->Start(Spec("dup", "exit 0")),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("\"dup\"")));
  ASSERT_EQ(launcher_->List().size(), 1u);
  ASSERT_OK_AND_ASSIGN(auto got, launcher_->Get("dup"));
  EXPECT_EQ(got, *h);
  EXPECT_THAT((*h)->Wait(50ms), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                         HasSubstr("container \"dup\" still running")));
  ASSERT_THAT((*h)->Stop(1s), IsOk());
  ASSERT_THAT(launcher_->Remove("dup"), IsOk());
  EXPECT_TRUE(Run(Spec("dup", "exit 0")).ok());
}

TEST_F(ProcessLauncherTest, CpuLimitHolds) {
  if (SkipWithoutCgroups()) GTEST_SKIP() << "needs a writable cgroup tree";
  ContainerSpec spec = Spec("capped", "while :; do :; done");
  spec.cpus = 0.2;
  ASSERT_OK_AND_ASSIGN(auto h, launcher_->Start(spec));
  const auto start = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(1500ms);
  ASSERT_OK_AND_ASSIGN(Usage u, h->Usage());
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GT(u.cpu_seconds, 0.05);
  EXPECT_LT(u.cpu_seconds, 0.2 * wall + 0.15) << "wall " << wall;
  ASSERT_THAT(h->Stop(0ms), IsOk());
}

TEST_F(ProcessLauncherTest, PidsLimitHolds) {
  if (SkipWithoutCgroups()) GTEST_SKIP() << "needs a writable cgroup tree";
  ContainerSpec spec = Spec("forky", "for i in 1 2 3 4 5 6 7 8; do sleep 5 & done; wait; echo done");
  spec.pids_limit = 4;
  std::string logs;
  Run(spec, &logs);
  EXPECT_THAT(logs, HasSubstr("fork"));
}

// An exec that passed the launcher's "running" check as the run's process
// ended is refused by the run, whether the end is not yet reaped, reaped, or
// its cgroup already removed: a process started then would outlive the
// container and, without its cgroup, every limit.
TEST_F(ProcessLauncherTest, ExecBesideAnEndedRunIsRefused) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> backend, MakeProcessBackend(Fast()));
  ::deepnex::test::TempDir dir;
  RunContext context;
  context.launcher_id = launcher_->id();
  context.run_name = launcher_->id() + "-ended-0";
  context.dir = dir.path();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<launch::Run> run,
                       backend->Start(Spec("ended", "exit 0"), context));
  const auto refused = [&] {
    return run->Exec({.command = {"sleep", "600"}}).status();
  };
  // Exited, not yet reaped (nothing has called Wait): a zombie.
  const std::string stat = "/proc/" + run->id() + "/stat";
  ASSERT_TRUE(test::WaitUntil([&] {
    std::ifstream f(stat);
    std::string pid, comm, state;
    f >> pid >> comm >> state;
    return state == "Z";
  }, 30s));
  EXPECT_THAT(refused(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                  HasSubstr("the container has ended")));
  ASSERT_OK_AND_ASSIGN(std::optional<ExitStatus> e, run->Wait(0ms));
  ASSERT_TRUE(e.has_value());
  EXPECT_THAT(refused(), StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_THAT(run->Remove(), IsOk());
  EXPECT_THAT(refused(), StatusIs(absl::StatusCode::kFailedPrecondition));
}

// A spec without a limit still has one: a fork bomb stays in its container.
TEST_F(ProcessLauncherTest, PidsLimitDefaultsTo4096) {
  if (SkipWithoutCgroups()) GTEST_SKIP() << "needs a writable cgroup tree";
  // v1: the pids hierarchy's line of /proc/self/cgroup; v2: the one line.
  ContainerSpec spec = Spec("bounded",
                            "line=$(grep -E '^[0-9]+:pids:' /proc/self/cgroup || "
                            "grep '^0::' /proc/self/cgroup); d=${line##*:}; "
                            "cat /sys/fs/cgroup/pids$d/pids.max 2>/dev/null || "
                            "cat /sys/fs/cgroup$d/pids.max");
  std::string logs;
  EXPECT_EQ(Run(spec, &logs).reason, ExitReason::kExited) << logs;
  EXPECT_EQ(logs, "4096\n");
}

TEST_F(ProcessLauncherTest, AlwaysRestartsUntilStopped) {
  ContainerSpec spec = Spec("again", "echo x; exit 0");
  ASSERT_OK_AND_ASSIGN(spec.restart, RestartPolicy::Parse("always"));
  spec.restart.backoff = 1ms;
  spec.restart.max_backoff = 5ms;
  ASSERT_OK_AND_ASSIGN(auto h, launcher_->Start(spec));
  ASSERT_TRUE(test::WaitUntil([&] { return h->Status().restarts >= 3; }, 30s));
  ASSERT_THAT(h->Stop(1s), IsOk());
  ASSERT_OK_AND_ASSIGN(ExitStatus e, h->Wait(kWait));
  EXPECT_GE(e.restarts, 3);
  EXPECT_EQ(h->Status().state, State::kStopped);
  ASSERT_OK_AND_ASSIGN(std::string logs, h->Logs());
  // Every run but the last, which Stop may end before it prints.
  EXPECT_GE(Count(logs, "x\n"), e.restarts);
}

TEST_F(ProcessLauncherTest, StopDuringBackoffEndsAtOnce) {
  ContainerSpec spec = Spec("slow", "exit 1");
  ASSERT_OK_AND_ASSIGN(spec.restart, RestartPolicy::Parse("on-failure"));
  spec.restart.backoff = 60s;
  spec.restart.max_backoff = 60s;
  ASSERT_OK_AND_ASSIGN(auto h, launcher_->Start(spec));
  ASSERT_TRUE(test::WaitUntil([&] { return h->Status().state == State::kRestarting; }, 30s));
  const auto start = std::chrono::steady_clock::now();
  ASSERT_THAT(h->Stop(1s), IsOk());
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  ASSERT_OK_AND_ASSIGN(ExitStatus e, h->Wait(0ms));
  EXPECT_EQ(e.ToString(), "exited(1)");
  EXPECT_EQ(h->Status().state, State::kStopped);
}

TEST_F(ProcessLauncherTest, DestructorStopsEverythingAtOnce) {
  const std::string token = test::UniqueToken();
  for (const char* name : {"a", "b", "c"}) {
    // Ignores SIGTERM, so each needs the SIGKILL after the 1 s grace.
    ASSERT_THAT(launcher_->Start(Spec(name, "trap '' TERM; sleep " + token + " & wait")), IsOk());
  }
  ASSERT_TRUE(test::WaitUntil([&] { return test::ProcessesWithArg(token).size() >= 6; }, 30s));
  const auto start = std::chrono::steady_clock::now();
  const std::string id = launcher_->id();
  launcher_.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2500ms);
  // Each container's first process was reaped; its sleep was killed, not
  // waited for.
  EXPECT_TRUE(WaitFor([&] { return test::ProcessesWithArg(token).empty(); }, kWait,
                      "the sleeps to end"));
  EXPECT_THAT(CgroupsOf(id), IsEmpty());
}

// A restarted container's CPU seconds count every run's, as its metrics'
// counter and its job's CPU-hours say: each run has its own cgroup, and
// they counted the last run's alone. A fixed loop burns about the same CPU
// time in each run however loaded the host is.
TEST_F(ProcessLauncherTest, CpuSecondsCountEveryRunOfARestartedContainer) {
  const std::string burn = "i=0; while [ $i -lt 150000 ]; do i=$((i+1)); done";
  ContainerSpec thrice = Spec("thrice", burn + "; exit 1");
  ASSERT_OK_AND_ASSIGN(thrice.restart, RestartPolicy::Parse("on-failure:2"));
  thrice.restart.backoff = 10ms;
  ASSERT_OK_AND_ASSIGN(auto three, launcher_->Start(thrice));
  ASSERT_OK_AND_ASSIGN(auto one, launcher_->Start(Spec("once", burn + "; exit 1")));
  ASSERT_OK_AND_ASSIGN(ExitStatus e, three->Wait(60s));
  EXPECT_EQ(e.restarts, 2);
  ASSERT_OK(one->Wait(60s).status());
  ASSERT_OK_AND_ASSIGN(Usage u3, three->Usage());
  ASSERT_OK_AND_ASSIGN(Usage u1, one->Usage());
  EXPECT_GT(u1.cpu_seconds, 0.02);
  EXPECT_GT(u3.cpu_seconds, 2 * u1.cpu_seconds) << "one run: " << u1.cpu_seconds;
}

// Device nodes of a driver that is not loaded: opening an allowed one fails
// with ENXIO, a denied one with EPERM from the devices cgroup.
TEST_F(ProcessLauncherTest, OnlyTheGrantedGpuDeviceNodes) {
  if (SkipWithoutCgroups()) GTEST_SKIP() << "needs a writable cgroup tree";
  for (int i = 0; i < 3; ++i) {
    const std::string node = scratch_.path() + "/nvidia" + std::to_string(i);
    if (mknod(node.c_str(), S_IFCHR | 0666, makedev(195, i)) != 0) {
      GTEST_SKIP() << "cannot mknod " << node << ": " << strerror(errno);
    }
  }
  const std::string script = "for i in 0 1 2; do cat " + scratch_.path() + "/nvidia$i 2>&1 | grep -o 'No such device or address\\|Operation not permitted'; done";
  ContainerSpec spec = Spec("gpus", script);
  spec.allocation = TwoGpus("alice");
  std::string logs;
  Run(spec, &logs);
  EXPECT_EQ(logs, "No such device or address\nNo such device or address\nOperation not permitted\n");
  // No allocation: GPUs are not managed.
  Run(Spec("any", script), &logs);
  EXPECT_EQ(logs, "No such device or address\nNo such device or address\nNo such device or address\n");
}

TEST_F(ProcessLauncherTest, StopKillsWhatLeftTheProcessGroup) {
  if (SkipWithoutCgroups()) GTEST_SKIP() << "needs a writable cgroup tree";
  const std::string token = test::UniqueToken();
  ASSERT_OK_AND_ASSIGN(auto h, launcher_->Start(Spec("escape", "setsid sleep " + token + " & wait")));
  ASSERT_TRUE(test::WaitUntil([&] { return test::ProcessesWithArg(token).size() >= 2; }, 30s));
  ASSERT_THAT(h->Stop(200ms), IsOk());
  EXPECT_TRUE(WaitFor([&] { return test::ProcessesWithArg(token).empty(); }, kWait,
                      "the setsid sleep to end"));
}

// A process outside any cgroup is found by the launcher id in its
// environment.
TEST_F(ProcessLauncherTest, CleanupFindsProcessesByTheirEnvironment) {
  const std::string id = "envsweep" + test::UniqueToken();
  const std::string token = test::UniqueToken();
  ASSERT_EQ(std::system((std::string(kLauncherIdEnv) + "=" + id + " sleep " + token + " &").c_str()), 0);
  // The sleep itself, once exec'd (before, the shell's fork has no such env).
  ASSERT_TRUE(test::WaitUntil([&] { return ProcessesWithEnv(kLauncherIdEnv, id).size() == 1; }, kWait));
  ASSERT_OK_AND_ASSIGN(int swept, launcher_->Cleanup(id));
  EXPECT_EQ(swept, 1);
  EXPECT_TRUE(test::WaitUntil([&] { return test::ProcessesWithArg(token).empty(); }, kWait));
}

TEST_F(ProcessLauncherTest, BackoffDoublesPerRestart) {
  ContainerSpec spec = Spec("backoff", "exit 1");
  ASSERT_OK_AND_ASSIGN(spec.restart, RestartPolicy::Parse("on-failure:3"));
  spec.restart.backoff = 100ms;
  const auto start = std::chrono::steady_clock::now();
  ExitStatus e = Run(spec);
  EXPECT_EQ(e.restarts, 3);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 100ms + 200ms + 400ms);
}

// Each restart is told as it is decided, before the next run starts.
TEST_F(ProcessLauncherTest, RestartIsToldBeforeTheNextRun) {
  const std::string marker = scratch_.path() + "/ran";
  ContainerSpec spec = Spec("once", "if [ -e " + marker + " ]; then exit 0; fi; touch " +
                                        marker + "; kill -KILL $$");
  ASSERT_OK_AND_ASSIGN(spec.restart, RestartPolicy::Parse("on-failure"));
  spec.restart.backoff = 1000ms;
  std::vector<std::string> told;
  std::vector<bool> next_run_started;
  spec.on_restart = [&](const RestartEvent& event) {
    told.push_back(event.ToString());
    next_run_started.push_back(launcher_->Get("once").value()->Status().restarts > 0);
  };
  ASSERT_OK_AND_ASSIGN(auto h, launcher_->Start(spec));
  ASSERT_OK_AND_ASSIGN(ExitStatus e, h->Wait(kWait));
  EXPECT_EQ(e.ToString(), "exited(0) after 1 restart");
  EXPECT_THAT(told, ::testing::ElementsAre("signaled(SIGKILL); restarting (1) in 1.0s"));
  EXPECT_THAT(next_run_started, ::testing::ElementsAre(false));
}

// A state_dir used again: a container's logs are its own, not those of the
// one of that name before.
TEST_F(ProcessLauncherTest, LogsStartEmptyInAReusedStateDir) {
  LauncherOptions options;
  options.state_dir = scratch_.path() + "/state";
  Make(options);
  std::string logs;
  ASSERT_TRUE(Run(Spec("w0", "echo first"), &logs).ok());
  EXPECT_EQ(logs, "first\n");
  // What a launcher that ended without Remove leaves behind.
  ASSERT_OK_AND_ASSIGN(auto h, launcher_->Start(Spec("w1", "echo first")));
  ASSERT_THAT(h->Wait(kWait), IsOk());
  Make(options);
  ASSERT_TRUE(Run(Spec("w1", "echo second"), &logs).ok());
  EXPECT_EQ(logs, "second\n");
}

// A launcher's state_dir holds the records it adopts or sweeps at start:
// one that others could write in (or that another user owns) could hold
// records of theirs that it would trust. It is refused before anything in
// it is read or written, naming it.
TEST_F(ProcessLauncherTest, AStateDirOthersCouldWriteIsRefused) {
  LauncherOptions options = Fast();
  options.backend = "process";
  options.state_dir = scratch_.path() + "/state";
  ASSERT_EQ(mkdir(options.state_dir.c_str(), 0700), 0);
  for (mode_t mode : {0770, 0707, 0777}) {
    ASSERT_EQ(chmod(options.state_dir.c_str(), mode), 0);
    EXPECT_THAT(Launcher::Create(options).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr(absl::StrFormat("launcher state_dir \"%s\" may be written by "
                                                   "others (mode %04o)",
                                                   options.state_dir, mode))));
    EXPECT_TRUE(std::filesystem::is_empty(options.state_dir));
  }
  ASSERT_EQ(chmod(options.state_dir.c_str(), 0755), 0);
  Make(options);
  EXPECT_TRUE(Run(Spec("ok", "exit 0")).ok());
  launcher_.reset();
  if (geteuid() != 0) GTEST_SKIP() << "giving a directory to another user needs root";
  options.state_dir = scratch_.path() + "/theirs";
  ASSERT_EQ(mkdir(options.state_dir.c_str(), 0700), 0);
  ASSERT_EQ(chown(options.state_dir.c_str(), 65534, 65534), 0);
  EXPECT_THAT(Launcher::Create(options).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("launcher state_dir \"" + options.state_dir +
                                 "\" belongs to uid 65534, not to this user")));
  EXPECT_TRUE(std::filesystem::is_empty(options.state_dir));
}

// A container its launcher could not record never runs: the record is how
// central's sweep finds it after a crash, and one that ran unrecorded held
// its GPUs, unswept, while they were granted again.
class LauncherFullDisk : public ::deepnex::test::FullDiskTest {};

TEST_F(LauncherFullDisk, AContainerThatCannotBeRecordedDoesNotStart) {
  LauncherOptions options;
  options.backend = "process";
  options.state_dir = mnt_ + "/state";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Launcher> launcher, Launcher::Create(options));
  ContainerSpec spec;
  spec.name = "w0";
  spec.command = {"sleep", "600"};
  Fill();
  EXPECT_THAT(launcher->Start(spec),
              StatusIs(absl::StatusCode::kInternal,
                       ::testing::AllOf(HasSubstr("record.json"),
                                        HasSubstr("No space left on device"))));
  EXPECT_THAT(launcher->List(), IsEmpty());
  auto swept = launcher->Cleanup(launcher->id());
  ASSERT_THAT(swept, IsOk());
  EXPECT_EQ(*swept, 0);  // nothing ran
  EXPECT_FALSE(std::filesystem::exists(options.state_dir + "/containers/w0"));
  Free();
  ASSERT_OK_AND_ASSIGN(auto h, launcher->Start(spec));
  EXPECT_TRUE(std::filesystem::exists(options.state_dir + "/containers/w0/record.json"));
  EXPECT_THAT(h->Stop(1s), IsOk());
}

// The spec asks for 1 ms; the launcher's default floor (1 s, doubling) holds:
// restarts at about 1 s and 3 s, so at most 2 in 3 s.
TEST_F(ProcessLauncherTest, CrashLoopBackoffHasAFloorWhateverTheSpecAsks) {
  Make(LauncherOptions{});
  ContainerSpec spec = Spec("storm", "exit 1");
  ASSERT_OK_AND_ASSIGN(spec.restart, RestartPolicy::Parse("always"));
  spec.restart.backoff = 1ms;
  spec.restart.max_backoff = 1ms;
  std::mutex mu;
  std::vector<int64_t> delays;
  spec.on_restart = [&](const RestartEvent& event) {
    std::lock_guard<std::mutex> lock(mu);
    delays.push_back(event.delay.count());
  };
  ASSERT_OK_AND_ASSIGN(auto h, launcher_->Start(spec));
  std::this_thread::sleep_for(3s);  // the window the storm is measured in
  const int restarts = h->Status().restarts;
  ASSERT_THAT(h->Stop(1s), IsOk());
  EXPECT_GE(restarts, 1);
  EXPECT_LE(restarts, 2);
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_GE(delays.size(), 2u);
  EXPECT_EQ(delays[0], 1000);
  EXPECT_EQ(delays[1], 2000);
}

// Doubling from the floor to the cap; a run that lasted `reset` starts it
// over; a policy asking for more than the floor gets what it asks.
TEST_F(ProcessLauncherTest, CrashLoopBackoffDoublesToTheCapAndResetsAfterAHealthyRun) {
  LauncherOptions options;
  options.restart_backoff_floor = 10ms;
  options.restart_backoff_cap = 40ms;
  // A run that fails at once took over 0.4 s on a loaded machine (a helper's
  // run saw the doubling start over): the healthy run is 2.5 s, the reset 1.5 s.
  options.restart_backoff_reset = 1500ms;
  Make(options);
  const std::string count = scratch_.path() + "/count";
  // Runs 1-5 and 7 fail at once, run 6 after 2.5 s, run 8 succeeds.
  ContainerSpec spec = Spec("loop", "n=$(cat " + count + " 2>/dev/null || echo 0); n=$((n+1)); " +
                                        "echo $n > " + count + "; " +
                                        "if [ $n -eq 6 ]; then sleep 2.5; fi; " +
                                        "if [ $n -ge 8 ]; then exit 0; fi; exit 1");
  ASSERT_OK_AND_ASSIGN(spec.restart, RestartPolicy::Parse("on-failure"));
  spec.restart.backoff = 1ms;
  spec.restart.max_backoff = 2ms;
  std::vector<int64_t> delays;
  spec.on_restart = [&](const RestartEvent& event) { delays.push_back(event.delay.count()); };
  ExitStatus e = Run(spec);
  EXPECT_EQ(e.ToString(), "exited(0) after 7 restarts");
  EXPECT_THAT(delays, ::testing::ElementsAre(10, 20, 40, 40, 40, 10, 20));

  delays.clear();
  std::remove(count.c_str());
  spec.name = "longer";
  spec.restart.backoff = 30ms;
  spec.restart.max_backoff = 100ms;
  e = Run(spec);
  EXPECT_EQ(e.ToString(), "exited(0) after 7 restarts");
  EXPECT_THAT(delays, ::testing::ElementsAre(30, 60, 100, 100, 100, 30, 60));
}

// On-disk bytes of the regular files under `dir` but its record.
uint64_t LogBytesOnDisk(const std::string& dir) {
  uint64_t total = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    struct stat st;
    if (!entry.is_regular_file() || entry.path().filename() == "record.json" ||
        stat(entry.path().c_str(), &st) != 0) {
      continue;
    }
    total += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

// 8 MiB written under a 64 KiB limit: at most 2 x 64 KiB on disk (the log
// and one rotated file; the run's own output file is freed as it is read),
// while it still runs; the newest output is kept and reads go by offset.
TEST_F(ProcessLauncherTest, LogsAreBoundedAndKeepTheNewestOutput) {
  constexpr uint64_t kLimit = 64 << 10;
  constexpr uint64_t kWritten = (8 << 20) + 5;  // the x's, "\nEND\n"
  LauncherOptions options = Fast();
  options.state_dir = scratch_.path() + "/state";
  options.log_max_bytes = 1 << 20;
  Make(options);
  ContainerSpec spec = Spec("big", "head -c 8388608 /dev/zero | tr '\\0' x; echo; echo END; "
                                   "exec sleep 1000");
  spec.log_max_bytes = kLimit;
  ASSERT_OK_AND_ASSIGN(auto h, launcher_->Start(spec));
  ASSERT_TRUE(test::WaitUntil(
      [&] { return h->ReadLogs(kWritten, 1).value_or(LogChunk{}).next_offset == kWritten; },
      kWait));
  // 4 KiB: the part of the last block that the run's output file keeps.
  EXPECT_LE(LogBytesOnDisk(options.state_dir + "/containers/big"), 2 * kLimit + 4096);
  ASSERT_OK_AND_ASSIGN(std::string logs, h->Logs());
  EXPECT_LE(logs.size(), 2 * kLimit);
  EXPECT_GE(logs.size(), kLimit);
  EXPECT_EQ(logs.substr(logs.size() - 6), "x\nEND\n");
  EXPECT_EQ(logs.find_first_not_of('x'), logs.size() - 5);
  // From 0: what is kept begins where the rotated file does.
  ASSERT_OK_AND_ASSIGN(LogChunk first, h->ReadLogs(0, 100));
  EXPECT_EQ(first.data, std::string(100, 'x'));
  EXPECT_EQ(first.next_offset, kWritten - logs.size() + 100);
  EXPECT_FALSE(first.ended);
  ASSERT_OK_AND_ASSIGN(LogChunk tail, h->ReadLogs(kWritten - 4, 1 << 20));
  EXPECT_EQ(tail.data, "END\n");
  EXPECT_EQ(tail.next_offset, kWritten);
  EXPECT_FALSE(tail.ended);
  ASSERT_THAT(h->Stop(1s), IsOk());
  ASSERT_OK_AND_ASSIGN(LogChunk after, h->ReadLogs(kWritten + 100, 1 << 20));
  EXPECT_EQ(after.data, "");
  EXPECT_EQ(after.next_offset, kWritten);
  EXPECT_TRUE(after.ended);
  // A follower behind the rotation (a slow reader of deepnex run) is told
  // what it missed; it was silently skipped.
  std::string followed;
  ASSERT_THAT(h->FollowLogs([&](const std::string& data) {
    followed += data;
    return !absl::EndsWith(followed, "END\n");
  }),
              IsOk());
  EXPECT_EQ(followed, absl::StrCat("deepnex: ", kWritten - logs.size(),
                                   " bytes of this container's output were dropped before they "
                                   "were read (its log keeps the newest)\n",
                                   logs));
}

TEST_F(ProcessLauncherTest, OnFailureDoesNotRestartSuccess) {
  ContainerSpec spec = Spec("fine", "exit 0");
  ASSERT_OK_AND_ASSIGN(spec.restart, RestartPolicy::Parse("on-failure:3"));
  ExitStatus e = Run(spec);
  EXPECT_TRUE(e.ok());
  EXPECT_EQ(e.restarts, 0);
}

TEST_F(ProcessLauncherTest, FollowLogsSeesEverythingAcrossRestarts) {
  ContainerSpec spec = Spec("talk", "echo a; sleep 0.2; echo b; exit 1");
  ASSERT_OK_AND_ASSIGN(spec.restart, RestartPolicy::Parse("on-failure:1"));
  spec.restart.backoff = 10ms;
  ASSERT_OK_AND_ASSIGN(auto h, launcher_->Start(spec));
  std::string seen;
  ASSERT_THAT(h->FollowLogs([&](const std::string& s) {
    seen += s;
    return true;
  }),
              IsOk());
  EXPECT_EQ(seen, "a\nb\na\nb\n");
}

TEST_F(ProcessLauncherTest, RecordForPs) {
  LauncherOptions options;
  options.state_dir = scratch_.path() + "/state";
  Make(options);
  ContainerSpec spec = Spec("rec", "sleep 1000");
  spec.allocation = TwoGpus("alice");
  ASSERT_OK_AND_ASSIGN(auto h, launcher_->Start(spec));
  auto read = [&] {
    std::ifstream in(options.state_dir + "/containers/rec/record.json");
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  std::string record = read();
  EXPECT_THAT(record, HasSubstr("\"state\": \"running\""));
  EXPECT_THAT(record, HasSubstr("\"cgroup\": \"deepnex/" + launcher_->id() + "-rec-0\""));
  // The pid's kernel start time, so that a re-attach tells it from a reuse.
  const std::optional<uint64_t> start = ProcessStartTime(std::stoi(h->Status().id));
  ASSERT_TRUE(start.has_value());
  EXPECT_THAT(record, HasSubstr(absl::StrCat("\"start_time\": ", *start, ",")));
  ASSERT_THAT(h->Stop(1s), IsOk());
  // Ended: its pid may be another process's by now.
  EXPECT_THAT(read(), Not(HasSubstr("start_time")));
  ASSERT_THAT(launcher_->Remove("rec"), IsOk());
  struct stat st;
  EXPECT_NE(stat((options.state_dir + "/containers/rec").c_str(), &st), 0);
}

TEST_F(ProcessLauncherTest, TempStateDirGoesWithTheLauncher) {
  ContainerSpec spec = Spec("t", "exit 0");
  ASSERT_OK_AND_ASSIGN(auto h, launcher_->Start(spec));
  ASSERT_THAT(h->Wait(kWait), IsOk());
  launcher_.reset();
  EXPECT_THAT(h->Logs(), IsOk());  // the handle outlives its launcher
  EXPECT_EQ(h->Status().state, State::kExited);
}

// The child of the crash test: a launcher that starts a container and is
// killed.
void StartAndDie(const std::string& id, const std::string& state_dir, const std::string& token) {
  LauncherOptions options;
  options.id = id;
  options.state_dir = state_dir;
  auto launcher = Launcher::Create(options);
  if (!launcher.ok()) _exit(1);
  ContainerSpec spec;
  spec.name = "orphan";
  spec.command = {"sh", "-c", "sleep " + token + " & wait"};
  if (!(*launcher)->Start(spec).ok()) _exit(2);
  test::WaitUntil([&] { return test::ProcessesWithArg(token).size() >= 2; }, 30s);
  raise(SIGKILL);
}

// A launcher killed with SIGKILL leaves a running container: Cleanup(its id)
// from another launcher sweeps the process and its cgroup.
TEST(LauncherCrash, CleanupSweepsAKilledLaunchersOrphans) {
  const std::string id = "crash" + test::UniqueToken();
  const std::string token = test::UniqueToken();
  ::deepnex::test::TempDir scratch;
  EXPECT_EXIT(StartAndDie(id, scratch.path(), token), ::testing::KilledBySignal(SIGKILL), "");
  ASSERT_EQ(test::ProcessesWithArg(token).size(), 2u);  // sh -c "sleep <token> & wait", sleep
  const bool cgroups = Cgroup::Usable().ok();
  if (cgroups) ASSERT_THAT(CgroupsOf(id), Not(IsEmpty()));
  ASSERT_OK_AND_ASSIGN(auto launcher, Launcher::Create({}));
  ASSERT_OK_AND_ASSIGN(int swept, launcher->Cleanup(id));
  EXPECT_GE(swept, 1);
  EXPECT_TRUE(test::WaitUntil([&] { return test::ProcessesWithArg(token).empty(); }, kWait));
  EXPECT_THAT(CgroupsOf(id), IsEmpty());
  EXPECT_THAT(ProcessesWithEnv(kLauncherIdEnv, id), IsEmpty());
  EXPECT_THAT(launcher->Cleanup("../x"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(CgroupTest, LifeCycle) {
  absl::Status usable = Cgroup::Usable();
  if (!usable.ok()) GTEST_SKIP() << usable;
  const std::string path = "deepnex/cgtest-" + test::UniqueToken();
  EXPECT_THAT(Cgroup::Open(path), StatusIs(absl::StatusCode::kNotFound, HasSubstr(path)));
  ASSERT_OK_AND_ASSIGN(auto cg, Cgroup::Create(path, {0.5, 32 << 20, 10, std::nullopt}));
  EXPECT_EQ(cg->path(), path);
  EXPECT_THAT(Cgroup::Open(path), IsOk());
  const std::string name = path.substr(path.find('/') + 1);
  EXPECT_THAT(Cgroup::Children("deepnex"), ::testing::Contains(name));
  int moved[2];
  ASSERT_EQ(pipe(moved), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Waits until it was moved (a byte on the pipe), then forks a grandchild
    // inside the cgroup: both must die.
    close(moved[1]);
    char byte;
    if (read(moved[0], &byte, 1) != 1) _exit(1);
    if (fork() == 0) pause();
    pause();
    _exit(0);
  }
  close(moved[0]);
  ASSERT_THAT(cg->AddProcess(pid), IsOk());
  ASSERT_EQ(write(moved[1], "m", 1), 1);
  close(moved[1]);
  ASSERT_TRUE(test::WaitUntil([&] { return cg->Processes().size() == 2; }, 10s));
  Usage u = cg->ReadUsage();
  EXPECT_EQ(u.pids, 2);
  EXPECT_FALSE(cg->OomKilled());
  ASSERT_THAT(cg->KillAll(), IsOk());
  EXPECT_THAT(cg->Processes(), IsEmpty());
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  ASSERT_THAT(cg->Remove(), IsOk());
  EXPECT_THAT(cg->Remove(), IsOk());  // idempotent
  EXPECT_THAT(Cgroup::Open(path), StatusIs(absl::StatusCode::kNotFound));
}

TEST(RestartPolicyTest, ParseAndToString) {
  for (const char* text : {"never", "on-failure", "on-failure:0", "on-failure:3", "always", "always:2"}) {
    ASSERT_OK_AND_ASSIGN(RestartPolicy p, RestartPolicy::Parse(text));
    EXPECT_EQ(p.ToString(), text);
  }
  ASSERT_OK_AND_ASSIGN(RestartPolicy p, RestartPolicy::Parse("on-failure:3"));
  EXPECT_EQ(p.kind, RestartPolicy::Kind::kOnFailure);
  EXPECT_EQ(p.max_restarts, 3);
  ASSERT_OK_AND_ASSIGN(p, RestartPolicy::Parse("on-failure"));
  EXPECT_EQ(p.max_restarts, -1);
  for (const char* bad : {"", "sometimes", "on-failure:", "on-failure:-1", "on-failure:x",
                          "never:1", "always:+2"}) {
    EXPECT_THAT(RestartPolicy::Parse(bad),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("restart: \"" + std::string(bad) + "\" is not a restart policy")));
  }
}

TEST(RestartEventTest, ToStringSpellsTheExitAsExitStatusDoes) {
  using std::chrono::milliseconds;
  RestartEvent exited{"w1", ExitStatus{ExitReason::kExited, 1}, 1, 2, milliseconds(1000)};
  EXPECT_EQ(exited.ToString(), "exited(1); restarting (1/2) in 1.0s");
  RestartEvent killed{"w1", ExitStatus{ExitReason::kSignaled, 0, SIGKILL}, 1, 3,
                      milliseconds(1000)};
  EXPECT_EQ(killed.ToString(), "signaled(SIGKILL); restarting (1/3) in 1.0s");
  // The exit of one run: what came before is the restart's number.
  killed.exit.restarts = 2;
  killed.restart = 3;
  killed.delay = milliseconds(400);
  EXPECT_EQ(killed.ToString(), "signaled(SIGKILL); restarting (3/3) in 0.4s");
  RestartEvent oom{"w1", ExitStatus{ExitReason::kOomKilled, 0, SIGKILL}, 4, -1,
                   milliseconds(10000)};
  EXPECT_EQ(oom.ToString(), "oom_killed; restarting (4) in 10.0s");
  RestartEvent lost{"w1", ExitStatus{ExitReason::kLost}, 2, 5, milliseconds(200)};
  EXPECT_EQ(lost.ToString(), "lost; restarting (2/5) in 0.2s");
  EXPECT_EQ((ExitStatus{ExitReason::kSignaled, 0, SIGKILL, 1}).ToString(),
            "signaled(SIGKILL) after 1 restart");
  EXPECT_EQ((ExitStatus{ExitReason::kLost}).ToString(), "lost");
}

TEST(LauncherCreateTest, BadNamedImages) {
  for (const auto& [name, dir] : std::vector<std::pair<std::string, std::string>>{
           {"", "host"}, {"/abs", "host"}, {"base", "relative/dir"}}) {
    LauncherOptions options;
    options.images = {{name, dir}};
    EXPECT_THAT(Launcher::Create(options),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("images: \"" + name + "\" -> \"" + dir + "\" is not a name")));
  }
}

TEST(LauncherCreateTest, BadBackoffAndLogLimits) {
  LauncherOptions options;
  options.restart_backoff_floor = 2s;
  options.restart_backoff_cap = 1s;
  EXPECT_THAT(Launcher::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("restart_backoff: floor 2000 ms, cap 1000 ms, reset 600000 ms "
                                 "is not a backoff")));
  options = LauncherOptions{};
  options.restart_backoff_reset = 0ms;
  EXPECT_THAT(Launcher::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("reset 0 ms")));
  options = LauncherOptions{};
  options.log_max_bytes = 0;
  EXPECT_THAT(Launcher::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("log_max_bytes: 0")));
  options = LauncherOptions{};
  options.log_max_bytes = 1 << 20;
  ASSERT_OK_AND_ASSIGN(auto launcher, Launcher::Create(options));
  ContainerSpec spec;
  spec.name = "w";
  spec.command = {"true"};
  spec.log_max_bytes = (1 << 20) + 1;
  EXPECT_THAT(launcher->Start(spec),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("spec.log_max_bytes: 1048577 bytes is more than the launcher's "
                                 "limit 1MiB")));
}

TEST(LauncherCreateTest, UnknownBackendNamesTheKnownOnes) {
  LauncherOptions options;
  options.backend = "lxc";
  EXPECT_THAT(Launcher::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("backend: \"lxc\" is not one of process, oci, docker, slurm, "
                                 "kubernetes")));
  options.backend = "process";
  options.id = "bad id";
  EXPECT_THAT(Launcher::Create(options), StatusIs(absl::StatusCode::kInvalidArgument,
                                                  HasSubstr("id: \"bad id\"")));
  options.id = "";
  options.cgroup_parent = "../up";
  EXPECT_THAT(Launcher::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cgroup_parent")));
  EXPECT_EQ(ProbeBackends({})["process"], "");
}

TEST(LaunchUtilTest, FindOnPathAndExitStatus) {
  EXPECT_THAT(FindOnPath("sh", "/nonexistent:/bin"), IsOk());
  EXPECT_THAT(FindOnPath("nope", "/a:/b"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("command \"nope\" not found on PATH=/a:/b")));
  ExitStatus e = ExitStatusFromWait(0x0300);  // exit(3)
  EXPECT_EQ(e.ToString(), "exited(3)");
  e = ExitStatusFromWait(SIGKILL);
  EXPECT_EQ(e.ToString(), "signaled(SIGKILL)");
  EXPECT_EQ(RunName("l1", "w0", 2), "l1-w0-2");
}

// The image's directory is replaced where it stands whole only: a re-probe
// got 'command "rootimg:v1tmprootimg:v1..."' for an image at "/", and a
// preset at /img/a named the user's own /img/a/x "base/x".
TEST(LaunchUtilTest, AsNamedReplacesWholeNamesOnly) {
  auto named = [](const std::string& message, const std::string& given, const std::string& as) {
    return std::string(AsNamed(absl::NotFoundError(message), {{given, as}}).message());
  };
  EXPECT_EQ(named("command \"/tmp/a/nosuch\" not found in image /", "/", "root:v1"),
            "command \"/tmp/a/nosuch\" not found in image root:v1");
  EXPECT_EQ(named("command \"/img/a/x\" not found in image /img/a on PATH=/bin", "/img/a",
                  "base"),
            "command \"/img/a/x\" not found in image base on PATH=/bin");
  EXPECT_EQ(named("spec.image: \"/img/a\": no", "/img/a", "base"), "spec.image: \"base\": no");
  EXPECT_EQ(named("/img/a/img/a /img/ab /img/a", "/img/a", "b"), "/img/a/img/a /img/ab b");
  EXPECT_EQ(named("container \"alice.w\" gone", "\"alice.w\"", "\"w\""),
            "container \"w\" gone");
  EXPECT_THAT(AsNamed(absl::OkStatus(), {{"/", "x"}}), IsOk());
}

TEST(LaunchUtilTest, ProcUsageOfThisProcess) {
  volatile uint64_t spin = 0;
  for (int i = 0; i < 50000000; ++i) spin = spin + i;
  Usage u = ProcUsage(ProcessGroupMembers(getpgrp()));
  EXPECT_GT(u.cpu_seconds, 0);
  EXPECT_GT(u.memory, 0u);
  EXPECT_GE(u.memory_peak, u.memory);
  EXPECT_GE(u.pids, 1);
  EXPECT_EQ(ProcUsage({}).pids, 0);
}

}  // namespace
}  // namespace deepnex::launch
