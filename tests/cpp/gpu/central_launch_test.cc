// deepnex-central's launcher on the process backend: users start, list, stop
// and read the logs of their own containers on their own allocations, and an
// allocation is released when the last container on it ends for good.
#include "deepnex/launch/central.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gpu/gpu_test_util.h"
#include "gtest/gtest.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::launch {
namespace {

using ::deepnex::gpu::Allocation;
using ::deepnex::gpu::CentralClientOptions;
using ::deepnex::gpu::CentralServerOptions;
using ::deepnex::gpu::test::Exclusive;
using ::deepnex::gpu::test::MakeNode;
using ::deepnex::test::StatusIs;
using ::deepnex::test::TempDir;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;  // NOLINT

// Every container needs a grant's CPUs and memory (0 grants none).
constexpr uint64_t kGrantMemory = 256 << 20;

class CentralLaunch : public ::deepnex::test::CentralFixture {
 protected:
  void SetUp() override {
    CentralServerOptions o = ServerOptions("j1tok alice user j1\nj1admintok root admin j1\n");
    LauncherOptions l;
    l.backend = "process";
    l.state_dir = dir_.path() + "/launch";
    // Users' containers run as nobody (as root) or as this test's own uid;
    // they reach the gate files in dir_ by name.
    ContainerPolicy policy;
    const RunAs as = geteuid() == 0 ? RunAs{65534, 65534} : RunAs{geteuid(), getegid()};
    policy.users = {{"alice", as}, {"bob", as}};
    ASSERT_EQ(chmod(dir_.path().c_str(), 0711), 0);
    ASSERT_OK_AND_ASSIGN(server_, CreateCentralServer(o, l, policy));
    admin_ = Client("admintok");
    alice_gpu_ = Client("alicetok");
    bob_gpu_ = Client("bobtok");
    admin_c_ = Containers("admintok");
    alice_ = Containers("alicetok");
    bob_ = Containers("bobtok");
    ASSERT_OK(admin_->AddNode(MakeNode("x1", 2)));
  }

  std::unique_ptr<CentralClient> Containers(const std::string& token) {
    return Client<CentralClient>(token);
  }

  static ContainerSpec Spec(const std::string& name, std::vector<std::string> command) {
    ContainerSpec s;
    s.name = name;
    s.command = std::move(command);
    return s;
  }
  // One CPU and kGrantMemory: half of a grant of 2 and 2 * kGrantMemory.
  static ContainerSpec Half(ContainerSpec s) {
    s.cpus = 1;
    s.memory = kGrantMemory;
    return s;
  }

  // `client`'s container `name` once `done` holds for it (60 s at most).
  static CentralContainer Await(CentralClient& client, const std::string& name,
                                const std::function<bool(const CentralContainer&)>& done) {
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    CentralContainer last;
    while (std::chrono::steady_clock::now() < deadline) {
      auto list = client.ListContainers();
      EXPECT_TRUE(list.ok()) << list.status();
      if (!list.ok()) return last;
      for (const auto& c : *list) {
        if (c.name == name) last = c;
      }
      if (last.name == name && done(last)) return last;
      std::this_thread::sleep_for(20ms);
    }
    ADD_FAILURE() << "container " << name << " stayed " << StateName(last.state);
    return last;
  }

  std::unique_ptr<gpu::CentralClient> admin_, alice_gpu_, bob_gpu_;
  std::unique_ptr<CentralClient> admin_c_, alice_, bob_;
};

TEST_F(CentralLaunch, RunsListsLogsAndReleasesTheAllocationAtItsEnd) {
  ASSERT_OK_AND_ASSIGN(Allocation a, alice_gpu_->Allocate(Exclusive("", 1, 1, kGrantMemory)));
  const std::string gate = dir_.path() + "/gate";
  ASSERT_OK_AND_ASSIGN(
      CentralContainer started,
      alice_->StartContainer(
          Spec("w0", {"sh", "-c",
                      "echo hello $CUDA_VISIBLE_DEVICES; while [ ! -e " + gate +
                          " ]; do sleep 0.02; done; echo bye; exit 3"}),
          a.id));
  EXPECT_EQ(started.name, "w0");
  EXPECT_EQ(started.user, "alice");
  EXPECT_EQ(started.allocation_id, a.id);
  EXPECT_EQ(started.backend, "process");

  CentralContainer running =
      Await(*alice_, "w0", [](const CentralContainer& c) { return c.state == State::kRunning; });
  EXPECT_EQ(running.restarts, 0);
  EXPECT_THAT(running.gpus, ElementsAre(a.gpus[0].index));
  EXPECT_FALSE(running.allocation_released);
  // Its series on central's own launcher, labelled as an agent's are; once
  // each family (a second HELP line would make the text invalid).
  const std::string labels = "{container=\"alice.w0\",node=\"x1\",user=\"alice\"} ";
  const std::string metrics = server_->MetricsText();
  EXPECT_THAT(metrics, HasSubstr("\ndeepnex_container_cpu_seconds_total" + labels));
  EXPECT_THAT(metrics, HasSubstr("\ndeepnex_container_memory_bytes" + labels));
  EXPECT_EQ(metrics.find("# HELP deepnex_container_memory_bytes"),
            metrics.rfind("# HELP deepnex_container_memory_bytes"));
  ASSERT_OK_AND_ASSIGN(auto held, alice_gpu_->Allocations());
  ASSERT_EQ(held.size(), 1u);

  std::ofstream(gate) << "";
  CentralContainer ended = Await(*alice_, "w0", [](const CentralContainer& c) {
    return c.state == State::kExited && c.allocation_released;
  });
  EXPECT_EQ(ended.last_exit, "exited(3)");
  EXPECT_THAT(server_->MetricsText(), Not(HasSubstr("container=\"alice.w0\"")));
  ASSERT_OK_AND_ASSIGN(LogChunk logs, alice_->ContainerLogs("w0"));
  EXPECT_EQ(logs.data, "hello " + a.env.at("CUDA_VISIBLE_DEVICES") + "\nbye\n");
  EXPECT_TRUE(logs.ended);
  EXPECT_EQ(logs.next_offset, logs.data.size());
  ASSERT_OK_AND_ASSIGN(LogChunk tail, alice_->ContainerLogs("w0", 6));
  EXPECT_EQ(tail.data, logs.data.substr(6));
  ASSERT_OK_AND_ASSIGN(held, alice_gpu_->Allocations());
  EXPECT_TRUE(held.empty());
  EXPECT_THAT(server_->allocator().GetAllocation(a.id), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(CentralLaunch, FollowPassesTheWholeLogUntilTheEnd) {
  ASSERT_OK_AND_ASSIGN(Allocation a, alice_gpu_->Allocate(Exclusive("", 1, 1, kGrantMemory)));
  ASSERT_OK(alice_
                ->StartContainer(Spec("w0", {"sh", "-c", "for i in 1 2 3; do echo $i; sleep 0.1; done"}),
                                 a.id)
                .status());
  std::string got;
  ASSERT_OK(alice_->FollowContainerLogs("w0", [&](const std::string& chunk) {
    got += chunk;
    return true;
  }, 20ms));
  EXPECT_EQ(got, "1\n2\n3\n");
}

TEST_F(CentralLaunch, StopEndsItAndReleasesTheAllocation) {
  ASSERT_OK_AND_ASSIGN(Allocation a, alice_gpu_->Allocate(Exclusive("", 1, 1, kGrantMemory)));
  ASSERT_OK(alice_->StartContainer(Spec("w0", {"sleep", "60"}), a.id).status());
  Await(*alice_, "w0", [](const CentralContainer& c) { return c.state == State::kRunning; });
  // A long grace: under load SIGKILL would come before sleep ends at SIGTERM.
  ASSERT_OK_AND_ASSIGN(CentralContainer stopped, alice_->StopContainer("w0", 10s));
  EXPECT_EQ(stopped.state, State::kStopped);
  EXPECT_EQ(stopped.last_exit, "signaled(SIGTERM)");
  EXPECT_TRUE(stopped.allocation_released);
  ASSERT_OK_AND_ASSIGN(auto held, alice_gpu_->Allocations());
  EXPECT_TRUE(held.empty());
  // Its name is free again, on a new allocation.
  ASSERT_OK_AND_ASSIGN(Allocation b, alice_gpu_->Allocate(Exclusive("", 1, 1, kGrantMemory)));
  ASSERT_OK_AND_ASSIGN(CentralContainer again,
                       alice_->StartContainer(Spec("w0", {"true"}), b.id));
  EXPECT_EQ(again.allocation_id, b.id);
}

// Sessions (#16): CentralClient::Exec in the caller's running container.
TEST_F(CentralLaunch, ExecRunsInTheCallersContainerOnly) {
  ASSERT_OK_AND_ASSIGN(Allocation a, alice_gpu_->Allocate(Exclusive("", 1, 1, kGrantMemory)));
  ASSERT_OK(alice_->StartContainer(Spec("w0", {"sleep", "60"}), a.id).status());
  Await(*alice_, "w0", [](const CentralContainer& c) { return c.state == State::kRunning; });
  std::string out, err;
  ASSERT_OK_AND_ASSIGN(int code, alice_->Exec("w0", {"sh", "-c", "cat; echo e >&2; exit 9"},
                                              "piped", [&](bool is_stderr, const std::string& d) {
                                                (is_stderr ? err : out) += d;
                                              }));
  EXPECT_EQ(code, 9);
  EXPECT_EQ(out, "piped");
  EXPECT_EQ(err, "e\n");
  EXPECT_THAT(bob_->Exec("w0", {"true"}, "", nullptr),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no container \"w0\" of user bob")));
  EXPECT_THAT(alice_->Exec("w0", {"/no/such/command"}, "", nullptr),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/no/such/command")));
}

TEST_F(CentralLaunch, TheAllocationOutlivesAllButTheLastContainerOnIt) {
  ASSERT_OK_AND_ASSIGN(Allocation a, alice_gpu_->Allocate(Exclusive("", 1, 2, 2 * kGrantMemory)));
  ASSERT_OK(alice_->StartContainer(Half(Spec("ps", {"sleep", "60"})), a.id).status());
  ASSERT_OK(alice_->StartContainer(Half(Spec("w0", {"true"})), a.id).status());
  CentralContainer w0 = Await(*alice_, "w0", [](const CentralContainer& c) {
    return c.state == State::kExited;
  });
  EXPECT_FALSE(w0.allocation_released);
  ASSERT_OK(server_->allocator().GetAllocation(a.id).status());
  ASSERT_OK_AND_ASSIGN(CentralContainer ps, alice_->StopContainer("ps", 1s));
  EXPECT_TRUE(ps.allocation_released);
  EXPECT_THAT(server_->allocator().GetAllocation(a.id), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(CentralLaunch, AContainerWhoseAllocationIsReleasedIsStopped) {
  ASSERT_OK_AND_ASSIGN(Allocation a, alice_gpu_->Allocate(Exclusive("", 1, 1, kGrantMemory)));
  ASSERT_OK(alice_->StartContainer(Spec("w0", {"sleep", "60"}), a.id).status());
  Await(*alice_, "w0", [](const CentralContainer& c) { return c.state == State::kRunning; });
  ASSERT_OK(alice_gpu_->Release(a.id));
  CentralContainer stopped = Await(*alice_, "w0", [](const CentralContainer& c) {
    return c.state == State::kStopped && c.allocation_released;
  });
  EXPECT_EQ(stopped.last_exit, "signaled(SIGTERM)");
}

TEST_F(CentralLaunch, AnotherUsersAllocationIsRefusedAndAnUnknownOneNotFound) {
  ASSERT_OK_AND_ASSIGN(Allocation a, alice_gpu_->Allocate(Exclusive("", 1, 1, kGrantMemory)));
  EXPECT_THAT(bob_->StartContainer(Spec("w0", {"true"}), a.id),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("user bob cannot start a container on allocation " + a.id +
                                 ": it is another user's")));
  EXPECT_THAT(alice_->StartContainer(Spec("w0", {"true"}), "a999"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"a999\" does not exist")));
  EXPECT_THAT(alice_->StartContainer(Spec("w0", {"true"}), ""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("allocation_id is empty")));
  ContainerSpec with_mount = Spec("w0", {"true"});
  with_mount.mounts.push_back({"/tmp", "/data", true});
  EXPECT_THAT(alice_->StartContainer(with_mount, a.id),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("spec.mounts")));
  // The launcher's errors name the container as its user did.
  EXPECT_THAT(alice_->StartContainer(Spec("bad name", {"true"}), a.id),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("spec.name: \"bad name\""), Not(HasSubstr("alice.")))));
  EXPECT_THAT(alice_->StartContainer(Spec(std::string(58, 'x'), {"true"}), a.id),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("must be 1 to 57 characters for user alice")));
  // Proto strings are UTF-8: such a spec read "deepnex-central ... has no
  // launcher: " (central could not parse it: an empty UNIMPLEMENTED).
  ContainerSpec latin = Spec("w0", {"true"});
  latin.env["CITY"] = "S\xe3o Paulo";
  EXPECT_THAT(alice_->StartContainer(latin, a.id),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(".value: \"S\\xe3o Paulo\" is not UTF-8 text")));
  // A spec the launcher refuses leaves nothing behind.
  EXPECT_THAT(alice_->StartContainer(Spec("w0", {"/no/such/command"}), a.id),
              StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK_AND_ASSIGN(auto mine, alice_->ListContainers());
  EXPECT_TRUE(mine.empty());
  ASSERT_OK(server_->allocator().GetAllocation(a.id).status());
}

TEST_F(CentralLaunch, AnotherUsersContainerIsInvisibleAndNamesArePerUser) {
  ASSERT_OK_AND_ASSIGN(Allocation a, alice_gpu_->Allocate(Exclusive("", 1, 1, kGrantMemory)));
  ASSERT_OK_AND_ASSIGN(Allocation b, bob_gpu_->Allocate(Exclusive("", 1, 1, kGrantMemory)));
  ASSERT_OK(alice_->StartContainer(Spec("w0", {"sleep", "60"}), a.id).status());
  ASSERT_OK_AND_ASSIGN(auto bobs, bob_->ListContainers());
  EXPECT_TRUE(bobs.empty());
  EXPECT_THAT(bob_->ListContainers("alice"), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(bob_->StopContainer("w0", 1s),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no container \"w0\" of user bob")));
  EXPECT_THAT(bob_->StopContainer("w0", 1s, "alice"),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(bob_->ContainerLogs("w0"), StatusIs(absl::StatusCode::kNotFound));
  // Bob's own "w0" is another container.
  ASSERT_OK(bob_->StartContainer(Spec("w0", {"sh", "-c", "echo bob"}), b.id).status());
  EXPECT_THAT(alice_->StartContainer(Spec("w0", {"true"}), a.id),
              StatusIs(absl::StatusCode::kAlreadyExists));
  ASSERT_OK_AND_ASSIGN(auto all, admin_c_->ListContainers());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].user, "alice");
  EXPECT_EQ(all[1].user, "bob");
  Await(*bob_, "w0", [](const CentralContainer& c) { return c.state == State::kExited; });
  Await(*alice_, "w0", [](const CentralContainer& c) { return c.state == State::kRunning; });
  // An admin stops anyone's.
  ASSERT_OK_AND_ASSIGN(CentralContainer stopped, admin_c_->StopContainer("w0", 1s, "alice"));
  EXPECT_EQ(stopped.state, State::kStopped);
}

TEST_F(CentralLaunch, StoppingTheServerStopsItsContainersAndReleases) {
  ASSERT_OK_AND_ASSIGN(Allocation a, alice_gpu_->Allocate(Exclusive("", 1, 1, kGrantMemory)));
  ASSERT_OK_AND_ASSIGN(CentralContainer c,
                       alice_->StartContainer(Spec("w0", {"sleep", "60"}), a.id));
  const pid_t pid = std::stoi(c.id);
  server_->Stop();
  EXPECT_THAT(server_->allocator().GetAllocation(a.id), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_NE(kill(pid, 0), 0) << "pid " << pid << " outlived the server";
}

// #12: the CPUs and memory of a grant bound the sum over its containers
// that have not ended for good; one that ends frees its share.
TEST_F(CentralLaunch, AGrantBoundsTheSumOfItsRunningContainers) {
  ASSERT_OK_AND_ASSIGN(Allocation a, alice_gpu_->Allocate(Exclusive("", 0, 2, 2 * kGrantMemory)));
  ContainerSpec w0 = Half(Spec("w0", {"sleep", "60"}));
  ASSERT_OK(alice_->StartContainer(w0, a.id).status());
  ContainerSpec w1 = Half(Spec("w1", {"sleep", "60"}));
  w1.cpus = 0.5;
  ASSERT_OK(alice_->StartContainer(w1, a.id).status());
  // The issue's 60 one-CPU containers on one grant: the next one over.
  ContainerSpec w2 = Half(Spec("w2", {"sleep", "60"}));
  EXPECT_THAT(alice_->StartContainer(w2, a.id),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       "spec.cpus: allocation \"" + a.id +
                           "\" grants 2 CPUs; its running containers would use 2.5"));
  w2.cpus = 0.5;
  w2.memory = 4 << 20;
  EXPECT_THAT(alice_->StartContainer(w2, a.id),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       "spec.memory: allocation \"" + a.id +
                           "\" grants 512MiB; its running containers would use 516MiB"));
  // A stopped container frees its share; the allocation stays for w0.
  ASSERT_OK_AND_ASSIGN(CentralContainer stopped, alice_->StopContainer("w1", 1s));
  EXPECT_FALSE(stopped.allocation_released);
  ASSERT_OK_AND_ASSIGN(CentralContainer c, alice_->StartContainer(w2, a.id));
  EXPECT_EQ(c.cpus, 0.5);
  EXPECT_EQ(c.memory, 4u << 20);
  ASSERT_OK(alice_gpu_->Release(a.id));
}

// A spec without limits takes the grant's whole, so a second one does not
// fit, and the refusal says why.
TEST_F(CentralLaunch, ASecondContainerWithoutLimitsOnOneGrantIsRefused) {
  ASSERT_OK_AND_ASSIGN(Allocation a, alice_gpu_->Allocate(Exclusive("", 1, 1, kGrantMemory)));
  ASSERT_OK_AND_ASSIGN(CentralContainer c,
                       alice_->StartContainer(Spec("u0", {"sleep", "60"}), a.id));
  EXPECT_EQ(c.cpus, 1);
  EXPECT_EQ(c.memory, kGrantMemory);
  EXPECT_THAT(alice_->StartContainer(Spec("u1", {"sleep", "60"}), a.id),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       "spec.cpus: allocation \"" + a.id +
                           "\" grants 1 CPUs; its running containers would use 2 (without "
                           "spec.cpus a container takes the grant's whole)"));
  ContainerSpec small = Spec("u1", {"sleep", "60"});
  small.cpus = 0.001;
  EXPECT_THAT(alice_->StartContainer(small, a.id),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("its running containers would use 1.001")));
  ASSERT_OK_AND_ASSIGN(auto listed, alice_->ListContainers());
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].name, "u0");
  ASSERT_OK(alice_gpu_->Release(a.id));
}

// A grant of 0 CPUs or 0 memory is none: the issue's 64 CPUs on a 0-CPU
// grant and a container without a memory limit are refused.
TEST_F(CentralLaunch, AGrantOfNoCpusOrNoMemoryStartsNothing) {
  ASSERT_OK_AND_ASSIGN(Allocation no_cpus, alice_gpu_->Allocate(Exclusive("", 1, 0, kGrantMemory)));
  EXPECT_THAT(alice_->StartContainer(Spec("w0", {"true"}), no_cpus.id),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "spec.cpus: allocation \"" + no_cpus.id +
                           "\" grants 0 CPUs, and a container needs some (allocate with "
                           "cpus > 0)"));
  ContainerSpec many = Spec("w0", {"true"});
  many.cpus = 64;
  EXPECT_THAT(alice_->StartContainer(many, no_cpus.id),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "spec.cpus: 64 is more than allocation \"" + no_cpus.id + "\" grants (0)"));
  ASSERT_OK_AND_ASSIGN(Allocation no_memory, alice_gpu_->Allocate(Exclusive("", 1, 1, 0)));
  EXPECT_THAT(alice_->StartContainer(Spec("w0", {"true"}), no_memory.id),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "spec.memory: allocation \"" + no_memory.id +
                           "\" grants no memory, and a container needs some (allocate with "
                           "memory > 0)"));
  ASSERT_OK_AND_ASSIGN(auto listed, alice_->ListContainers());
  EXPECT_TRUE(listed.empty());
}

// A job-scoped token reaches only its job's allocations and containers,
// and no node or quota call even with the admin role.
TEST_F(CentralLaunch, AJobTokenIsConfinedToItsJob) {
  auto j1_gpu = Client("j1tok");
  auto j1 = Containers("j1tok");
  ASSERT_OK_AND_ASSIGN(Allocation plain, alice_gpu_->Allocate(Exclusive("", 1, 1, kGrantMemory)));
  gpu::Request r = Exclusive("", 1, 1, kGrantMemory);
  ASSERT_OK_AND_ASSIGN(Allocation mine, j1_gpu->Allocate(r));
  EXPECT_EQ(mine.user, "alice");
  EXPECT_EQ(mine.job, "j1");
  r.job = "j2";
  EXPECT_THAT(j1_gpu->Allocate(r),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "the token of \"alice\" is for job \"j1\"; the request is of job \"j2\""));
  ASSERT_OK_AND_ASSIGN(auto listed, j1_gpu->Allocations());
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].id, mine.id);
  ASSERT_OK_AND_ASSIGN(auto all, alice_gpu_->Allocations());
  EXPECT_EQ(all.size(), 2u);
  const std::string not_plain =
      "the token of \"alice\" is for job \"j1\"; allocation " + plain.id + " is of no job";
  EXPECT_THAT(j1_gpu->Renew(plain.id), StatusIs(absl::StatusCode::kPermissionDenied, not_plain));
  EXPECT_THAT(j1_gpu->Release(plain.id),
              StatusIs(absl::StatusCode::kPermissionDenied, not_plain));

  ASSERT_OK(alice_->StartContainer(Spec("other", {"sleep", "60"}), plain.id).status());
  EXPECT_THAT(j1->StartContainer(Spec("w0", {"sleep", "60"}), plain.id),
              StatusIs(absl::StatusCode::kPermissionDenied, not_plain));
  ASSERT_OK(j1->StartContainer(Spec("w0", {"sleep", "60"}), mine.id).status());
  ASSERT_OK_AND_ASSIGN(auto containers, j1->ListContainers());
  ASSERT_EQ(containers.size(), 1u);
  EXPECT_EQ(containers[0].name, "w0");
  const std::string not_other =
      "the token of \"alice\" is for job \"j1\"; container \"other\" is of no job";
  EXPECT_THAT(j1->StopContainer("other", 1s),
              StatusIs(absl::StatusCode::kPermissionDenied, not_other));
  EXPECT_THAT(j1->ContainerLogs("other"),
              StatusIs(absl::StatusCode::kPermissionDenied, not_other));

  auto j1_admin = Client("j1admintok");
  EXPECT_THAT(j1_admin->Cordon("x1"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "the token of \"root\" is for job \"j1\"; node and quota calls need a "
                       "token without a job"));
  ASSERT_OK_AND_ASSIGN(auto admin_listed, j1_admin->Allocations());
  ASSERT_EQ(admin_listed.size(), 1u);
  EXPECT_EQ(admin_listed[0].id, mine.id);

  // Both GPUs are held: alice's next request (of no job) waits, unseen by j1.
  // Shared: on a failed assert the answer may come after the test returned.
  auto granted = std::make_shared<std::promise<absl::StatusOr<std::vector<Allocation>>>>();
  alice_gpu_->AllocateGangAsync(Exclusive("", 1, 1, kGrantMemory), gpu::AllocateOptions(),
                                [granted](auto parts) { granted->set_value(std::move(parts)); });
  EXPECT_TRUE(::deepnex::test::WaitFor(
      [&] {
        auto pending = alice_gpu_->Pending();
        return pending.ok() && pending->size() == 1;
      },
      10s, "alice's request to wait"));
  ASSERT_OK_AND_ASSIGN(auto j1_pending, j1_gpu->Pending());
  EXPECT_TRUE(j1_pending.empty());
  ASSERT_OK(j1_gpu->Release(mine.id));
  ASSERT_OK_AND_ASSIGN(auto later, granted->get_future().get());
  ASSERT_EQ(later.size(), 1u);
  EXPECT_EQ(later[0].job, "");
  ASSERT_OK(alice_gpu_->Release(later[0].id));
  ASSERT_OK(alice_gpu_->Release(plain.id));
}

#ifdef DEEPNEX_CENTRAL_BIN
// kill -9 of deepnex-central leaves its container running on an allocation
// the ledger keeps. The next deepnex-central on the same state directories
// stops it, releases the allocation and drops its record before serving.
TEST(CentralLaunchCrash, RestartSweepsWhatTheCrashedRunLeft) {
  using gpu::test::CentralDaemon;
  using gpu::test::StartCentralDaemon;
  TempDir dir;
  const std::string nodes = dir.path() + "/nodes.json";
  std::ofstream(nodes) << R"({"nodes": [{"name": "x1", "cpus": 8, "memory": "16GiB",
      "mode": "exclusive", "gpus": {"count": 2, "memory": "80GiB"}}]})";
  const std::string ids = geteuid() == 0 ? "65534:65534" : absl::StrCat(geteuid(), ":", getegid());
  const std::vector<std::string> args = {"--state-dir", dir.path() + "/state",
                                         "--launch-state-dir", dir.path() + "/launch",
                                         "--nodes", nodes, "--user", "alice=" + ids};
  CentralDaemon first = StartCentralDaemon(args);
  ASSERT_FALSE(first.address.empty());
  CentralClientOptions o;
  o.address = first.address;
  o.timeout = 10s;
  ASSERT_OK_AND_ASSIGN(auto gpus, gpu::CentralClient::Create(o));
  ASSERT_OK_AND_ASSIGN(auto containers, CentralClient::Create(o));
  ASSERT_OK_AND_ASSIGN(Allocation a, gpus->Allocate(Exclusive("alice", 1, 1, kGrantMemory)));
  ContainerSpec spec;
  spec.name = "w0";
  spec.command = {"sleep", "600"};
  ASSERT_OK_AND_ASSIGN(CentralContainer c, containers->StartContainer(spec, a.id));
  const pid_t orphan = std::stoi(c.id);
  const std::string record_dir = dir.path() + "/launch/containers/alice.w0";
  ASSERT_TRUE(std::filesystem::exists(record_dir));
  kill(first.pid, SIGKILL);
  waitpid(first.pid, nullptr, 0);
  gpus.reset();
  containers.reset();
  ASSERT_EQ(kill(orphan, 0), 0) << "the container did not outlive the crash";

  CentralDaemon second = StartCentralDaemon(args);
  ASSERT_FALSE(second.address.empty());
  o.address = second.address;
  ASSERT_OK_AND_ASSIGN(gpus, gpu::CentralClient::Create(o));
  // Swept before serving; init reaps the orphan soon after.
  EXPECT_TRUE(::deepnex::test::WaitFor([&] { return kill(orphan, 0) != 0; }, 60s,
                                       "pid " + std::to_string(orphan) + " to end"))
      << "it outlived the restart";
  ASSERT_OK_AND_ASSIGN(auto held, gpus->Allocations());
  EXPECT_TRUE(held.empty()) << held.size() << " allocations left, the first " << held[0].id;
  EXPECT_FALSE(std::filesystem::exists(record_dir));
  // The GPUs are free again, both of them.
  EXPECT_OK(gpus->Allocate(Exclusive("bob", 2)).status());
  kill(second.pid, SIGTERM);
  waitpid(second.pid, nullptr, 0);
}
#endif

}  // namespace
}  // namespace deepnex::launch
