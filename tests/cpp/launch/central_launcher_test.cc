// The "central" launch backend against an in-process deepnex-central (its
// own process launcher, a declared node without an agent): a container
// starts on its allocation through central, its exit, restarts and log come
// back through the Handle, and bad options and specs are refused.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "deepnex/launch/central.h"
#include "deepnex/launch/launcher.h"
#include "gmock/gmock.h"
#include "gpu/gpu_test_util.h"
#include "gtest/gtest.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::launch {
namespace {

using ::deepnex::gpu::Allocation;
using ::deepnex::gpu::test::Exclusive;
using ::deepnex::gpu::test::MakeNode;
using ::deepnex::test::StatusIs;
using ::testing::HasSubstr;
using namespace std::chrono_literals;  // NOLINT

constexpr uint64_t kGrantMemory = 256 << 20;

class CentralBackend : public ::deepnex::test::CentralFixture {
 protected:
  void SetUp() override {
    LauncherOptions l;
    l.backend = "process";
    l.state_dir = dir_.path() + "/launch";
    ContainerPolicy policy;
    policy.users = {{"alice", geteuid() == 0 ? RunAs{65534, 65534}
                                             : RunAs{geteuid(), getegid()}}};
    ASSERT_EQ(chmod(dir_.path().c_str(), 0711), 0);
    ASSERT_OK_AND_ASSIGN(server_, CreateCentralServer(ServerOptions(), l, policy));
    ASSERT_OK(Client("admintok")->AddNode(MakeNode("x1", 2)));
    alice_ = Client("alicetok");
  }

  absl::StatusOr<std::unique_ptr<Launcher>> Central() {
    LauncherOptions o;
    o.backend = "central";
    o.central.address = server_->address();
    o.central.token = "alicetok";
    return Launcher::Create(o);
  }

  std::unique_ptr<gpu::CentralClient> alice_;
};

TEST_F(CentralBackend, RunsOnTheAllocationAndTellsExitRestartsAndLog) {
  ASSERT_OK_AND_ASSIGN(auto launcher, Central());
  EXPECT_EQ(launcher->backend(), "central");
  // x1 has no agent: central places nothing of its own beyond its machine.
  ASSERT_OK_AND_ASSIGN(std::vector<gpu::Node> nodes, launcher->Nodes());
  EXPECT_TRUE(nodes.empty());
  ASSERT_OK_AND_ASSIGN(Allocation a, alice_->Allocate(Exclusive("", 1, 1, kGrantMemory)));
  // Writable by the container's user (nobody, as root).
  const std::string shared = dir_.path() + "/shared";
  ASSERT_EQ(mkdir(shared.c_str(), 0777), 0);
  ASSERT_EQ(chmod(shared.c_str(), 0777), 0);
  const std::string mark = shared + "/ran";
  ContainerSpec spec;
  spec.name = "w0";
  spec.command = {"sh", "-c", "echo run; if [ -e " + mark + " ]; then exit 3; fi; touch " +
                                  mark + "; exit 1"};
  spec.allocation = a;
  ASSERT_OK_AND_ASSIGN(spec.restart, RestartPolicy::Parse("on-failure:1"));
  std::vector<std::string> told;
  spec.on_restart = [&](const RestartEvent& e) { told.push_back(e.ToString()); };
  ASSERT_OK_AND_ASSIGN(auto h, launcher->Start(spec));
  ASSERT_OK_AND_ASSIGN(ExitStatus e, h->Wait(60s));
  EXPECT_EQ(e.ToString(), "exited(3) after 1 restart");
  ASSERT_EQ(told.size(), 1u);
  EXPECT_THAT(told[0], HasSubstr("exited(1); restarting (1/1)"));
  EXPECT_EQ(h->Status().state, State::kExited);
  ASSERT_OK_AND_ASSIGN(std::string logs, h->Logs());
  EXPECT_EQ(logs, "run\nrun\n");
  std::string followed;
  ASSERT_OK(h->FollowLogs([&](const std::string& s) {
    followed += s;
    return true;
  }));
  EXPECT_EQ(followed, logs);
  ASSERT_OK(h->Stop(1s));  // ended: nothing to do
  ASSERT_OK_AND_ASSIGN(auto got, launcher->Get("w0"));
  EXPECT_EQ(got, h);
  ASSERT_OK(launcher->Remove("w0"));
  EXPECT_THAT(launcher->Get("w0"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"w0\"")));
}

TEST_F(CentralBackend, StopEndsARunningContainer) {
  ASSERT_OK_AND_ASSIGN(auto launcher, Central());
  ASSERT_OK_AND_ASSIGN(Allocation a, alice_->Allocate(Exclusive("", 0, 1, kGrantMemory)));
  ContainerSpec spec;
  spec.name = "sleeper";
  spec.command = {"sleep", "60"};
  spec.allocation = a;
  ASSERT_OK_AND_ASSIGN(auto h, launcher->Start(spec));
  ASSERT_OK(h->Stop(5s));
  ASSERT_OK_AND_ASSIGN(ExitStatus e, h->Wait(10s));
  EXPECT_EQ(e.ToString(), "signaled(SIGTERM)");
}

TEST_F(CentralBackend, RefusesASpecWithoutAllocationAndBadOptions) {
  ASSERT_OK_AND_ASSIGN(auto launcher, Central());
  ContainerSpec spec;
  spec.name = "w0";
  spec.command = {"true"};
  EXPECT_THAT(launcher->Start(spec),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("spec.allocation: container \"w0\" has none")));
  LauncherOptions o;
  o.backend = "central";
  EXPECT_THAT(Launcher::Create(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("central.address: empty")));
  o.central.address = server_->address();
  o.central.poll = 0ms;
  EXPECT_THAT(Launcher::Create(o), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("central.poll: 0 ms is not > 0")));
}

}  // namespace
}  // namespace deepnex::launch
