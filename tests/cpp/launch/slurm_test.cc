// The slurm backend against a real one-node Slurm 22.05 with 4 GPU devices
// (tests/launch/slurm.sh, a ctest fixture, starts it and sets
// DEEPNEX_TEST_SLURM_CONF). The backend is driven directly; the launcher's
// contract cases for "slurm" are in launcher_test.cc.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <set>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/file_util.h"
#include "core/random.h"
#include "deepnex/launch/launcher.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "launch/backend.h"
#include "launch/command.h"
#include "launch/launch_test_util.h"
#include "launch/util.h"
#include "test_matchers.h"

namespace deepnex::launch {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::deepnex::test::WaitFor;
using ::testing::AllOf;
using ::testing::AnyOf;
using ::testing::Eq;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using namespace std::chrono_literals;

// Generous: a loaded machine slows slurmd and the polls.
constexpr auto kJobEnd = 60s;

LauncherOptions Options(const std::string& conf) {
  LauncherOptions o;
  o.backend = "slurm";
  o.id = "slurmtest" + RandomHex(4);
  o.slurm.env = {{"SLURM_CONF", conf}};
  o.slurm.poll = 100ms;
  return o;
}

ContainerSpec Sh(const std::string& name, const std::string& script) {
  ContainerSpec spec;
  spec.name = name;
  spec.command = {"sh", "-c", script};
  return spec;
}

// A resolved spec on `n` GPUs whose allocation names indices the cluster
// does not have, so that the job's CUDA_VISIBLE_DEVICES can only be Slurm's.
ContainerSpec OnGpus(ContainerSpec spec, int n) {
  gpu::Allocation a;
  a.id = "a-1";
  a.user = "alice";
  std::string indices, uuids;
  for (int i = 0; i < n; ++i) {
    a.gpus.push_back({10 + i, absl::StrCat("GPU-x-", 10 + i), 16ull << 30, true});
    absl::StrAppend(&indices, i > 0 ? "," : "", 10 + i);
    absl::StrAppend(&uuids, i > 0 ? "," : "", "GPU-x-", 10 + i);
  }
  spec.allocation = a;
  spec.env["CUDA_VISIBLE_DEVICES"] = indices;
  spec.env["NVIDIA_VISIBLE_DEVICES"] = uuids;
  return spec;
}

// How a cancelled job that was running ends: SIGTERM, or SIGKILL that Slurm
// sends itself after KillWait when a process has not died of SIGTERM by then
// (it ignores it, or a loaded machine is slow). Slurm's record may also say
// SIGTERM for a process that only SIGKILL ended.
::testing::Matcher<int> CancelSignal() { return AnyOf(Eq(SIGTERM), Eq(SIGKILL)); }

std::set<std::string> Split(const std::string& list) {
  return absl::StrSplit(list, ',', absl::SkipEmpty());
}

class SlurmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    conf_ = test::EnvOr("DEEPNEX_TEST_SLURM_CONF");
    if (conf_.empty()) {
      GTEST_SKIP() << "DEEPNEX_TEST_SLURM_CONF is not set (the ctest fixture "
                      "slurm_cluster_start sets it)";
    }
    struct stat st;
    if (stat(conf_.c_str(), &st) != 0) {
      GTEST_SKIP() << conf_ << " does not exist: tests/launch/slurm.sh could not start "
                   << "a cluster here (its output in the slurm_cluster_start test says why)";
    }
    options_ = Options(conf_);
    ASSERT_OK_AND_ASSIGN(backend_, MakeSlurmBackend(options_));
    // A job of an earlier test may still be on its way out with GPUs held.
    ASSERT_TRUE(test::WaitUntil([&] { return Squeue({"-o", "%i"}).empty(); }, kJobEnd))
        << "jobs still queued: " << Squeue({"-o", "%i %T %j"});
  }

  void TearDown() override {
    if (backend_ != nullptr) EXPECT_THAT(backend_->Cleanup(options_.id), IsOk());
    if (port_holder_ >= 0) close(port_holder_);
  }

  // The cluster's config with the controller on a port where nobody listens
  // (bound, so nobody else takes it) and a 1 s message timeout instead of 10.
  std::string DeadConf() {
    if (port_holder_ < 0) {
      port_holder_ = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      socklen_t len = sizeof addr;
      EXPECT_EQ(bind(port_holder_, reinterpret_cast<sockaddr*>(&addr), len), 0);
      EXPECT_EQ(getsockname(port_holder_, reinterpret_cast<sockaddr*>(&addr), &len), 0);
      dead_port_ = ntohs(addr.sin_port);
    }
    absl::StatusOr<std::string> config = ReadWholeFile(conf_, "slurm.conf");
    EXPECT_THAT(config, IsOk());
    std::string dead;
    for (absl::string_view line : absl::StrSplit(config.value_or(""), '\n')) {
      if (!absl::StartsWith(line, "SlurmctldPort=")) absl::StrAppend(&dead, line, "\n");
    }
    return absl::StrCat(dead, "SlurmctldPort=", dead_port_, "\nMessageTimeout=1\n");
  }

  // Output of `squeue -h <args>` on the test cluster.
  std::string Squeue(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {"/usr/bin/squeue", "-h"};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<CommandResult> r = RunCommand(argv, {"SLURM_CONF=" + conf_}, 30s);
    EXPECT_THAT(r, IsOk());
    if (!r.ok()) return "";
    EXPECT_TRUE(r->ok()) << DescribeFailure(argv, *r);
    return std::string(absl::StripAsciiWhitespace(r->out));
  }

  // squeue's state of a job: PENDING, RUNNING, COMPLETED, ...
  std::string JobState(const launch::Run& run) { return Squeue({"-t", "all", "-j", run.id(), "-o", "%T"}); }

  // `scontrol show job -o` of a job.
  std::string JobRecord(const launch::Run& run) {
    std::vector<std::string> argv = {"/usr/bin/scontrol", "show", "job", "-o", run.id()};
    absl::StatusOr<CommandResult> r = RunCommand(argv, {"SLURM_CONF=" + conf_}, 30s);
    EXPECT_THAT(r, IsOk());
    return r.ok() ? r->out : "";
  }

  // The first run of `spec` by `launcher_id` (default: this test's), in a
  // new directory `dir` of the scratch directory (default: the run's name).
  RunContext ContextFor(const ContainerSpec& spec, const std::string& launcher_id = "",
                        const std::string& dir = "") {
    RunContext context;
    context.launcher_id = launcher_id.empty() ? options_.id : launcher_id;
    context.run_name = RunName(context.launcher_id, spec.name, 0);
    context.dir = scratch_.path() + "/" + (dir.empty() ? context.run_name : dir);
    context.labels = spec.labels;
    context.labels["deepnex.launcher"] = context.launcher_id;
    context.labels["deepnex.name"] = spec.name;
    EXPECT_EQ(mkdir(context.dir.c_str(), 0755), 0);
    return context;
  }

  std::unique_ptr<launch::Run> StartOk(const ContainerSpec& spec, Backend* backend = nullptr,
                               const std::string& launcher_id = "",
                               const std::string& dir = "") {
    RunContext context = ContextFor(spec, launcher_id, dir);
    Backend* b = backend != nullptr ? backend : backend_.get();
    EXPECT_THAT(b->Check(spec), IsOk());
    absl::StatusOr<std::unique_ptr<launch::Run>> run = b->Start(spec, context);
    EXPECT_THAT(run, IsOk());
    return run.ok() ? std::move(*run) : nullptr;
  }

  ExitStatus WaitEnd(launch::Run& run) {
    absl::StatusOr<std::optional<ExitStatus>> e = run.Wait(kJobEnd);
    EXPECT_THAT(e, IsOk());
    if (!e.ok() || !e->has_value()) {
      ADD_FAILURE() << "job " << run.id() << " still " << JobState(run) << " after "
                    << kJobEnd.count() << " s";
      return ExitStatus{ExitReason::kLost};
    }
    return **e;
  }

  std::string LogsOf(launch::Run& run) {
    absl::StatusOr<std::string> logs = run.Logs();
    EXPECT_THAT(logs, IsOk());
    return logs.ok() ? *logs : "";
  }

  std::string conf_;
  LauncherOptions options_;
  std::unique_ptr<Backend> backend_;
  ::deepnex::test::TempDir scratch_;
  int port_holder_ = -1;
  int dead_port_ = 0;
};

TEST_F(SlurmTest, GresGivesTheJobTwoOfTheClustersGpus) {
  auto run = StartOk(OnGpus(Sh("gpus", "echo \"C=$CUDA_VISIBLE_DEVICES N=${NVIDIA_VISIBLE_DEVICES-unset}\""), 2));
  ASSERT_NE(run, nullptr);
  EXPECT_THAT(JobRecord(*run), HasSubstr("TresPerNode=gres:gpu:2"));
  ExitStatus e = WaitEnd(*run);
  EXPECT_TRUE(e.ok()) << e.ToString();
  // Slurm chose the GPUs: its indices, not the allocation's 10,11.
  const std::string logs = LogsOf(*run);
  absl::string_view rest = logs;
  ASSERT_TRUE(absl::ConsumePrefix(&rest, "C=")) << logs;
  std::pair<std::string, std::string> parts = absl::StrSplit(rest, " N=");
  std::set<std::string> gpus = Split(parts.first);
  EXPECT_EQ(gpus.size(), 2u) << parts.first;
  for (const std::string& g : gpus) EXPECT_TRUE(g >= "0" && g <= "3" && g.size() == 1) << g;
  EXPECT_EQ(parts.second, "unset\n");
}

TEST_F(SlurmTest, ThirdTwoGpuJobWaitsUntilOneEnds) {
  const std::string go = scratch_.path() + "/go";
  // Runs until its file appears (at most 120 s: the second must still run
  // when the first and third have ended, however slow the machine).
  auto holder = [&](const std::string& name) {
    return OnGpus(Sh(name, "echo $CUDA_VISIBLE_DEVICES; i=0; while [ ! -e " + go + name +
                               " ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done"),
                  2);
  };
  auto first = StartOk(holder("first"));
  auto second = StartOk(holder("second"));
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  ASSERT_TRUE(test::WaitUntil(
      [&] { return JobState(*first) == "RUNNING" && JobState(*second) == "RUNNING"; }, kJobEnd))
      << JobState(*first) << " " << JobState(*second);
  auto third = StartOk(OnGpus(Sh("third", "echo $CUDA_VISIBLE_DEVICES"), 2));
  auto fourth = StartOk(OnGpus(Sh("fourth", "echo never"), 2));
  ASSERT_NE(third, nullptr);
  ASSERT_NE(fourth, nullptr);
  ASSERT_THAT(third->Wait(2s), IsOk());
  EXPECT_EQ(JobState(*third), "PENDING");
  // Its container shows as starting, not running with no usage.
  EXPECT_EQ(third->Queued(), "PENDING in Slurm's queue (Resources)");
  ASSERT_THAT(first->Wait(0ms), IsOk());
  EXPECT_EQ(first->Queued(), "");
  EXPECT_THAT(Squeue({"-j", third->id(), "-o", "%r"}), HasSubstr("Resources"));
  EXPECT_EQ(LogsOf(*third), "");

  // A pending job stopped never runs.
  ASSERT_THAT(fourth->Stop(1s), IsOk());
  ExitStatus stopped = WaitEnd(*fourth);
  EXPECT_EQ(stopped.reason, ExitReason::kSignaled) << stopped.ToString();
  EXPECT_EQ(stopped.signal, SIGTERM);
  EXPECT_EQ(LogsOf(*fourth), "");

  ASSERT_TRUE(test::WaitUntil([&] { return !LogsOf(*first).empty() && !LogsOf(*second).empty(); },
                              kJobEnd));
  std::set<std::string> a = Split(std::string(absl::StripAsciiWhitespace(LogsOf(*first))));
  std::set<std::string> b = Split(std::string(absl::StripAsciiWhitespace(LogsOf(*second))));
  std::set<std::string> all = a;
  all.insert(b.begin(), b.end());
  EXPECT_EQ(all, (std::set<std::string>{"0", "1", "2", "3"}));

  ASSERT_EQ(close(creat((go + "first").c_str(), 0644)), 0);
  EXPECT_TRUE(WaitEnd(*first).ok());
  EXPECT_TRUE(WaitEnd(*third).ok());
  // The third got the GPUs the first gave back.
  EXPECT_EQ(Split(std::string(absl::StripAsciiWhitespace(LogsOf(*third)))), a);
  EXPECT_EQ(JobState(*second), "RUNNING");
  ASSERT_EQ(close(creat((go + "second").c_str(), 0644)), 0);
  EXPECT_TRUE(WaitEnd(*second).ok());
}

// A job Slurm holds PENDING showed through the launcher as running, with no
// usage; it shows as starting until it runs.
TEST_F(SlurmTest, AQueuedJobsContainerShowsAsStartingUntilItRuns) {
  const std::string go = scratch_.path() + "/go";
  auto holder = StartOk(OnGpus(Sh("hold", "i=0; while [ ! -e " + go + " ] && [ $i -lt 1200 ]; "
                                          "do sleep 0.1; i=$((i+1)); done"),
                               4));
  ASSERT_NE(holder, nullptr);
  ASSERT_TRUE(test::WaitUntil([&] { return JobState(*holder) == "RUNNING"; }, kJobEnd));
  LauncherOptions o = options_;
  o.backend = "slurm";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Launcher> launcher, Launcher::Create(o));
  ContainerSpec queued = OnGpus(Sh("queued", "sleep 30"), 2);
  queued.allocation->cpus = 1;
  queued.allocation->memory = 64 << 20;
  queued.allocation->env = queued.env;  // the launcher's to set, from the grant
  queued.env.clear();
  ASSERT_OK_AND_ASSIGN(auto h, launcher->Start(queued));
  ASSERT_TRUE(test::WaitUntil([&] { return JobState(*holder) == "RUNNING"; }, kJobEnd));
  EXPECT_EQ(h->Status().state, State::kStarting);
  // Slurm's reason once its scheduler has looked.
  EXPECT_TRUE(test::WaitUntil(
      [&] { return h->Status().queued == "PENDING in Slurm's queue (Resources)"; }, kJobEnd))
      << h->Status().queued;
  ASSERT_EQ(close(creat(go.c_str(), 0644)), 0);
  EXPECT_TRUE(WaitEnd(*holder).ok());
  EXPECT_TRUE(test::WaitUntil([&] { return h->Status().state == State::kRunning; }, kJobEnd))
      << StateName(h->Status().state);
  EXPECT_THAT(h->Stop(1s), IsOk());
}

TEST_F(SlurmTest, ExitCodesAndSignals) {
  auto zero = StartOk(Sh("zero", "echo out; echo err >&2"));
  auto three = StartOk(Sh("three", "exit 3"));
  auto killed = StartOk(Sh("killed", "kill -KILL $$"));
  auto segv = StartOk(Sh("segv", "kill -SEGV $$"));
  ASSERT_NE(zero, nullptr);
  ASSERT_NE(three, nullptr);
  ASSERT_NE(killed, nullptr);
  ASSERT_NE(segv, nullptr);
  EXPECT_EQ(WaitEnd(*zero).ToString(), "exited(0)");
  EXPECT_EQ(LogsOf(*zero), "out\nerr\n");
  EXPECT_EQ(WaitEnd(*three).ToString(), "exited(3)");
  ExitStatus k = WaitEnd(*killed);
  EXPECT_EQ(k.reason, ExitReason::kSignaled);
  EXPECT_EQ(k.signal, SIGKILL);
  ExitStatus s = WaitEnd(*segv);
  EXPECT_EQ(s.reason, ExitReason::kSignaled);
  EXPECT_EQ(s.signal, SIGSEGV);
  // Waiting again answers from what was seen.
  EXPECT_THAT(three->Wait(0ms), IsOk());
}

TEST_F(SlurmTest, StopCancelsAndKillsTheTree) {
  const std::string token = test::UniqueToken();
  auto run = StartOk(Sh("tree", "sh -c 'sleep " + token + " & wait' & sleep " + token + "1 & wait"));
  ASSERT_NE(run, nullptr);
  // The job's shell, the child shell and two sleeps all carry the token.
  ASSERT_TRUE(test::WaitUntil([&] { return test::ProcessesWithArg(token).size() == 4; }, kJobEnd))
      << test::ProcessesWithArg(token).size() << " processes";
  ASSERT_OK_AND_ASSIGN(Usage u, run->Usage());
  EXPECT_EQ(u.pids, 4);
  EXPECT_GT(u.memory, 0u);
  EXPECT_GE(u.memory_peak, u.memory);
  ASSERT_THAT(run->Stop(1s), IsOk());
  ExitStatus e = WaitEnd(*run);
  EXPECT_EQ(e.reason, ExitReason::kSignaled) << e.ToString();
  EXPECT_THAT(e.signal, CancelSignal());
  EXPECT_EQ(JobState(*run), "CANCELLED");
  // slurmd reports the job over while its killed processes may still be going.
  EXPECT_TRUE(WaitFor([&] { return test::ProcessesWithArg(token).empty(); }, kJobEnd,
                      "the job's processes to end"));
  EXPECT_THAT(run->Stop(1s), IsOk());  // idempotent
  EXPECT_THAT(run->Remove(), IsOk());
}

TEST_F(SlurmTest, ProcessesIgnoringSigtermAreKilledAfterKillWait) {
  const std::string token = test::UniqueToken();
  auto run = StartOk(Sh("stubborn", "trap '' TERM; sleep " + token + " & sleep " + token + "1; wait"));
  ASSERT_NE(run, nullptr);
  ASSERT_TRUE(test::WaitUntil([&] { return test::ProcessesWithArg(token).size() >= 2; }, kJobEnd));
  const auto stop = std::chrono::steady_clock::now();
  ASSERT_THAT(run->Stop(0ms), IsOk());
  ExitStatus e = WaitEnd(*run);
  EXPECT_EQ(e.reason, ExitReason::kSignaled) << e.ToString();
  EXPECT_THAT(e.signal, CancelSignal());
  // Not before the cluster's KillWait of 2 s; about 5 s in all when measured.
  const auto took = std::chrono::steady_clock::now() - stop;
  EXPECT_GE(took, 2s);
  EXPECT_LT(took, 15s);
  EXPECT_TRUE(WaitFor([&] { return test::ProcessesWithArg(token).empty(); }, kJobEnd,
                      "the job's processes to end"));
}

TEST_F(SlurmTest, CleanupFindsJobsByLabel) {
  LauncherOptions other = options_;
  other.id = options_.id + "x";  // shares the prefix, must not match
  const std::string loop = "i=0; while [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done";
  ContainerSpec spec = Sh("a", loop);
  spec.labels = {{"team", "x y"}};
  auto a = StartOk(spec);
  auto b = StartOk(Sh("b", loop));
  auto c = StartOk(Sh("c", loop), backend_.get(), other.id);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_NE(c, nullptr);
  EXPECT_THAT(JobRecord(*a), HasSubstr("Comment=deepnex.launcher=" + options_.id +
                                       ",deepnex.name=a,team=x y"));
  ASSERT_OK_AND_ASSIGN(int swept, backend_->Cleanup(options_.id));
  EXPECT_EQ(swept, 2);
  for (launch::Run* r : {a.get(), b.get()}) {
    ExitStatus e = WaitEnd(*r);
    EXPECT_EQ(e.reason, ExitReason::kSignaled) << e.ToString();
    EXPECT_THAT(e.signal, CancelSignal());
  }
  EXPECT_THAT(c->Wait(0ms), IsOk());
  EXPECT_EQ(c->Wait(0ms)->has_value(), false);
  ASSERT_OK_AND_ASSIGN(swept, backend_->Cleanup(options_.id));
  EXPECT_EQ(swept, 0);
  ASSERT_OK_AND_ASSIGN(swept, backend_->Cleanup(other.id));
  EXPECT_EQ(swept, 1);
  EXPECT_EQ(WaitEnd(*c).reason, ExitReason::kSignaled);
}

// A comment is any user's text, newlines included: a probe's own job
// commented $'x\n<victim> RUNNING deepnex.launcher=<central's id>' forged a
// line of squeue's output, and central's sweep (as root) cancelled the
// victim, another user's job. Only jobs whose own record carries the label
// are swept.
TEST_F(SlurmTest, CleanupCancelsNoJobThatAForgedCommentNames) {
  auto sbatch = [&](const std::string& comment) {
    std::vector<std::string> argv = {"/usr/bin/sbatch", "--parsable", "--comment=" + comment,
                                     "--output=/dev/null", "--wrap=sleep 120"};
    absl::StatusOr<CommandResult> r = RunCommand(argv, {"SLURM_CONF=" + conf_}, 30s);
    EXPECT_THAT(r, IsOk());
    EXPECT_TRUE(r.ok() && r->ok()) << (r.ok() ? DescribeFailure(argv, *r) : "");
    return r.ok() ? std::string(absl::StripAsciiWhitespace(r->out)) : "";
  };
  const std::string victim = sbatch("someone else's");
  const std::string forger =
      sbatch(absl::StrCat("x\n", victim, " RUNNING deepnex.launcher=", options_.id));
  ASSERT_FALSE(victim.empty());
  ASSERT_FALSE(forger.empty());
  absl::Cleanup cancel = [&] {
    RunCommand({"/usr/bin/scancel", victim, forger}, {"SLURM_CONF=" + conf_}, 30s)
        .IgnoreError();
  };
  auto ours = StartOk(Sh("ours", "sleep 120"));
  ASSERT_NE(ours, nullptr);
  ASSERT_OK_AND_ASSIGN(int swept, backend_->Cleanup(options_.id));
  EXPECT_EQ(swept, 1);
  EXPECT_EQ(WaitEnd(*ours).reason, ExitReason::kSignaled);
  for (const std::string& id : {victim, forger}) {
    const std::string state = Squeue({"-j", id, "-o", "%T"});
    EXPECT_TRUE(state == "RUNNING" || state == "PENDING") << id << ": " << state;
  }
}

TEST_F(SlurmTest, EnvPassedExactly) {
  ASSERT_EQ(setenv("DEEPNEX_SLURM_TEST_CANARY", "leaked", 1), 0);
  ContainerSpec spec;
  spec.name = "env";
  spec.command = {"env", "-0"};
  spec.env = {{"PLAIN", "x"},
              {"QUOTES", "it's \"q\" $HOME `id` \\ ; | & *"},
              {"NEWLINE", "a\nb"},
              {"EMPTY", ""},
              {"dotted.name", "v"},
              {"PATH", "/usr/bin:/bin"}};
  auto run = StartOk(spec);
  unsetenv("DEEPNEX_SLURM_TEST_CANARY");
  ASSERT_NE(run, nullptr);
  EXPECT_TRUE(WaitEnd(*run).ok());
  std::map<std::string, std::string> got;
  for (absl::string_view entry : absl::StrSplit(LogsOf(*run), '\0', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(entry, absl::MaxSplits('=', 1));
    got.insert(kv);
  }
  std::map<std::string, std::string> expected = spec.env;
  expected[kLauncherIdEnv] = options_.id;
  std::map<std::string, std::string> ours, slurms;
  for (const auto& [k, v] : got) {
    (expected.count(k) ? ours : slurms)[k] = v;
  }
  EXPECT_EQ(ours, expected);
  // Everything else is Slurm's own.
  std::set<std::string> others;
  for (const auto& [k, v] : slurms) {
    if (!absl::StartsWith(k, "SLURM")) others.insert(k);
  }
  // PWD: the job script's shell exports it.
  EXPECT_EQ(others, (std::set<std::string>{"ENVIRONMENT", "HOSTNAME", "PWD", "TMPDIR"}));
  EXPECT_EQ(slurms["SLURM_JOB_ID"], run->id());
}

TEST_F(SlurmTest, ResourcesAndPlacementFlags) {
  ContainerSpec spec = Sh("res", "pwd");
  spec.cpus = 1.5;
  spec.memory = (300 << 20) + 1;
  spec.working_dir = scratch_.path();
  auto run = StartOk(spec);
  ASSERT_NE(run, nullptr);
  std::string record = JobRecord(*run);
  EXPECT_THAT(record, HasSubstr("NumCPUs=2"));
  EXPECT_THAT(record, HasSubstr("MinMemoryNode=301M"));
  EXPECT_THAT(record, HasSubstr("JobName=" + RunName(options_.id, "res", 0)));
  EXPECT_THAT(record, HasSubstr("Partition=debug"));
  EXPECT_THAT(record, HasSubstr("Requeue=0"));
  EXPECT_TRUE(WaitEnd(*run).ok());
  EXPECT_EQ(LogsOf(*run), scratch_.path() + "\n");
}

// deepnex-central's run_as: root's launcher submits the job as the user
// (sbatch --uid --gid), whose HOME and USER it gets and whose home is its
// working directory; the output file is made theirs, as Slurm opens it as
// the user.
TEST_F(SlurmTest, RunAsSubmitsTheJobAsTheUser) {
  if (geteuid() != 0) GTEST_SKIP() << "sbatch --uid needs root";
  ASSERT_EQ(chmod(scratch_.path().c_str(), 0755), 0);
  ContainerSpec spec = Sh("user", "id -u; id -g; echo $HOME $USER; pwd");
  spec.run_as = RunAs{65534, 65534, "nobody", "/"};
  auto run = StartOk(spec);
  ASSERT_NE(run, nullptr);
  EXPECT_THAT(JobRecord(*run), HasSubstr("(65534) GroupId="));
  EXPECT_EQ(WaitEnd(*run).ToString(), "exited(0)");
  EXPECT_EQ(LogsOf(*run), "65534\n65534\n/ nobody\n/\n");
  struct stat st;
  ASSERT_EQ(stat((scratch_.path() + "/" + RunName(options_.id, "user", 0) + "/output.log").c_str(),
                 &st),
            0);
  EXPECT_EQ(st.st_uid, 65534u);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

// deepnex-central and its agents make their launcher's state directory
// private (Launcher::Create gives it StateDirMode), and slurmstepd,
// which opens a job's output as the job's user, could not reach it there:
// every job of a mapped user failed. The slurm backend's state directory is
// passable, not listable, and nothing in it but the user's own output is
// readable by anyone but its owner.
TEST_F(SlurmTest, RunAsWorksInAPrivateStateDirWhereOthersReadNothing) {
  if (geteuid() != 0) GTEST_SKIP() << "sbatch --uid needs root";
  ASSERT_EQ(chmod(scratch_.path().c_str(), 0755), 0);
  LauncherOptions o = options_;
  o.state_dir = scratch_.path() + "/state";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Launcher> launcher, Launcher::Create(o));
  // Held running (its run directory goes when it ends) until the gate.
  const std::string gate = scratch_.path() + "/gate";
  ContainerSpec spec = Sh("private", "id -u; echo $SECRET; while [ ! -e " + gate +
                                         " ]; do sleep 0.05; done");
  spec.env["SECRET"] = "s3cret";
  spec.run_as = RunAs{65534, 65534, "nobody", "/"};
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Handle> h, launcher->Start(spec));
  EXPECT_TRUE(WaitFor([&] { return h->Logs().value_or("") == "65534\ns3cret\n"; }, kJobEnd,
                      "the job's output"))
      << h->Logs().value_or("");
  struct stat st;
  ASSERT_EQ(stat(o.state_dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0711u);
  std::set<std::string> files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(o.state_dir)) {
    if (!entry.is_regular_file() || entry.path().filename() == "launcher.lock") continue;
    ASSERT_EQ(stat(entry.path().c_str(), &st), 0);
    const bool output = entry.path().filename() == "output.log";
    EXPECT_EQ(st.st_uid, output ? 65534u : 0u) << entry.path();
    EXPECT_EQ(st.st_mode & 077, 0u) << entry.path() << " is readable by others";
    files.insert(entry.path().filename());
  }
  // The record, the container's log, and its run's job script and output.
  EXPECT_EQ(files.size(), 4u) << absl::StrJoin(files, " ");
  ASSERT_THAT(WriteFileAtomically(gate, ""), IsOk());
  ASSERT_OK_AND_ASSIGN(ExitStatus e, h->Wait(kJobEnd));
  EXPECT_EQ(e.ToString(), "exited(0)");
  ASSERT_THAT(launcher->Remove("private"), IsOk());
  // A fresh state directory (the daemons' default) is made passable too.
  LauncherOptions fresh = options_;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Launcher> temporary, Launcher::Create(fresh));
  spec.name = "fresh";
  spec.command = {"id", "-u"};
  ASSERT_OK_AND_ASSIGN(h, temporary->Start(spec));
  ASSERT_OK_AND_ASSIGN(e, h->Wait(kJobEnd));
  EXPECT_EQ(e.ToString(), "exited(0)");
  EXPECT_EQ(h->Logs().value_or(""), "65534\n");
  ASSERT_THAT(temporary->Remove("fresh"), IsOk());
}

// slurmstepd, unable to enter the working directory as the user, ran the
// job in /tmp instead; the job now fails, saying why.
TEST_F(SlurmTest, AWorkingDirTheUserCannotEnterFailsTheJob) {
  if (geteuid() != 0) GTEST_SKIP() << "sbatch --uid needs root";
  ASSERT_EQ(chmod(scratch_.path().c_str(), 0755), 0);
  const std::string closed = scratch_.path() + "/closed";
  ASSERT_EQ(mkdir(closed.c_str(), 0700), 0);
  ContainerSpec spec = Sh("closed", "pwd");
  spec.run_as = RunAs{65534, 65534, "nobody", "/"};
  spec.working_dir = closed;
  auto run = StartOk(spec);
  ASSERT_NE(run, nullptr);
  EXPECT_EQ(WaitEnd(*run).ToString(), "exited(125)");
  EXPECT_THAT(LogsOf(*run), HasSubstr("env: cannot change directory to '" + closed +
                                      "': Permission denied"));
}

// Paths that Slurm or env(1) read as something else are taken as they are:
// a run directory with '%' (sbatch expands %u and %j in --output, and the
// job failed to open its log), a program under a directory with '=' (env
// took it for one more variable and ran the next word instead).
TEST_F(SlurmTest, PercentInTheRunDirAndEqualsInTheProgramsPathAreTakenLiterally) {
  const std::string dir = scratch_.path() + "/d=1";
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  const std::string prog = dir + "/prog";
  ASSERT_THAT(WriteFileAtomically(prog, "#!/bin/sh\necho prog \"$@\"\n"), IsOk());
  ASSERT_EQ(chmod(prog.c_str(), 0755), 0);
  ContainerSpec spec;
  spec.name = "literal";
  spec.command = {prog, "echo", "NOT THE PROGRAM"};
  auto run = StartOk(spec, nullptr, "", "run-%u-%j");
  ASSERT_NE(run, nullptr);
  EXPECT_EQ(WaitEnd(*run).ToString(), "exited(0)");
  EXPECT_EQ(LogsOf(*run), "prog echo NOT THE PROGRAM\n");
  // Slurm drops a backslash from the output path and then expands '%'
  // again: refused, where the job ended by signal 53 with no output.
  spec.name = "backslash";
  RunContext context = ContextFor(spec, "", "run-a\\b");
  EXPECT_THAT(backend_->Start(spec, context),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("holds a '\\', which Slurm drops from a job's output path")));
}

// Slurm takes a --comment of at most 1000 bytes; past that sbatch said
// "Pathname of a file, directory or other parameter too long", echoing the
// whole command line and naming no field.
TEST_F(SlurmTest, LabelsPastWhatAJobsCommentHoldsAreRefusedNamingThem) {
  ContainerSpec spec = Sh("labelled", "true");
  spec.labels["note"] = std::string(1000, 'x');
  EXPECT_THAT(backend_->Start(spec, ContextFor(spec)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("spec.labels: the Slurm job's comment (the labels, with "
                                       "deepnex.launcher and deepnex.name) would be "),
                             HasSubstr(" bytes; Slurm takes at most 1000"))));
}

TEST_F(SlurmTest, NodesAreTheClustersAndTheAllocationsNodeIsTheNodelist) {
  // tests/launch/slurm.sh: one node, named `hostname -s`, 8 CPUs, 2000 MB,
  // 4 GPUs.
  const std::string host = test::FixtureFor("slurm").node;
  ASSERT_OK_AND_ASSIGN(std::vector<gpu::Node> nodes, backend_->Nodes());
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_EQ(nodes[0].name, host);
  EXPECT_EQ(nodes[0].cpus, 8);
  EXPECT_EQ(nodes[0].memory, 2000ull << 20);
  EXPECT_EQ(nodes[0].gpus.size(), 4u);

  ContainerSpec spec = OnGpus(Sh("placed", "true"), 1);
  spec.allocation->node = host;
  auto run = StartOk(spec);
  ASSERT_NE(run, nullptr);
  EXPECT_THAT(JobRecord(*run), HasSubstr("ReqNodeList=" + host + " "));
  EXPECT_TRUE(WaitEnd(*run).ok());

  // A node Slurm does not have is refused, not run elsewhere.
  spec.allocation->node = "deepnex-no-such-node";
  spec.name = "nowhere";
  EXPECT_THAT(backend_->Start(spec, ContextFor(spec)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("--nodelist=deepnex-no-such-node"),
                             HasSubstr("Invalid node name"))));
}

TEST_F(SlurmTest, ControllerSilentForAWhileIsNotALostJob) {
  // A backend on a copy of the config, which the test then breaks and mends.
  const std::string conf = scratch_.path() + "/copy.conf";
  ASSERT_OK_AND_ASSIGN(std::string config, ReadWholeFile(conf_, "slurm.conf"));
  ASSERT_OK(WriteFileAtomically(conf, config));
  LauncherOptions o = options_;
  o.slurm.env["SLURM_CONF"] = conf;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> backend, MakeSlurmBackend(o));
  const std::string go = scratch_.path() + "/go";
  auto run = StartOk(Sh("patient", "i=0; while [ ! -e " + go + " ] && [ $i -lt 300 ]; do "
                                   "sleep 0.1; i=$((i+1)); done"),
                     backend.get());
  ASSERT_NE(run, nullptr);
  ASSERT_TRUE(test::WaitUntil([&] { return JobState(*run) == "RUNNING"; }, kJobEnd));

  ASSERT_OK(WriteFileAtomically(conf, DeadConf()));
  absl::StatusOr<std::optional<ExitStatus>> e = run->Wait(1s);
  ASSERT_THAT(e, IsOk());
  EXPECT_FALSE(e->has_value());
  EXPECT_EQ(JobState(*run), "RUNNING");

  ASSERT_OK(WriteFileAtomically(conf, config));
  ASSERT_EQ(close(creat(go.c_str(), 0644)), 0);
  EXPECT_EQ(WaitEnd(*run).ToString(), "exited(0)");
}

TEST_F(SlurmTest, SpecsSlurmCannotRunAreRefused) {
  ContainerSpec spec = Sh("bad", "true");
  spec.image = "/nonexistent/rootfs";
  EXPECT_THAT(backend_->Check(spec), StatusIs(absl::StatusCode::kNotFound, HasSubstr("spec.image")));
  spec.image = "/";
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("use image \"host\"")));
  spec.image = "host";
  spec.mounts = {{"/tmp", "/data", true}};
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spec.mounts")));
  spec.mounts.clear();
  spec.network_none = true;
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spec.network_none")));
  spec.network_none = false;
  spec.pids_limit = 10;
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("spec.pids_limit: 10")));
  spec.pids_limit = 0;
  spec.working_dir = scratch_.path() + "/missing";
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound,
                       "spec.working_dir: \"" + spec.working_dir +
                           "\" is not a directory on this host"));
  spec.working_dir.clear();
  spec.command = {"deepnex-no-such-command"};
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("deepnex-no-such-command")));

  // More GPUs than the cluster has: sbatch refuses, and says so.
  RunContext context{options_.id, RunName(options_.id, "big", 0), scratch_.path(), 0, {}};
  EXPECT_THAT(backend_->Start(OnGpus(Sh("big", "true"), 5), context),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--gres=gpu:5")));
}

TEST_F(SlurmTest, UnusableClusterIsFailedPreconditionNamingWhatIsMissing) {
  LauncherOptions o = options_;
  o.slurm.bin_dir = scratch_.path();
  EXPECT_THAT(MakeSlurmBackend(o),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("slurm: sbatch not found in bin_dir " + scratch_.path())));
  o = options_;
  o.slurm.env["SLURM_CONF"] = scratch_.path() + "/missing.conf";
  EXPECT_THAT(MakeSlurmBackend(o),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("slurm: SLURM_CONF=" + scratch_.path() + "/missing.conf "
                                 "does not exist")));

  o.slurm.env["SLURM_CONF"] = scratch_.path() + "/dead.conf";
  ASSERT_OK(WriteFileAtomically(o.slurm.env["SLURM_CONF"], DeadConf()));
  EXPECT_THAT(MakeSlurmBackend(o),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("slurm: the controller does not answer: ")));

  o = options_;
  o.slurm.partition = "nosuch";
  EXPECT_THAT(MakeSlurmBackend(o),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("partition \"nosuch\" does not exist (partitions: debug)")));
  o.slurm.partition = "debug";
  EXPECT_THAT(MakeSlurmBackend(o), IsOk());
}

}  // namespace
}  // namespace deepnex::launch
