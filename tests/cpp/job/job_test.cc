// deepnex::job::Job on the process backend with real deepnex-ps servers.
#include "deepnex/job/job.h"

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "deepnex/collective/store.h"
#include "deepnex/gpu/central.h"
#include "deepnex/gpu/discovery.h"
#include "deepnex/gpu/jobs.h"
#include "job/elastic.h"
#include "launch/procfs.h"
#include "launch/util.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::job {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::deepnex::test::WaitFor;
using ::testing::HasSubstr;
using std::chrono::milliseconds;

// Every line a job printed, by who printed it.
struct Output {
  std::mutex mu;
  std::multimap<std::string, std::string> lines;
  std::function<void(const std::string&, const std::string&)> Sink() {
    return [this](const std::string& who, const std::string& line) {
      std::lock_guard<std::mutex> lock(mu);
      lines.emplace(who, line);
    };
  }
  std::function<void(const std::string&)> EventSink() {
    return [this](const std::string& message) {
      std::lock_guard<std::mutex> lock(mu);
      events.push_back(message);
    };
  }
  std::vector<std::string> Events() {
    std::lock_guard<std::mutex> lock(mu);
    return events;
  }
  // Forgets every line and event: a test's next job must not find the
  // last one's (its store address, say) before printing its own.
  void Clear() {
    std::lock_guard<std::mutex> lock(mu);
    lines.clear();
    events.clear();
  }
  std::vector<std::string> events;
  std::vector<std::string> Of(const std::string& who) {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<std::string> out;
    auto [b, e] = lines.equal_range(who);
    for (auto it = b; it != e; ++it) out.push_back(it->second);
    return out;
  }
};

class JobTest : public ::testing::Test {
 protected:
  JobOptions Options(std::vector<std::string> command) {
    JobOptions o;
    o.command = std::move(command);
    o.ps_binary = DEEPNEX_PS_BIN;
    o.cpus = 0;
    o.launcher.state_dir = dir_.path() + "/state";
    o.output = out_.Sink();
    o.on_event = out_.EventSink();
    return o;
  }

  ::deepnex::test::TempDir dir_;
  Output out_;
};

TEST_F(JobTest, WorkersGetTheJobEnvironmentAndTheirOutputIsPrefixed) {
  JobOptions o = Options({"sh", "-c",
                          "echo rank=$DEEPNEX_RANK/$DEEPNEX_WORLD_SIZE job=$DEEPNEX_JOB_ID "
                          "ps=${DEEPNEX_PS_ADDRS:+yes} store=${DEEPNEX_STORE_ADDR:+yes} "
                          "torch=$RANK/$WORLD_SIZE local=$LOCAL_RANK/$LOCAL_WORLD_SIZE "
                          "omp=$OMP_NUM_THREADS"});
  o.name = "envjob";
  o.workers = 2;
  o.env = {{"OMP_NUM_THREADS", "5"}};  // the user's, kept
  ASSERT_OK_AND_ASSIGN(JobResult r, RunJob(o));
  EXPECT_EQ(r.exit_code, 0);
  ASSERT_EQ(r.workers.size(), 2u);
  EXPECT_TRUE(r.workers[0].ok() && r.workers[1].ok());
  EXPECT_THAT(out_.Of("worker 0"),
              ::testing::Contains(
                  "rank=0/2 job=envjob ps=yes store=yes torch=0/2 local=0/2 omp=5"));
  EXPECT_THAT(out_.Of("worker 1"),
              ::testing::Contains(
                  "rank=1/2 job=envjob ps=yes store=yes torch=1/2 local=1/2 omp=5"));
  EXPECT_THAT(out_.Of("ps 0"), ::testing::Contains(HasSubstr("deepnex-ps listening on")));
}

// torchrun's variable, from the cores granted per worker (cpus 0: the
// allocator's one core), rounded down.
TEST_F(JobTest, OmpThreadsAreTheCoresGrantedPerWorker) {
  unsetenv("OMP_NUM_THREADS");
  std::vector<double> cpus = {0};
  if (std::thread::hardware_concurrency() >= 2) cpus.insert(cpus.end(), {1.5, 2});
  for (double c : cpus) {
    JobOptions o = Options({"sh", "-c", "echo omp=$OMP_NUM_THREADS"});
    o.mode = "allreduce";
    o.cpus = c;
    ASSERT_OK_AND_ASSIGN(JobResult r, RunJob(o));
    EXPECT_EQ(r.exit_code, 0);
  }
  std::vector<std::string> want = {"omp=1", "omp=1", "omp=2"};
  want.resize(cpus.size());
  EXPECT_EQ(out_.Of("worker 0"), want);
}

TEST_F(JobTest, AllreduceModeStartsNoParameterServer) {
  JobOptions o = Options({"sh", "-c", "echo ps=[$DEEPNEX_PS_ADDRS]"});
  o.mode = "allreduce";
  ASSERT_OK_AND_ASSIGN(JobResult r, RunJob(o));
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THAT(out_.Of("worker 0"), ::testing::Contains("ps=[]"));
  EXPECT_TRUE(out_.Of("ps 0").empty());
}

TEST_F(JobTest, AFailedWorkerEndsTheJobWithItsCodeAndStopsTheOthers) {
  JobOptions o = Options({"sh", "-c", "if [ $DEEPNEX_RANK = 1 ]; then exit 3; fi; sleep 60"});
  o.workers = 2;
  auto start = std::chrono::steady_clock::now();
  ASSERT_OK_AND_ASSIGN(auto job, Job::Create(o));
  ASSERT_OK(job->Start());
  ASSERT_OK_AND_ASSIGN(JobResult r, job->Wait(milliseconds(60000)));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_FALSE(r.stopped);
  // A Stop after its end changes nothing a later Wait says (it said
  // stopped, probe).
  ASSERT_OK(job->Stop(SIGTERM));
  ASSERT_OK_AND_ASSIGN(JobResult again, job->Wait(milliseconds(10000)));
  EXPECT_EQ(again.exit_code, 3);
  EXPECT_FALSE(again.stopped);
  EXPECT_EQ(r.workers[1].reason, launch::ExitReason::kExited);
  EXPECT_EQ(r.workers[1].code, 3);
  EXPECT_EQ(r.workers[0].reason, launch::ExitReason::kSignaled);
}

TEST_F(JobTest, AWorkerThatFailsOnceIsRestartedUnderOnFailure) {
  std::string marker = dir_.path() + "/failed-once";
  JobOptions o = Options(
      {"sh", "-c", "if [ ! -e " + marker + " ]; then touch " + marker + "; exit 5; fi; echo again"});
  ASSERT_OK_AND_ASSIGN(o.restart, launch::RestartPolicy::Parse("on-failure:2"));
  o.restart.backoff = milliseconds(100);
  o.mode = "allreduce";
  ASSERT_OK_AND_ASSIGN(JobResult r, RunJob(o));
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.workers[0].restarts, 1);
  EXPECT_THAT(out_.Of("worker 0"), ::testing::Contains("again"));
  EXPECT_THAT(out_.Events(),
              // The launcher's crash-loop floor, not the 100 ms asked for.
              ::testing::ElementsAre("worker 0 exited(5); restarting (1/2) in 1.0s"));
}

TEST_F(JobTest, StopEndsEveryProcessAndReleasesTheAllocations) {
  JobOptions o = Options({"sh", "-c", "sleep 600 & sleep 600"});
  o.name = "stopjob" + std::to_string(getpid());
  o.workers = 2;
  ASSERT_OK_AND_ASSIGN(auto job, Job::Create(o));
  ASSERT_THAT(job->Start(), IsOk());
  EXPECT_EQ(job->Allocations().size(), 2u);
  std::vector<std::string> names;
  for (const auto& h : job->Containers()) names.push_back(h->spec().name);
  // Named by the job, so that jobs sharing a state_dir or an engine differ.
  EXPECT_THAT(names, ::testing::ElementsAre(o.name + "-ps0", o.name + "-worker0",
                                            o.name + "-worker1"));
  EXPECT_THAT(job->Wait(milliseconds(200)), StatusIs(absl::StatusCode::kDeadlineExceeded));
  ASSERT_THAT(job->Stop(0), IsOk());
  EXPECT_TRUE(job->Allocations().empty());
  // A Wait after it (deepnex run's, after its signal handler's Stop) says
  // so, and tells of no worker "stopped from outside the job".
  ASSERT_OK_AND_ASSIGN(JobResult r, job->Wait(milliseconds(10000)));
  EXPECT_TRUE(r.stopped);
  EXPECT_THAT(out_.Events(), ::testing::IsEmpty());
  // Stop waits for each container's first process; the background sleeps
  // were killed, not waited for, and go a moment later.
  EXPECT_TRUE(WaitFor(
      [&] { return launch::ProcessesWithEnv(launch::kLauncherIdEnv, o.name).empty(); },
      std::chrono::seconds(60), "the job's processes to end"))
      << launch::ProcessesWithEnv(launch::kLauncherIdEnv, o.name).size() << " left";
  EXPECT_THAT(job->Stop(0), IsOk());  // idempotent
}

// The live processes labelled with launcher id `name`.
std::vector<pid_t> LiveProcessesOf(const std::string& name) {
  std::vector<pid_t> live;
  for (pid_t pid : launch::ProcessesWithEnv(launch::kLauncherIdEnv, name)) {
    if (launch::ProcessAlive(pid)) live.push_back(pid);
  }
  return live;
}

// The child of the kill -9 test: a trainer that runs a job and is killed.
void RunAJobAndDie(const std::string& name, const std::string& dir) {
  JobOptions o;
  o.name = name;
  o.command = {"sh", "-c",
               "echo up; setsid sleep 600 </dev/null >/dev/null 2>&1 & sleep 600"};
  o.workers = 2;
  o.cpus = 0;
  o.ps_binary = DEEPNEX_PS_BIN;
  o.registry_dir = dir + "/run";
  o.launcher.state_dir = dir + "/state";
  o.output = [](const std::string&, const std::string&) {};
  o.on_event = [](const std::string&) {};
  auto job = Job::Create(o);
  if (!job.ok() || !(*job)->Start().ok()) _exit(1);
  // ps0, and each worker's sh and two sleeps.
  WaitFor([&] { return LiveProcessesOf(name).size() >= 5; }, std::chrono::seconds(60), "");
  raise(SIGKILL);
}

// A C++ trainer killed with SIGKILL left its job's workers, a daemon of
// theirs and its parameter server running for ever: only Python's Job swept
// them (its own helper process). Now Job's sweeper does, for every program.
TEST(JobKilled, ItsProcessBackendContainersAreSwept) {
  // The death test's child is this test run again in a new process
  // ("threadsafe"), where the job may start gRPC, which a forked copy of a
  // process that had started it may not: it finds the name and directory
  // here.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::optional<::deepnex::test::TempDir> made;
  if (getenv("DEEPNEX_SWEPT_TEST_DIR") == nullptr) {
    made.emplace();
    setenv("DEEPNEX_SWEPT_TEST_DIR", made->path().c_str(), 1);
    setenv("DEEPNEX_SWEPT_TEST_JOB", absl::StrCat("swept", getpid()).c_str(), 1);
  }
  const std::string dir = getenv("DEEPNEX_SWEPT_TEST_DIR");
  const std::string name = getenv("DEEPNEX_SWEPT_TEST_JOB");
  EXPECT_EXIT(RunAJobAndDie(name, dir), ::testing::KilledBySignal(SIGKILL), "");
  unsetenv("DEEPNEX_SWEPT_TEST_DIR");
  unsetenv("DEEPNEX_SWEPT_TEST_JOB");
  EXPECT_TRUE(WaitFor([&] { return LiveProcessesOf(name).empty(); }, std::chrono::seconds(30),
                      "the killed job's processes to end"))
      << LiveProcessesOf(name).size() << " left";
  // What the test leaves, swept or not.
  ASSERT_OK_AND_ASSIGN(auto launcher, launch::Launcher::Create({}));
  launcher->Cleanup(name).IgnoreError();
}

// A job whose start waits in deepnex-central's queue says where, and a Stop
// from another thread (deepnex run's signal handler) ends that wait: the
// request leaves the queue and the record says what stopped the job. Before,
// Stop left Start waiting for a grant, which it then used.
class CentralJobTest : public ::deepnex::test::CentralFixture {
 protected:
  void SetUp() override {
    gpu::CentralServerOptions o = ServerOptions();
    o.allocator.fsync = false;
    ASSERT_OK_AND_ASSIGN(server_, gpu::CentralServer::Create(o));
    gpu::Node node;
    node.name = "n1";
    node.cpus = 8;
    node.memory = uint64_t{16} << 30;
    node.gpus.resize(2);
    for (gpu::Gpu& g : node.gpus) g.memory = uint64_t{80} << 30;
    ASSERT_OK(server_->allocator().AddNode(node));
  }
};

TEST_F(CentralJobTest, AStopWhileStartWaitsInTheQueueWithdrawsTheRequest) {
  auto alice = Client("alicetok");
  gpu::Request all;
  all.gpus = 2;
  ASSERT_OK_AND_ASSIGN(std::vector<gpu::Allocation> held, alice->AllocateGang(all));
  Output out;
  JobOptions o;
  o.command = {"echo", "ran"};
  o.name = "queuedjob";
  o.mode = "allreduce";
  o.gpus_per_worker = 1;
  o.memory = 64 << 20;
  o.central = server_->address();
  o.central_token = "alicetok";
  o.launcher.state_dir = dir_.path() + "/launch";
  o.registry_dir = dir_.path() + "/run";
  o.output = out.Sink();
  o.on_event = out.EventSink();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Job> job, Job::Create(o));
  absl::Status started;
  std::atomic<bool> returned{false};
  std::thread starting([&] {
    started = job->Start();
    returned = true;
  });
  const std::string queued =
      "job queuedjob: queued at position 1: waiting for 1 exclusive GPU (0 free on any eligible "
      "node)";
  const ::testing::AssertionResult said =
      WaitFor([&] { return out.Events() == std::vector<std::string>{queued}; },
              std::chrono::seconds(30), "the queued line");
  ASSERT_OK(job->Stop(SIGTERM));
  const ::testing::AssertionResult ended =
      WaitFor([&] { return returned.load(); }, std::chrono::seconds(30), "Start to return");
  // Else only a grant ends it.
  if (!ended) ASSERT_OK(alice->Release(held[0].id));
  starting.join();
  ASSERT_TRUE(ended);
  ASSERT_TRUE(said) << absl::StrJoin(out.Events(), "\n");
  EXPECT_THAT(started, StatusIs(absl::StatusCode::kCancelled,
                                HasSubstr("job queuedjob was stopped while it started")));
  ASSERT_OK_AND_ASSIGN(auto pending, alice->Pending());
  EXPECT_TRUE(pending.empty());
  ASSERT_OK(alice->Release(held[0].id));
  // Nothing granted afterwards to a request that is gone.
  ASSERT_OK_AND_ASSIGN(auto left, alice->Allocations());
  EXPECT_TRUE(left.empty());
  ASSERT_OK_AND_ASSIGN(auto jobs, gpu::JobsClient::Create(ClientOptions("alicetok")));
  ASSERT_OK_AND_ASSIGN(gpu::JobRecord record, jobs->Get("queuedjob"));
  EXPECT_EQ(record.state, gpu::JobState::kCancelled);
  EXPECT_EQ(record.exit_code, 128 + SIGTERM);
  EXPECT_EQ(record.message, "stopped by SIGTERM");
  EXPECT_TRUE(out.Of("worker 0").empty());
}

TEST_F(JobTest, MoreWorkersThanTheMachineHoldsIsRefusedNotQueued) {
  JobOptions o = Options({"true"});
  o.workers = 1000;
  o.cpus = 1;
  EXPECT_THAT(RunJob(o), StatusIs(absl::StatusCode::kResourceExhausted));
}

TEST_F(JobTest, BadOptionsNameTheFieldAndValue) {
  struct Case {
    std::function<void(JobOptions&)> edit;
    std::string message;
  };
  std::vector<Case> cases = {
      {[](JobOptions& o) { o.workers = 0; }, "workers: 0"},
      {[](JobOptions& o) { o.mode = "gossip"; }, "mode: \"gossip\""},
      {[](JobOptions& o) { o.mode = "ssp:x"; }, "mode: \"ssp:x\""},
      {[](JobOptions& o) { o.name = "Bad_Name"; }, "name: \"Bad_Name\""},
      // Escaped and cut: a probe's 300-character name came back whole, its
      // newline raw.
      {[](JobOptions& o) { o.name = "a\n" + std::string(300, 'b'); },
       "name: \"a\\n" + std::string(62, 'b') + "\"... is not a job name"},
      {[](JobOptions& o) { o.command.clear(); }, "command: empty"},
      // By the servers' own rules (the job's own refused an lr of 0).
      {[](JobOptions& o) { o.lr = -1; }, "optimizer lr=-1: must be finite and >= 0"},
      {[](JobOptions& o) { o.momentum = -0.5; }, "optimizer momentum=-0.5: must be"},
      // Once refused only by the started parameter servers, after allocating.
      {[](JobOptions& o) { o.optimizer = "adamm"; }, "optimizer: unknown \"adamm\""},
      {[](JobOptions& o) { o.ps = 0; }, "ps: 0"},
      {[](JobOptions& o) { o.cpus = -2; }, "cpus: -2"},
      {[](JobOptions& o) { o.min_workers = -1; }, "min_workers: -1 is below 1"},
      {[](JobOptions& o) { o.min_workers = 2; }, "min_workers: 2 is more than workers"},
      {[](JobOptions& o) { o.workers = 2; o.min_workers = 1; o.nodes = 2; }, "nodes: 2 with an elastic"},
  };
  for (const auto& c : cases) {
    JobOptions o = Options({"true"});
    c.edit(o);
    EXPECT_THAT(Job::Create(o), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message)))
        << c.message;
  }
  JobOptions o = Options({"true"});
  o.ps_binary = "/nonexistent/deepnex-ps";
  EXPECT_THAT(Job::Create(o), StatusIs(absl::StatusCode::kNotFound, HasSubstr("deepnex-ps")));
}


// ---- elastic jobs (min_workers)

// An elastic worker: says who it is, its generation and where the job's
// store is, then waits at the gate; <gate>.<id> holding a number makes that
// worker exit with it.
std::vector<std::string> ElasticWorker(const std::string& gate) {
  return {"sh", "-c",
          "echo \"$DEEPNEX_WORKER_ID rank=$DEEPNEX_RANK/$DEEPNEX_WORLD_SIZE "
          "gen=$DEEPNEX_ELASTIC_GENERATION elastic=$DEEPNEX_ELASTIC\"; "
          "echo \"store $DEEPNEX_STORE_ADDR $DEEPNEX_TOKEN\"; "
          "while [ ! -e " + gate + " ]; do if [ -e " + gate + ".$DEEPNEX_WORKER_ID ]; then "
          "exit $(cat " + gate + ".$DEEPNEX_WORKER_ID); fi; sleep 0.05; done"};
}

class ElasticJobTest : public JobTest {
 protected:
  JobOptions Elastic(int min, int max) {
    JobOptions o = Options(ElasticWorker(gate_));
    o.mode = "allreduce";
    o.min_workers = min;
    o.workers = max;
    return o;
  }
  // The first line worker `id` ("worker 2" prints as w2) printed that starts
  // with `prefix`, once there is one.
  std::string Line(int id, const std::string& prefix) {
    std::string found;
    EXPECT_TRUE(WaitFor(
        [&] {
          for (const auto& l : out_.Of(absl::StrCat("worker ", id))) {
            if (l.rfind(prefix, 0) == 0) found = l;
          }
          return !found.empty();
        },
        std::chrono::seconds(60), absl::StrCat("worker ", id, ": ", prefix)));
    return found;
  }
  // A client of the job's store, from what worker 0 printed; null (the
  // failure recorded) when there is none, so that the test can end and its
  // job stop its workers rather than the process abort and leave them.
  std::unique_ptr<collective::StoreClient> Store() {
    std::vector<std::string> f = absl::StrSplit(Line(0, "store "), ' ');
    if (f.size() < 3) return nullptr;
    collective::StoreClientOptions co;
    co.address = f[1];
    co.token = f[2];
    auto c = collective::StoreClient::Create(co);
    EXPECT_THAT(c.status(), IsOk());
    return c.ok() ? std::move(*c) : nullptr;
  }
  void Exit(const std::string& id, int code) {
    std::ofstream(gate_ + "." + id) << code;
  }
  ::testing::AssertionResult GenerationIs(collective::StoreClient* store, int g) {
    return WaitFor(
        [&] {
          auto v = store->Get(kElasticGenerationKey, milliseconds(1000));
          return v.ok() && *v == std::to_string(g);
        },
        std::chrono::seconds(60), absl::StrCat("generation ", g));
  }
  std::string Members(collective::StoreClient* store, int g) {
    auto v = store->Get(absl::StrCat(kElasticMembersPrefix, g), milliseconds(1000));
    return v.ok() ? *v : v.status().ToString();
  }

  // Events with when they were told, for delays between them.
  void TimeEvents(JobOptions* o) {
    o->on_event = [this](const std::string& e) {
      std::lock_guard<std::mutex> lock(told_mu_);
      told_.emplace_back(std::chrono::steady_clock::now(), e);
    };
  }
  std::vector<std::string> TimedEvents() {
    std::lock_guard<std::mutex> lock(told_mu_);
    std::vector<std::string> out;
    for (const auto& [at, e] : told_) out.push_back(e);
    return out;
  }
  std::chrono::steady_clock::time_point EventTime(size_t i) {
    std::lock_guard<std::mutex> lock(told_mu_);
    return told_.at(i).first;
  }

  const std::string gate_ = dir_.path() + "/gate";
  std::mutex told_mu_;
  std::vector<std::pair<std::chrono::steady_clock::time_point, std::string>> told_;
};

// On this machine (room for both): w0 alone in generation 1, w1 joins in 2;
// w1 fails and the job goes on with w0 (3), then grows back with a new id,
// w2 (4). The runner publishes each membership before it is used.
TEST_F(ElasticJobTest, GrowsToMaxShrinksWhenAWorkerFailsAndGrowsBack) {
  JobOptions o = Elastic(1, 2);
  o.name = "elastic" + std::to_string(getpid());
  ASSERT_OK_AND_ASSIGN(auto job, Job::Create(o));
  ASSERT_THAT(job->Start(), IsOk());
  EXPECT_EQ(Line(0, "w0 "), "w0 rank=0/1 gen=1 elastic=1:2");
  std::unique_ptr<collective::StoreClient> store = Store();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(Line(1, "w1 "), "w1 rank=1/2 gen=2 elastic=1:2");
  ASSERT_TRUE(GenerationIs(store.get(), 2));
  EXPECT_EQ(Members(store.get(), 1), "w0");
  EXPECT_EQ(Members(store.get(), 2), "w0,w1");
  EXPECT_EQ(job->Allocations().size(), 2u);

  Exit("w1", 3);
  EXPECT_EQ(Line(2, "w2 "), "w2 rank=1/2 gen=4 elastic=1:2");
  ASSERT_TRUE(GenerationIs(store.get(), 4));
  EXPECT_EQ(Members(store.get(), 3), "w0");
  EXPECT_EQ(Members(store.get(), 4), "w0,w2");
  const std::string host = job->Allocations().at(0).node;
  EXPECT_THAT(out_.Events(),
              ::testing::ElementsAre(
                  "job resized from 1 to 2 workers (generation 2): worker w1 joined on node \"" +
                      host + "\"",
                  "job resized from 2 to 1 workers (generation 3): worker w1 exited(3)",
                  "job resized from 1 to 2 workers (generation 4): worker w2 joined on node \"" +
                      host + "\""));

  std::ofstream(gate_) << "";
  ASSERT_OK_AND_ASSIGN(JobResult r, job->Wait(milliseconds(60000)));
  EXPECT_EQ(r.exit_code, 0);
  ASSERT_EQ(r.workers.size(), 3u);  // every worker ever started, by id
  EXPECT_EQ(r.workers[1].code, 3);
  EXPECT_TRUE(r.workers[0].ok() && r.workers[2].ok());
  EXPECT_TRUE(job->Allocations().empty());
}

// A stopped elastic job's Wait never saw its membership end: `deepnex run
// --workers 1:2` waited for ever after Ctrl-C (probe). Its allocations are
// the job's again once it stops: the members' were left held.
TEST_F(ElasticJobTest, AStoppedElasticJobsWaitReturnsAndItsAllocationsAreReleased) {
  JobOptions o = Elastic(1, 2);
  o.name = "elasticstop" + std::to_string(getpid());
  ASSERT_OK_AND_ASSIGN(auto job, Job::Create(o));
  ASSERT_THAT(job->Start(), IsOk());
  EXPECT_EQ(Line(1, "w1 "), "w1 rank=1/2 gen=2 elastic=1:2");
  EXPECT_EQ(job->Allocations().size(), 2u);
  ASSERT_OK(job->Stop(SIGTERM));
  EXPECT_TRUE(job->Allocations().empty());
  ASSERT_OK_AND_ASSIGN(JobResult r, job->Wait(milliseconds(10000)));
  EXPECT_TRUE(r.stopped);
  // As a job of fixed size says (it said 0, a success, probe).
  EXPECT_EQ(r.exit_code, 128 + SIGTERM);
}

// A worker that exits 0 has finished: not dropped, not replaced.
TEST_F(ElasticJobTest, AWorkerThatExitsZeroIsNotReplaced) {
  JobOptions o = Elastic(1, 2);
  ASSERT_OK_AND_ASSIGN(auto job, Job::Create(o));
  ASSERT_THAT(job->Start(), IsOk());
  std::unique_ptr<collective::StoreClient> store = Store();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(GenerationIs(store.get(), 2));
  Exit("w1", 0);
  ASSERT_TRUE(WaitFor(
      [&] {
        for (const auto& h : job->Containers()) {
          if (h->spec().name == job->name() + "-worker1") return h->Status().last_exit.has_value();
        }
        return false;
      },
      std::chrono::seconds(60), "w1 to exit"));
  // No replacement comes: the loop has looked several times by then.
  EXPECT_FALSE(WaitFor([&] { return !out_.Of("worker 2").empty(); }, milliseconds(1500),
                       "a worker 2"));
  EXPECT_EQ(Members(store.get(), 2), "w0,w1");
  std::ofstream(gate_) << "";
  ASSERT_OK_AND_ASSIGN(JobResult r, job->Wait(milliseconds(60000)));
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.workers.size(), 2u);
  EXPECT_EQ(out_.Events().size(), 1u);  // the growth only
}

// Room for two workers of this size, not three: MIN 2 MAX 3 runs with two,
// and one failing leaves fewer than MIN: the job fails with its code, or
// under a restart policy gets a replacement (a new id). Meanwhile the one
// left does not train alone: its generation comes with the replacement
// (generation 2 was w0 alone, below MIN).
TEST_F(ElasticJobTest, BelowMinTheJobFailsOrRestartsByPolicy) {
  ASSERT_OK_AND_ASSIGN(gpu::Node node, gpu::LocalNode());
  for (bool restart : {false, true}) {
    SCOPED_TRACE(restart ? "on-failure:1" : "never");
    out_.Clear();
    JobOptions o = Elastic(2, 3);
    o.memory = node.memory * 2 / 5;
    if (restart) {
      ASSERT_OK_AND_ASSIGN(o.restart, launch::RestartPolicy::Parse("on-failure:1"));
    }
    std::filesystem::remove(gate_);
    std::filesystem::remove(gate_ + ".w1");
    ASSERT_OK_AND_ASSIGN(auto job, Job::Create(o));
    ASSERT_THAT(job->Start(), IsOk());
    std::unique_ptr<collective::StoreClient> store = Store();
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(Members(store.get(), 1), "w0,w1");
    Exit("w1", 5);
    if (!restart) {
      ASSERT_OK_AND_ASSIGN(JobResult r, job->Wait(milliseconds(60000)));
      EXPECT_EQ(r.exit_code, 5);
      EXPECT_THAT(out_.Events(), ::testing::IsEmpty());
      continue;
    }
    // w0 alone is below MIN: no generation of it, the next has w2 too.
    EXPECT_EQ(Line(2, "w2 "), "w2 rank=1/2 gen=2 elastic=2:3");
    ASSERT_TRUE(GenerationIs(store.get(), 2));
    EXPECT_EQ(Members(store.get(), 2), "w0,w2");
    std::ofstream(gate_) << "";
    ASSERT_OK_AND_ASSIGN(JobResult r, job->Wait(milliseconds(60000)));
    EXPECT_EQ(r.exit_code, 0);
    EXPECT_THAT(out_.Events(),
                ::testing::IsSupersetOf(
                    {"worker w1 exited(5); restarting (1/1) in 1 s: a new worker is asked for",
                     "job resized from 2 to 1 workers (below MIN 2: the members wait for a "
                     "replacement): worker w1 exited(5)"}));
  }
}

// Every worker after w0 fails at once: the job grows back after each under
// the launcher's crash-loop backoff (floor 1 s doubling to its 2 s cap), not
// every second for as long as it runs (probe), and a worker that ran
// restart_backoff_reset starts the doubling over.
TEST_F(ElasticJobTest, WorkersThatKeepFailingAreBackedOffAndAHealthyRunStartsOver) {
  JobOptions o = Elastic(1, 2);
  o.launcher.restart_backoff_floor = milliseconds(1000);
  o.launcher.restart_backoff_cap = milliseconds(2000);
  o.launcher.restart_backoff_reset = milliseconds(3000);
  o.restart.max_backoff = milliseconds(2000);  // the policy's may lift the cap
  TimeEvents(&o);
  for (const char* id : {"w1", "w2", "w3"}) Exit(id, 3);
  ASSERT_OK_AND_ASSIGN(auto job, Job::Create(o));
  ASSERT_THAT(job->Start(), IsOk());
  EXPECT_EQ(Line(4, "w4 "), "w4 rank=1/2 gen=8 elastic=1:2");
  // w4 runs past restart_backoff_reset, then fails: one step, no loop told.
  std::this_thread::sleep_for(milliseconds(3500));
  Exit("w4", 3);
  EXPECT_EQ(Line(5, "w5 "), "w5 rank=1/2 gen=10 elastic=1:2");
  std::ofstream(gate_) << "";
  ASSERT_OK_AND_ASSIGN(JobResult r, job->Wait(milliseconds(60000)));
  EXPECT_EQ(r.exit_code, 0);

  const std::vector<std::string> events = TimedEvents();
  auto joined = [&](int id) { return HasSubstr(absl::StrCat("worker w", id, " joined")); };
  auto left = [&](int id) { return ::testing::EndsWith(absl::StrCat("worker w", id, " exited(3)")); };
  const char* loop = " workers in a row failed soon after their start: the job grows again in ";
  EXPECT_THAT(events,
              ::testing::ElementsAre(
                  joined(1), left(1), joined(2),
                  absl::StrCat("worker w2 exited(3); 2", loop, "2 s at the earliest (crash-loop "
                               "backoff)"),
                  left(2), joined(3),
                  absl::StrCat("worker w3 exited(3); 3", loop, "2 s at the earliest (crash-loop "
                               "backoff)"),
                  left(3), joined(4), left(4), joined(5)));
  // Each growth back came no sooner than its backoff after the failure was
  // told (the delay runs from before the telling).
  auto at = [&](size_t i) { return EventTime(i); };
  EXPECT_GE(at(2) - at(1), milliseconds(1000));
  EXPECT_GE(at(5) - at(4), milliseconds(2000));
  EXPECT_GE(at(8) - at(7), milliseconds(2000));
  EXPECT_GE(at(10) - at(9), milliseconds(1000));
}

// w0 fails while the job's first growth waits to settle: that growth gives
// its grant back, and the replacement comes after the backoff the restart
// event told (probe: 0.2 s after "in 1 s"), as 0 to 1 (it said 1 to 2).
TEST_F(ElasticJobTest, AFailureFoundWhileGrowingWaitsItsBackoffToo) {
  JobOptions o = Elastic(1, 2);
  ASSERT_OK_AND_ASSIGN(o.restart, launch::RestartPolicy::Parse("on-failure:1"));
  TimeEvents(&o);
  ASSERT_OK_AND_ASSIGN(auto job, Job::Create(o));
  ASSERT_THAT(job->Start(), IsOk());
  EXPECT_EQ(Line(0, "w0 "), "w0 rank=0/1 gen=1 elastic=1:2");
  Exit("w0", 3);
  EXPECT_THAT(Line(1, "w1 "), HasSubstr("w1 rank=0/1 gen="));
  std::ofstream(gate_) << "";
  ASSERT_OK_AND_ASSIGN(JobResult r, job->Wait(milliseconds(60000)));
  EXPECT_EQ(r.exit_code, 0);
  const std::vector<std::string> events = TimedEvents();
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events[0], "worker w0 exited(3); restarting (1/1) in 1 s: a new worker is asked for");
  EXPECT_THAT(events[1], HasSubstr("resized from 1 to 0 workers"));
  EXPECT_THAT(events[2], HasSubstr("resized from 0 to 1 workers"));
  EXPECT_THAT(events[2], HasSubstr("worker w1 joined"));
  EXPECT_GE(EventTime(2) - EventTime(0), milliseconds(1000));
}

// Room for one: MIN 1's only worker fails, and under on-failure the job
// waits with none for its replacement, which comes as rank 0 of the next
// generation.
TEST_F(ElasticJobTest, TheOnlyWorkerFailingIsReplacedUnderThePolicy) {
  ASSERT_OK_AND_ASSIGN(gpu::Node node, gpu::LocalNode());
  JobOptions o = Elastic(1, 2);
  o.memory = node.memory * 3 / 5;
  ASSERT_OK_AND_ASSIGN(o.restart, launch::RestartPolicy::Parse("on-failure:1"));
  ASSERT_OK_AND_ASSIGN(auto job, Job::Create(o));
  ASSERT_THAT(job->Start(), IsOk());
  std::unique_ptr<collective::StoreClient> store = Store();
  ASSERT_NE(store, nullptr);
  // Waited for all along: the gap with no member is not the job's end.
  std::thread replaced([&] {
    EXPECT_EQ(Line(1, "w1 "), "w1 rank=0/1 gen=2 elastic=1:2");
    EXPECT_TRUE(GenerationIs(store.get(), 2));
    EXPECT_EQ(Members(store.get(), 2), "w1");
    std::ofstream(gate_) << "";
  });
  Exit("w0", 5);
  absl::StatusOr<JobResult> waited = job->Wait(milliseconds(60000));
  std::ofstream(gate_) << "";
  replaced.join();
  ASSERT_OK_AND_ASSIGN(JobResult r, std::move(waited));
  EXPECT_EQ(r.exit_code, 0);
  ASSERT_EQ(r.workers.size(), 2u);
  EXPECT_EQ(r.workers[0].code, 5);
}

// A member alive to the launcher and deaf to its peers (SIGSTOP, a hang):
// their collectives fail, they report (kElasticWaitingPrefix) and wait for
// the next generation. The runner stops and drops the members that reported
// nothing within the workers' DEEPNEX_ELASTIC_TIMEOUT of the first report.
// It kept them: the survivors timed out and exited 1, and the job dropped
// its healthy rank 0 and kept the stalled one (probe). The shell worker w1
// here is such a member: it never reports.
TEST_F(ElasticJobTest, AMemberThatReportsNothingWhileItsPeersDoIsStoppedAndDropped) {
  JobOptions o = Elastic(1, 2);
  o.env["DEEPNEX_ELASTIC_TIMEOUT"] = "1.5";
  ASSERT_OK_AND_ASSIGN(auto job, Job::Create(o));
  ASSERT_THAT(job->Start(), IsOk());
  std::unique_ptr<collective::StoreClient> store = Store();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(Line(1, "w1 "), "w1 rank=1/2 gen=2 elastic=1:2");
  ASSERT_TRUE(GenerationIs(store.get(), 2));
  const auto reported = std::chrono::steady_clock::now();
  ASSERT_THAT(store->Set(absl::StrCat(kElasticWaitingPrefix, "2/w0"), "timed out"), IsOk());
  ASSERT_TRUE(GenerationIs(store.get(), 3));
  EXPECT_GE(std::chrono::steady_clock::now() - reported, milliseconds(1500));
  EXPECT_EQ(Members(store.get(), 3), "w0");
  // Its capacity is free again: a new worker.
  EXPECT_EQ(Line(2, "w2 "), "w2 rank=1/2 gen=4 elastic=1:2");
  std::ofstream(gate_) << "";
  ASSERT_OK_AND_ASSIGN(JobResult r, job->Wait(milliseconds(60000)));
  EXPECT_EQ(r.exit_code, 0);
  ASSERT_EQ(r.workers.size(), 3u);
  EXPECT_FALSE(r.workers[1].ok());  // stopped
  EXPECT_TRUE(r.workers[0].ok() && r.workers[2].ok());
  EXPECT_THAT(out_.Events(),
              ::testing::Contains("job resized from 2 to 1 workers (generation 3): worker w1 "
                                  "stalled: no failed collective reported within 1.5 s of w0's "
                                  "in generation 2"));
}

// Every member reports (the network between them failed, not one of them):
// the same members form the next generation, no one is dropped; a failure
// that recurs at once is paced by the crash-loop backoff (floor 1 s), so
// that one that never heals ends when the workers' wait does. A generation
// that ran restart_backoff_reset before its failure starts the doubling
// over, as a worker that ran long does; it was measured from the generation
// just formed, never long, so each network blip of a long job waited
// longer than the one before.
TEST_F(ElasticJobTest, EveryMemberReportingAFailedCollectiveFormsTheSameMembersAgain) {
  JobOptions o = Elastic(1, 2);
  o.env["DEEPNEX_ELASTIC_TIMEOUT"] = "1";
  o.launcher.restart_backoff_reset = milliseconds(2500);
  TimeEvents(&o);
  ASSERT_OK_AND_ASSIGN(auto job, Job::Create(o));
  ASSERT_THAT(job->Start(), IsOk());
  std::unique_ptr<collective::StoreClient> store = Store();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(Line(1, "w1 "), "w1 rank=1/2 gen=2 elastic=1:2");
  auto fail = [&](int g) {
    for (const char* id : {"w0", "w1"}) {
      ASSERT_THAT(store->Set(absl::StrCat(kElasticWaitingPrefix, g, "/", id), "reset"), IsOk());
    }
  };
  for (int g : {2, 3}) {
    ASSERT_TRUE(GenerationIs(store.get(), g));
    fail(g);
  }
  ASSERT_TRUE(GenerationIs(store.get(), 4));
  EXPECT_EQ(Members(store.get(), 3), "w0,w1");
  EXPECT_EQ(Members(store.get(), 4), "w0,w1");
  std::this_thread::sleep_for(milliseconds(3000));  // generation 4 runs past the reset
  fail(4);
  ASSERT_TRUE(GenerationIs(store.get(), 5));
  std::ofstream(gate_) << "";
  ASSERT_OK_AND_ASSIGN(JobResult r, job->Wait(milliseconds(60000)));
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.workers.size(), 2u);
  const std::vector<std::string> events = TimedEvents();
  auto again = [](int from, int to) {
    return absl::StrCat("elastic: every member reported a failed collective in generation ",
                        from, "; they form generation ", to, " again");
  };
  ASSERT_EQ(events.size(), 4u);
  EXPECT_THAT(events[0], HasSubstr("worker w1 joined"));
  EXPECT_EQ(events[1], again(2, 3));
  EXPECT_EQ(events[2], again(3, 4) + "; 2 failures in a row soon after forming: the next re-form "
                                     "in 2 s at the earliest (crash-loop backoff)");
  EXPECT_GE(EventTime(2) - EventTime(1), milliseconds(1000));
  EXPECT_EQ(events[3], again(4, 5));
}

// A worker's training function returned (kElasticDoneKey): a member that
// fails after that frees capacity the job does not grow into, since a
// joiner would wait for peers that never form its generation.
TEST_F(ElasticJobTest, TheJobGrowsNoMoreOnceAWorkerSaysTheTrainingIsOver) {
  JobOptions o = Elastic(1, 2);
  ASSERT_OK_AND_ASSIGN(auto job, Job::Create(o));
  ASSERT_THAT(job->Start(), IsOk());
  std::unique_ptr<collective::StoreClient> store = Store();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(Line(1, "w1 "), "w1 rank=1/2 gen=2 elastic=1:2");
  ASSERT_THAT(store->Set(kElasticDoneKey, "w0"), IsOk());
  // Read at the next look (every 200 ms), within w1's backoff (1 s).
  Exit("w1", 3);
  ASSERT_TRUE(GenerationIs(store.get(), 3));
  EXPECT_EQ(Members(store.get(), 3), "w0");
  // Past the settle (0.6 s) and backoff (1 s) a growth would wait.
  std::this_thread::sleep_for(milliseconds(3000));
  std::ofstream(gate_) << "";
  ASSERT_OK_AND_ASSIGN(JobResult r, job->Wait(milliseconds(60000)));
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.workers.size(), 2u);
}

}  // namespace
}  // namespace deepnex::job
