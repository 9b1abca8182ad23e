// The docker backend against a real Docker Engine API: podman's service,
// started by tests/launch/podman.sh (the ctest fixture sets
// DEEPNEX_TEST_DOCKER_SOCKET and DEEPNEX_TEST_DOCKER_IMAGE). Each test skips
// with the reason where there is none. The request body for GPUs is checked
// without an engine.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "absl/strings/str_cat.h"
#include "launch/backend.h"
#include "launch/docker.h"
#include "launch/http.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::launch {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;
using json = nlohmann::json;
using namespace std::chrono_literals;

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

// A fresh launcher id per test, so that Cleanup sweeps only its own.
std::string NewLauncherId() {
  static int counter = 0;
  return "dtest" + std::to_string(getpid()) + "x" + std::to_string(++counter);
}

class DockerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    socket_ = Env("DEEPNEX_TEST_DOCKER_SOCKET");
    image_ = Env("DEEPNEX_TEST_DOCKER_IMAGE");
    if (socket_.empty() || image_.empty()) {
      GTEST_SKIP() << "DEEPNEX_TEST_DOCKER_SOCKET/IMAGE unset: no Docker API here "
                      "(tests/launch/podman.sh start DIR provides one)";
    }
    LauncherOptions options;
    options.docker.socket = socket_;
    auto backend = MakeDockerBackend(options);
    if (absl::IsFailedPrecondition(backend.status())) {
      GTEST_SKIP() << backend.status().message();
    }
    ASSERT_THAT(backend, IsOk());
    backend_ = std::move(*backend);
    HttpClientOptions http;
    http.endpoint = "unix:" + socket_;
    auto client = HttpClient::Create(http);
    ASSERT_THAT(client, IsOk());
    http_ = std::move(*client);
    launcher_id_ = NewLauncherId();
  }

  void TearDown() override {
    if (backend_ != nullptr) {
      runs_.clear();
      EXPECT_THAT(backend_->Cleanup(launcher_id_), IsOk());
    }
  }

  ContainerSpec Spec(const std::string& name, std::vector<std::string> command) {
    ContainerSpec spec;
    spec.name = name;
    spec.image = image_;
    spec.command = std::move(command);
    spec.network_none = true;
    return spec;
  }

  RunContext Context(const ContainerSpec& spec) {
    RunContext context;
    context.launcher_id = launcher_id_;
    context.run_name = launcher_id_ + "-" + spec.name + "-0";
    context.dir = ::testing::TempDir();
    context.labels = spec.labels;
    context.labels["deepnex.launcher"] = launcher_id_;
    context.labels["deepnex.name"] = spec.name;
    return context;
  }

  // Starts `spec`; the run is kept for TearDown's Cleanup to sweep.
  launch::Run* Start(const ContainerSpec& spec) {
    auto run = backend_->Start(spec, Context(spec));
    EXPECT_THAT(run, IsOk());
    if (!run.ok()) return nullptr;
    runs_.push_back(std::move(*run));
    return runs_.back().get();
  }

  // Starts `spec` (*run), waits for it to exit 0 and returns its logs.
  std::string RunToSuccess(const ContainerSpec& spec, launch::Run** run) {
    *run = Start(spec);
    if (*run == nullptr) return "";
    ExitStatus exit = WaitFor(*run);
    EXPECT_TRUE(exit.ok()) << exit.ToString();
    auto logs = (*run)->Logs();
    EXPECT_THAT(logs, IsOk());
    return logs.ok() ? *logs : "";
  }

  ExitStatus WaitFor(launch::Run* run) {
    auto exit = run->Wait(30s);
    EXPECT_THAT(exit, IsOk());
    if (!exit.ok() || !exit->has_value()) {
      ADD_FAILURE() << "container " << run->id() << " still running after 30 s";
      return ExitStatus{ExitReason::kLost};
    }
    return **exit;
  }

  // The engine's own view of a container (GET /containers/{id}/json).
  json Inspect(const std::string& id) {
    auto body = http_->Call("GET", "/v1.41/containers/" + id + "/json");
    EXPECT_THAT(body, IsOk());
    return body.ok() ? json::parse(*body) : json();
  }

  // The ids of the containers labelled with this test's launcher id.
  std::vector<std::string> Labelled() {
    json filters = {{"label", json::array({"deepnex.launcher=" + launcher_id_})}};
    auto body = http_->Call("GET", "/v1.41/containers/json?all=1&filters=" +
                                       UrlEncode(filters.dump()));
    EXPECT_THAT(body, IsOk());
    std::vector<std::string> ids;
    if (body.ok()) {
      for (const json& c : json::parse(*body)) ids.push_back(c["Id"].get<std::string>());
    }
    return ids;
  }

  std::string socket_;
  std::string image_;
  std::string launcher_id_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<HttpClient> http_;
  std::vector<std::unique_ptr<launch::Run>> runs_;
};

TEST_F(DockerTest, EnvExitCodeAndLogs) {
  ContainerSpec spec = Spec("env", {"sh", "-c", "echo A=$A; echo oops >&2; exit 3"});
  spec.env["A"] = "a b$c";
  spec.working_dir = "/tmp";
  launch::Run* run = Start(spec);
  ASSERT_NE(run, nullptr);
  ExitStatus exit = WaitFor(run);
  EXPECT_EQ(exit.reason, ExitReason::kExited);
  EXPECT_EQ(exit.code, 3);
  auto logs = run->Logs();
  ASSERT_THAT(logs, IsOk());
  // Demultiplexed: no 8-byte frame headers, both streams.
  EXPECT_THAT(*logs, HasSubstr("A=a b$c\n"));
  EXPECT_THAT(*logs, HasSubstr("oops\n"));
  EXPECT_EQ(logs->size(), std::string("A=a b$c\noops\n").size());
}

TEST_F(DockerTest, LimitsLabelsAndMountsReachTheEngine) {
  ::deepnex::test::TempDir scratch;
  const std::string& dir = scratch.path();
  ASSERT_FALSE(dir.empty());
  std::ofstream(dir + "/in") << "from the host\n";
  ContainerSpec spec =
      Spec("limits", {"sh", "-c", "cat /data/in; echo x > /data/out || echo read-only; pwd"});
  spec.memory = 64 << 20;
  spec.cpus = 0.5;
  spec.pids_limit = 32;
  spec.working_dir = "/data";
  spec.labels["team"] = "vision";
  spec.mounts.push_back({dir, "/data", true});
  launch::Run* run = nullptr;
  const std::string logs = RunToSuccess(spec, &run);
  ASSERT_NE(run, nullptr);
  EXPECT_THAT(logs, HasSubstr("from the host\n"));
  EXPECT_THAT(logs, HasSubstr("read-only\n"));
  EXPECT_THAT(logs, HasSubstr("/data\n"));
  struct stat st;
  EXPECT_NE(stat((dir + "/out").c_str(), &st), 0) << "the read-only mount was written";

  json info = Inspect(run->id());
  const json& host = info["HostConfig"];
  EXPECT_EQ(host["Memory"].get<int64_t>(), 64 << 20);
  EXPECT_EQ(host["NanoCpus"].get<int64_t>(), 500000000);
  EXPECT_EQ(host["PidsLimit"].get<int64_t>(), 32);
  EXPECT_EQ(host["NetworkMode"].get<std::string>(), "none");
  EXPECT_TRUE(host["ReadonlyRootfs"].get<bool>());
  EXPECT_EQ(info["Config"]["Labels"]["deepnex.launcher"].get<std::string>(), launcher_id_);
  EXPECT_EQ(info["Config"]["Labels"]["deepnex.name"].get<std::string>(), "limits");
  EXPECT_EQ(info["Config"]["Labels"]["team"].get<std::string>(), "vision");
  EXPECT_THAT(run->Remove(), IsOk());
}

// A container has only its own loopback, as under oci: on the engine's
// bridge it would reach every other user's containers.
TEST_F(DockerTest, AContainersNetworkIsItsOwnLoopbackOnly) {
  launch::Run* run = nullptr;
  EXPECT_EQ(RunToSuccess(Spec("net", {"ls", "/sys/class/net"}), &run), "lo\n");
  ASSERT_NE(run, nullptr);
  EXPECT_THAT(run->Remove(), IsOk());
}

// A target is a path, whatever it holds: ":U" is no engine option (podman's
// chown of the source to the container's user), and ":ro" no mode.
TEST_F(DockerTest, AMountTargetWithAColonIsAPathNotEngineOptions) {
  ::deepnex::test::TempDir scratch;
  const std::string& dir = scratch.path();
  ASSERT_FALSE(dir.empty());
  std::ofstream(dir + "/in") << "kept\n";
  ASSERT_EQ(chmod(dir.c_str(), 0755), 0);
  ContainerSpec spec = Spec(
      "colon", {"sh", "-c", "cat '/data:U/in'; touch '/data:U/new' 2>/dev/null && echo wrote; true"});
  spec.run_as = RunAs{4242, 4343, "ann", "/home/ann"};
  spec.mounts.push_back({dir, "/data:U", false});
  launch::Run* run = nullptr;
  const std::string logs = RunToSuccess(spec, &run);
  ASSERT_NE(run, nullptr);
  // Root's 0755 directory stayed root's: the user could not write into it.
  EXPECT_EQ(logs.substr(0, 5), "kept\n") << logs;
  EXPECT_THAT(logs, Not(HasSubstr("wrote"))) << "the source was chowned to the container's user";
  struct stat st;
  ASSERT_EQ(stat((dir + "/in").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, geteuid());
  EXPECT_THAT(run->Remove(), IsOk());
}

// deepnex-central's run_as: the engine runs the process as the user's uid
// and gid with no capability and no way to gain one.
TEST_F(DockerTest, RunAsRunsAsTheUidWithNoCapabilities) {
  ContainerSpec spec = Spec("user", {"sh", "-c",
                                     "id -u; id -g; grep -E '^(CapPrm|CapEff|CapBnd|NoNewPrivs)' "
                                     "/proc/self/status"});
  spec.run_as = RunAs{4242, 4343, "ann", "/home/ann"};
  launch::Run* run = nullptr;
  const std::string logs = RunToSuccess(spec, &run);
  ASSERT_NE(run, nullptr);
  EXPECT_EQ(logs,
            "4242\n4343\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\n"
            "CapBnd:\t0000000000000000\nNoNewPrivs:\t1\n");
  json info = Inspect(run->id());
  EXPECT_EQ(info["Config"]["User"].get<std::string>(), "4242:4343");
  // Docker keeps "ALL"; podman lists what it dropped, every capability it
  // would have given (the empty bounding set above is what counts).
  EXPECT_FALSE(info["HostConfig"]["CapDrop"].empty()) << info["HostConfig"];
}

// launcher.h: no run_as is the launcher's own uid and gid with
// ContainerCapabilities, not the image's user with the engine's defaults;
// HOME is the user's (the engine gave "/", read-only, to a uid the image
// does not know).
TEST_F(DockerTest, NoRunAsRunsAsTheLaunchersOwnIdentity) {
  ContainerSpec spec = Spec("own", {"sh", "-c",
                                    "id -u; id -g; echo $HOME; grep -E '^CapBnd' /proc/self/status"});
  launch::Run* run = nullptr;
  const std::string logs = RunToSuccess(spec, &run);
  ASSERT_NE(run, nullptr);
  // Root keeps runc's default set (AUDIT_WRITE, KILL, NET_BIND_SERVICE).
  const std::string caps = geteuid() == 0 ? "0000000020000420" : "0000000000000000";
  EXPECT_EQ(logs, absl::StrCat(geteuid(), "\n", getegid(), "\n",
                               geteuid() == 0 ? "/root" : "/", "\nCapBnd:\t", caps, "\n"));
  EXPECT_EQ(Inspect(run->id())["Config"]["User"].get<std::string>(),
            absl::StrCat(geteuid(), ":", getegid()));

  spec = Spec("home", {"sh", "-c", "echo $HOME"});
  spec.run_as = RunAs{4242, 4343, "ann", "/home/ann"};
  EXPECT_EQ(RunToSuccess(spec, &run), "/home/ann\n");
}

TEST_F(DockerTest, MemoryHogEndsAsTheEngineReportsIt) {
  ContainerSpec spec = Spec("hog", {"sh", "-c", "exec tail /dev/zero"});
  spec.memory = 16 << 20;
  launch::Run* run = Start(spec);
  ASSERT_NE(run, nullptr);
  ExitStatus exit = WaitFor(run);
  // The kernel's OOM killer sends SIGKILL: 128 + 9. Docker says OOMKilled;
  // podman on cgroup v1 does not, and then it stays a plain exit code.
  EXPECT_EQ(exit.code, 137);
  if (Inspect(run->id())["State"]["OOMKilled"].get<bool>()) {
    EXPECT_EQ(exit.reason, ExitReason::kOomKilled);
    EXPECT_EQ(exit.signal, 9);
  } else {
    EXPECT_EQ(exit.reason, ExitReason::kExited);
  }
}

TEST_F(DockerTest, StopSendsTermThenKillAfterGrace) {
  // PID 1 ignores TERM without a handler; this one ignores it outright.
  launch::Run* stubborn = Start(Spec("stubborn", {"sh", "-c", "trap '' TERM; while :; do sleep 0.1; done"}));
  // This one exits 7 on TERM.
  launch::Run* polite = Start(Spec("polite", {"sh", "-c", "trap 'exit 7' TERM; while :; do sleep 0.1; done"}));
  ASSERT_NE(stubborn, nullptr);
  ASSERT_NE(polite, nullptr);
  auto running = stubborn->Wait(300ms);
  ASSERT_THAT(running, IsOk());
  EXPECT_FALSE(running->has_value());

  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_THAT(stubborn->Stop(1500ms), IsOk());
  ASSERT_THAT(polite->Stop(10s), IsOk());
  ExitStatus polite_exit = WaitFor(polite);
  EXPECT_EQ(polite_exit.reason, ExitReason::kExited);
  EXPECT_EQ(polite_exit.code, 7);
  ExitStatus stubborn_exit = WaitFor(stubborn);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(stubborn_exit.reason, ExitReason::kSignaled);
  EXPECT_EQ(stubborn_exit.signal, 9);
  EXPECT_GE(took, 1400ms);
  EXPECT_LT(took, 15s);
  // Idempotent, also once it ended.
  EXPECT_THAT(stubborn->Stop(1s), IsOk());
}

TEST_F(DockerTest, UsageOfARunningContainer) {
  launch::Run* run = Start(Spec("busy", {"sh", "-c", "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; sleep 30"}));
  ASSERT_NE(run, nullptr);
  // The engine's stats lag the container's start: wait for its first CPU time.
  absl::StatusOr<Usage> usage;
  ASSERT_TRUE(::deepnex::test::WaitFor(
      [&] {
        usage = run->Usage();
        return !usage.ok() || usage->cpu_seconds > 0;
      },
      60s, "CPU time in the busy container's stats"));
  ASSERT_THAT(usage, IsOk());
  EXPECT_GT(usage->cpu_seconds, 0);
  EXPECT_GT(usage->memory, 0u);
  EXPECT_GE(usage->memory_peak, usage->memory);
  EXPECT_GE(usage->pids, 1);
  EXPECT_THAT(run->Stop(0ms), IsOk());
  WaitFor(run);
}

TEST_F(DockerTest, RemoveAndCleanupLeaveNoContainer) {
  launch::Run* done = Start(Spec("done", {"true"}));
  ASSERT_NE(done, nullptr);
  WaitFor(done);
  const std::string done_id = done->id();
  EXPECT_THAT(done->Remove(), IsOk());
  EXPECT_THAT(done->Remove(), IsOk());  // idempotent
  EXPECT_THAT(http_->Call("GET", "/v1.41/containers/" + done_id + "/json"),
              StatusIs(absl::StatusCode::kNotFound));

  // What a crashed launcher leaves: one running, one ended.
  ASSERT_NE(Start(Spec("left1", {"sleep", "300"})), nullptr);
  launch::Run* ended = Start(Spec("left2", {"true"}));
  ASSERT_NE(ended, nullptr);
  WaitFor(ended);
  EXPECT_EQ(Labelled().size(), 2u);
  auto swept = backend_->Cleanup(launcher_id_);
  ASSERT_THAT(swept, IsOk());
  EXPECT_EQ(*swept, 2);
  EXPECT_TRUE(Labelled().empty());
  // The runs' waiters see their containers go.
  runs_.clear();
}

TEST_F(DockerTest, MissingImageIsNotFoundNamingIt) {
  ContainerSpec spec = Spec("x", {"true"});
  spec.image = "localhost/no-such-image:1";
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("localhost/no-such-image:1")));
  spec.image = "bad image";
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spec.image")));
  spec.image = image_;
  EXPECT_THAT(backend_->Check(spec), IsOk());
}

TEST_F(DockerTest, MissingCommandIsNotFoundAtStartAndLeavesNothing) {
  ContainerSpec spec = Spec("nocmd", {"no-such-command", "arg"});
  auto run = backend_->Start(spec, Context(spec));
  EXPECT_THAT(run, StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"no-such-command\"")));
  EXPECT_TRUE(Labelled().empty());
}

TEST(DockerBackendTest, MissingSocketIsFailedPreconditionNamingIt) {
  LauncherOptions options;
  options.docker.socket = "/nonexistent/docker.sock";
  EXPECT_THAT(MakeDockerBackend(options),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("/nonexistent/docker.sock")));
}

TEST(DockerBodyTest, TwoGpuAllocationGivesDeviceRequestsAndLimits) {
  ContainerSpec spec;
  spec.name = "w0";
  spec.image = "nvcr.io/nvidia/pytorch:24.01-py3";
  spec.command = {"python3", "train.py"};
  spec.cpus = 2.5;
  spec.memory = 1ull << 30;
  spec.pids_limit = 100;
  spec.mounts.push_back({"/data/set", "/data", true});
  spec.mounts.push_back({"/scratch/w0", "/out", false});
  gpu::Allocation a;
  a.id = "a1";
  a.user = "ann";
  a.gpus = {{2, "GPU-aaaa", 80ull << 30, true}, {3, "GPU-bbbb", 80ull << 30, true}};
  a.env = {{"CUDA_VISIBLE_DEVICES", "2,3"}, {"NVIDIA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb"}};
  spec.allocation = a;
  spec.env = a.env;
  spec.env["DEEPNEX_RANK"] = "0";
  RunContext context;
  context.run_name = "l1-w0-0";
  context.labels = {{"deepnex.launcher", "l1"}, {"deepnex.name", "w0"}};

  json body = json::parse(DockerCreateBody(spec, context));
  EXPECT_EQ(body["HostConfig"]["DeviceRequests"],
            json::parse(R"([{"Driver": "nvidia", "DeviceIDs": ["GPU-aaaa", "GPU-bbbb"],
                             "Capabilities": [["gpu"]]}])"));
  // Inside the container the two GPUs are 0 and 1.
  const std::string home = geteuid() == 0 ? "/root" : "/";
  EXPECT_EQ(body["Env"], json({"CUDA_VISIBLE_DEVICES=0,1", "DEEPNEX_RANK=0", "HOME=" + home,
                               "NVIDIA_VISIBLE_DEVICES=GPU-aaaa,GPU-bbbb"}));
  EXPECT_EQ(body["Image"], spec.image);
  EXPECT_EQ(body["Cmd"], json::parse(R"(["python3", "train.py"])"));
  EXPECT_EQ(body["Labels"], json::parse(R"({"deepnex.launcher": "l1", "deepnex.name": "w0"})"));
  EXPECT_EQ(body["HostConfig"]["Memory"], 1ull << 30);
  EXPECT_EQ(body["HostConfig"]["MemorySwap"], 1ull << 30);
  EXPECT_EQ(body["HostConfig"]["NanoCpus"], 2500000000ll);
  EXPECT_EQ(body["HostConfig"]["PidsLimit"], 100);
  EXPECT_EQ(body["HostConfig"]["Mounts"], json::parse(R"([
      {"Type": "bind", "Source": "/data/set", "Target": "/data", "ReadOnly": true,
       "BindOptions": {"Propagation": "rprivate"}},
      {"Type": "bind", "Source": "/scratch/w0", "Target": "/out", "ReadOnly": false,
       "BindOptions": {"Propagation": "rprivate"}}])"));
  EXPECT_FALSE(body["HostConfig"].contains("Binds"));
  // Only its own loopback: not the engine's bridge, shared by every user.
  EXPECT_EQ(body["HostConfig"]["NetworkMode"], "none");
  spec.host_network = true;
  EXPECT_EQ(json::parse(DockerCreateBody(spec, context))["HostConfig"]["NetworkMode"], "host");
  spec.host_network = false;

  // No run_as: the launcher's own uid and gid (launcher.h), not the
  // image's user with the engine's default capabilities.
  EXPECT_EQ(body["User"], absl::StrCat(geteuid(), ":", getegid()));
  EXPECT_EQ(body["HostConfig"]["CapDrop"], json::parse(R"(["ALL"])"));
  if (geteuid() == 0) {
    // Root keeps runc's default set, as an oci container's root does.
    EXPECT_EQ(body["HostConfig"]["CapAdd"],
              json::parse(R"(["AUDIT_WRITE", "KILL", "NET_BIND_SERVICE"])"));
  } else {
    EXPECT_FALSE(body["HostConfig"].contains("CapAdd"));
  }
  EXPECT_EQ(body["HostConfig"]["SecurityOpt"], json::parse(R"(["no-new-privileges"])"));

  // Without GPUs: no DeviceRequests, the env as given.
  spec.allocation.reset();
  body = json::parse(DockerCreateBody(spec, context));
  EXPECT_FALSE(body["HostConfig"].contains("DeviceRequests"));
  EXPECT_EQ(body["Env"][0], "CUDA_VISIBLE_DEVICES=2,3");
}

TEST(DockerBodyTest, RunAsGivesTheUserNumericallyAndDropsEveryCapability) {
  ContainerSpec spec;
  spec.name = "w0";
  spec.image = "busybox";
  spec.command = {"id"};
  spec.run_as = RunAs{1001, 1002, "ann", "/home/ann"};
  RunContext context;
  context.run_name = "l1-w0-0";
  json body = json::parse(DockerCreateBody(spec, context));
  EXPECT_EQ(body["User"], "1001:1002");
  EXPECT_EQ(body["HostConfig"]["CapDrop"], json::parse(R"(["ALL"])"));
  EXPECT_FALSE(body["HostConfig"].contains("CapAdd"));
  // HOME is the user's: the engine's "/" is read-only.
  EXPECT_EQ(body["Env"], json::parse(R"(["HOME=/home/ann"])"));
  // No pids_limit in the spec: the default, not the engine's (none).
  EXPECT_EQ(body["HostConfig"]["PidsLimit"], kDefaultPidsLimit);
  EXPECT_EQ(body["HostConfig"]["SecurityOpt"], json::parse(R"(["no-new-privileges"])"));
}

}  // namespace
}  // namespace deepnex::launch
