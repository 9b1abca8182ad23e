// deepnex-central's job records (include/deepnex/gpu/jobs.h) through an
// in-process server: registration and updates, who sees and cancels what,
// the observer's events, history across a restart, and retention.
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "deepnex/gpu/central.h"
#include "deepnex/gpu/jobs.h"
#include "gmock/gmock.h"
#include "gpu/gpu_test_util.h"
#include "gpu/jobs_reporter.h"
#include "gtest/gtest.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::gpu {
namespace {

using ::deepnex::test::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;
using namespace std::chrono_literals;

class JobsTest : public ::deepnex::test::CentralFixture {
 protected:
  void Start(JobHistoryOptions history = {}) {
    CentralServerOptions o = ServerOptions();
    o.allocator.state_dir = dir_.path() + "/state";
    o.allocator.fsync = false;
    o.job_history = history;
    o.on_job_event = [this](const JobEvent& e) {
      std::lock_guard<std::mutex> lock(mu_);
      const std::string line = e.kind + " " + e.job.name + (e.reason.empty() ? "" : " " + e.reason);
      if (refuse_ > 0) {
        --refuse_;
        refused_.push_back(line);
        return absl::ResourceExhaustedError("the outbox's disk is full");
      }
      events_.push_back(line);
      ids_.push_back(e.id);
      return absl::OkStatus();
    };
    server_.reset();
    auto server = CentralServer::Create(o);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    if (!server_->allocator().GetNode("n1").ok()) {
      ASSERT_OK(server_->allocator().AddNode(test::MakeNode("n1", 2)));
    }
  }

  std::unique_ptr<JobsClient> Jobs(const std::string& token) {
    auto c = JobsClient::Create(ClientOptions(token));
    EXPECT_TRUE(c.ok()) << c.status();
    return std::move(c).value();
  }

  static JobRecord Job(const std::string& name, JobState state,
                       std::vector<JobAllocation> allocations = {}) {
    JobRecord j;
    j.name = name;
    j.command = {"python3", "train.py"};
    j.mode = "allreduce";
    j.workers = static_cast<int>(allocations.size());
    j.state = state;
    for (const auto& a : allocations) j.nodes = {a.node};
    j.allocations = std::move(allocations);
    return j;
  }

  std::vector<std::string> Names(JobsClient& c, const JobFilter& f) {
    std::vector<std::string> out;
    auto jobs = c.List(f);
    EXPECT_TRUE(jobs.ok()) << jobs.status();
    if (jobs.ok()) {
      for (const auto& j : *jobs) out.push_back(j.name);
    }
    return out;
  }

  std::vector<std::string> events() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }

  // Waits until alice's job j1 `is` so (`what`: as the failure says).
  ::testing::AssertionResult J1Becomes(const std::function<bool(const JobRecord&)>& is,
                                       const std::string& what) {
    auto alice = Jobs("alicetok");
    return ::deepnex::test::WaitFor(
        [&] {
          absl::StatusOr<JobRecord> j = alice->Get("j1");
          return j.ok() && is(*j);
        },
        std::chrono::seconds(10), what);
  }

  // Alice's job j1, running on a grant of its own as run r1 reports it
  // once (after `history` with a runner_timeout of 0.3 s); its record as
  // reported. Silent from then on, it fails as lost.
  JobRecord ReportedOnceOnAGrant(JobHistoryOptions history) {
    history.runner_timeout = std::chrono::milliseconds(300);
    Start(history);
    Request r = test::Exclusive("alice", 1, 1);
    r.job = "j1";
    absl::StatusOr<Allocation> a = Client("alicetok")->Allocate(r);
    EXPECT_TRUE(a.ok()) << a.status();
    if (!a.ok()) return {};
    JobRecord running = Job("j1", JobState::kRunning, {{a->id, a->node, 1, 1, 0}});
    absl::StatusOr<JobRecord> reported = Jobs("alicetok")->Report(running, "r1");
    EXPECT_TRUE(reported.ok()) << reported.status();
    return running;
  }

  std::vector<std::string> ids() {
    std::lock_guard<std::mutex> lock(mu_);
    return ids_;
  }

  std::vector<std::string> refused() {
    std::lock_guard<std::mutex> lock(mu_);
    return refused_;
  }

  void Refuse(int calls) {
    std::lock_guard<std::mutex> lock(mu_);
    refuse_ = calls;
  }

  std::mutex mu_;
  std::vector<std::string> events_;  // taken by the observer
  std::vector<std::string> ids_;
  int refuse_ = 0;  // the observer's next calls that fail
  std::vector<std::string> refused_;
};

JobFilter All() {
  JobFilter f;
  f.all = true;
  return f;
}

TEST_F(JobsTest, ARunnersReportsMakeTheRecordAndItsEvents) {
  Start();
  auto alice = Jobs("alicetok");
  ASSERT_OK_AND_ASSIGN(JobRecord pending, alice->Report(Job("j1", JobState::kPending), "r1"));
  EXPECT_EQ(pending.user, "alice");  // the token's
  EXPECT_EQ(pending.state, JobState::kPending);
  EXPECT_EQ(pending.started, std::chrono::system_clock::time_point{});
  auto grants = Client("alicetok");
  Request r = test::Exclusive("alice", 1, 2);
  r.job = "j1";
  ASSERT_OK_AND_ASSIGN(Allocation a1, grants->Allocate(r));
  ASSERT_OK_AND_ASSIGN(Allocation a2, grants->Allocate(r));
  JobRecord running = Job("j1", JobState::kRunning,
                          {{a1.id, "n1", 1, 2, 0}, {a2.id, "n1", 1, 2, 0}});
  ASSERT_OK_AND_ASSIGN(JobRecord got, alice->Report(running, "r1"));
  EXPECT_EQ(got.state, JobState::kRunning);
  EXPECT_THAT(got.nodes, ElementsAre("n1"));
  running.restarts = 1;
  ASSERT_OK(alice->Report(running, "r1").status());
  running.state = JobState::kCompleted;
  running.exit_code = 0;
  ASSERT_OK_AND_ASSIGN(JobRecord done, alice->Report(running, "r1"));
  EXPECT_EQ(done.state, JobState::kCompleted);
  // GPU-hours: the allocations' 2 GPUs over the recorded run, exactly.
  const double elapsed =
      std::chrono::duration_cast<std::chrono::milliseconds>(done.ended - done.started).count() /
      1000.0;
  EXPECT_EQ(done.elapsed_seconds, elapsed);
  EXPECT_EQ(done.gpu_hours, 2 * elapsed / 3600.0);
  EXPECT_EQ(done.cpu_hours, 4 * elapsed / 3600.0);  // no usage samples: cores x time
  EXPECT_THAT(events(), ElementsAre("queued j1", "started j1", "worker restarted j1",
                                    "completed j1"));
  // NAME/RUN/SEQ: a restarted central that sends one again sends the same id.
  EXPECT_THAT(ids(), ElementsAre("j1/r1/1", "j1/r1/2", "j1/r1/3", "j1/r1/4"));
  // Ended: history only.
  EXPECT_THAT(Names(*alice, {}), ElementsAre());
  EXPECT_THAT(Names(*alice, All()), ElementsAre("j1"));
  JobFilter completed;
  completed.state = "completed";
  EXPECT_THAT(Names(*alice, completed), ElementsAre("j1"));
}

TEST_F(JobsTest, UsersSeeAndCancelTheirOwnAdminsAnyones) {
  Start();
  auto alice = Jobs("alicetok");
  auto bob = Jobs("bobtok");
  auto admin = Jobs("admintok");
  auto grants = Client("alicetok");
  Request r = test::Exclusive("alice", 1, 1);
  r.job = "j1";
  ASSERT_OK_AND_ASSIGN(Allocation a, grants->Allocate(r));
  ASSERT_OK(alice->Report(Job("j1", JobState::kRunning, {{a.id, a.node, 1, 1, 0}}), "r1")
                .status());
  EXPECT_THAT(Names(*bob, All()), ElementsAre());
  EXPECT_THAT(bob->Get("j1"), StatusIs(absl::StatusCode::kNotFound, "job \"j1\" not found"));
  EXPECT_THAT(bob->Cancel("j1"), StatusIs(absl::StatusCode::kNotFound, "job \"j1\" not found"));
  JobFilter alices;
  alices.user = "alice";
  EXPECT_THAT(bob->List(alices), StatusIs(absl::StatusCode::kPermissionDenied,
                                          "user bob cannot list the jobs of alice"));
  EXPECT_THAT(Names(*admin, {}), ElementsAre("j1"));
  // A name is central's: bob cannot take alice's.
  EXPECT_THAT(bob->Report(Job("j1", JobState::kPending), "r2"),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("job \"j1\" exists")));
  // Nor with its run's id (in each event's id): his report was the job's.
  EXPECT_THAT(bob->Report(Job("j1", JobState::kFailed), "r1"),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("job \"j1\" exists")));

  ASSERT_OK_AND_ASSIGN(JobRecord cancelled, alice->Cancel("j1"));
  EXPECT_EQ(cancelled.state, JobState::kCancelled);
  EXPECT_EQ(cancelled.cancelled_by, "alice");
  ASSERT_OK_AND_ASSIGN(auto left, grants->Allocations());
  EXPECT_TRUE(left.empty());  // released
  // The runner's next report hears it, and its end keeps the state.
  ASSERT_OK_AND_ASSIGN(JobRecord heard, alice->Report(Job("j1", JobState::kRunning), "r1"));
  EXPECT_EQ(heard.state, JobState::kCancelled);
  JobRecord end = Job("j1", JobState::kFailed);
  end.exit_code = 1;
  ASSERT_OK_AND_ASSIGN(JobRecord ended, alice->Report(end, "r1"));
  EXPECT_EQ(ended.state, JobState::kCancelled);
  EXPECT_EQ(ended.exit_code, 1);
  EXPECT_THAT(alice->Cancel("j1"), StatusIs(absl::StatusCode::kFailedPrecondition,
                                            "job \"j1\" already ended: cancelled"));
  EXPECT_THAT(events(), ElementsAre("queued j1", "started j1", "cancelled j1"));
}

TEST_F(JobsTest, BadInputIsNamed) {
  Start();
  auto alice = Jobs("alicetok");
  JobFilter f;
  f.state = "done";
  EXPECT_THAT(alice->List(f),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "state: \"done\" is not pending, running, completed, failed or cancelled"));
  JobRecord other = Job("j2", JobState::kPending);
  other.user = "bob";
  EXPECT_THAT(alice->Report(other, "r1"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       "user alice cannot run a job for user bob"));
  EXPECT_THAT(alice->Get("nosuch"),
              StatusIs(absl::StatusCode::kNotFound, "job \"nosuch\" not found"));
  JobRecord when = Job("j3", JobState::kPending);
  when.notify_when = "accuracy=>0.9";
  EXPECT_THAT(alice->Report(when, "r1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "notify_when: \"accuracy=>0.9\" is not METRIC OP NUMBER (OP: >=, <=, >, "
                       "<, ==), e.g. accuracy>=0.9"));
  // A name and a run id make the event id a webhook carries in a header: a
  // probe's CR LF in either, through this C++ client, injected headers.
  EXPECT_THAT(alice->Report(Job("evil\r\nX-Injected: yes", JobState::kPending), "r1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "name: \"evil\\r\\nX-Injected: yes\" is not a job name "
                       "([a-z0-9][a-z0-9-]*, at most 40)"));
  EXPECT_THAT(alice->Report(Job("j4", JobState::kPending), "r\r\nX-Run: 1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "run: \"r\\r\\nX-Run: 1\" is not a run id (1-64 letters, digits, '-' "
                       "or '_')"));
  EXPECT_THAT(alice->Report(Job("Upper", JobState::kPending), "r1"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("name: \"Upper\"")));
  // Central keeps each job's record: what a runner writes freely is bounded.
  JobRecord big = Job("j5", JobState::kPending);
  big.command = {std::string(70000, 'x')};
  EXPECT_THAT(alice->Report(big, "r1"), StatusIs(absl::StatusCode::kInvalidArgument,
                                                 "command: 70001 bytes; at most 65536"));
  big = Job("j5", JobState::kRunning);
  for (int i = 0; i < 257; ++i) big.report.metrics[absl::StrCat("m", i)] = i;
  EXPECT_THAT(alice->Report(big, "r1"), StatusIs(absl::StatusCode::kInvalidArgument,
                                                 "report.metrics: 257 metrics; at most 256"));
  big.report.metrics = {{std::string(200, 'n'), 1.0}};
  EXPECT_THAT(alice->Report(big, "r1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("bytes; a metric's name is at most 128")));
  // A probe's 20000 notify URLs made 60000 POSTs from one call.
  JobRecord hooks = Job("j6", JobState::kPending);
  hooks.notify.assign(9, "https://hooks.example.com/x");
  EXPECT_THAT(alice->Report(hooks, "r1"), StatusIs(absl::StatusCode::kInvalidArgument,
                                                   "notify: 9 URLs; at most 8"));
  hooks.notify = {"https://hooks.example.com/" + std::string(2100, 'p')};
  EXPECT_THAT(alice->Report(hooks, "r1"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(" is 2126 bytes; at most 2048")));
  // A probe's container lists of 3.5 MB: 200 jobs took 900 MB of central's
  // memory and 700 MB of its disk.
  JobRecord fat = Job("j6", JobState::kRunning);
  fat.containers.assign(2000, JobContainer{"w", std::string(120, 'n'), "worker", "running"});
  EXPECT_THAT(alice->Report(fat, "r1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::MatchesRegex("the report is [0-9]+ bytes besides its command and "
                                               "message; at most 262144 \\(containers 2[0-9]{5}, "
                                               "allocations 0, nodes 0\\)")));
  // Counts, and the CPU seconds that the history sums into CPU-hours.
  JobRecord faked = Job("j6", JobState::kRunning);
  faked.workers = -5;
  EXPECT_THAT(alice->Report(faked, "r1"),
              StatusIs(absl::StatusCode::kInvalidArgument, "workers: -5 is below 0"));
  faked.workers = 1;
  faked.containers = {JobContainer{"w0", "n1", "worker", "running"}};
  faked.containers[0].cpu_seconds = std::nan("");
  EXPECT_THAT(alice->Report(faked, "r1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "containers[0].cpu_seconds: nan is not a count of seconds"));
  EXPECT_THAT(alice->Get("j6"), StatusIs(absl::StatusCode::kNotFound));
  // Proto strings are UTF-8: central could not parse such a report and
  // answered UNIMPLEMENTED with no message (probe).
  JobRecord latin = Job("j7", JobState::kPending);
  latin.command = {"echo", "caf\xe9"};
  EXPECT_THAT(alice->Report(latin, "r1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "command[1]: \"caf\\xe9\" is not UTF-8 text"));
  big.report.metrics = {{std::string(128, 'n'), 1.0}};
  big.command = {std::string(65535, 'x')};
  EXPECT_OK(alice->Report(big, "r1").status());  // at the limits
  // The last report's message is cut, not refused: the job's end is kept.
  big.state = JobState::kFailed;
  big.message = std::string(5000, 'm');
  ASSERT_OK_AND_ASSIGN(JobRecord ended, alice->Report(big, "r1"));
  EXPECT_EQ(ended.state, JobState::kFailed);
  EXPECT_EQ(ended.message, std::string(4096, 'm') + "... (904 more bytes)");
  EXPECT_TRUE(alice->List(JobFilter()).ok());
}

TEST(MetricThresholdTest, ParsesEachOperatorAndNamesTheRest) {
  JobReport r;
  r.metrics = {{"accuracy", 0.9}, {"loss", 0.5}};
  struct Case {
    const char* text;
    const char* metric;
    const char* op;
    double value;
    bool holds;
  };
  for (const Case& c : {Case{"accuracy>=0.9", "accuracy", ">=", 0.9, true},
                        Case{" accuracy > 0.9 ", "accuracy", ">", 0.9, false},
                        Case{"loss<=0.5", "loss", "<=", 0.5, true},
                        Case{"loss<0.5", "loss", "<", 0.5, false},
                        Case{"loss==5e-1", "loss", "==", 0.5, true},
                        Case{"missing>=0", "missing", ">=", 0, false}}) {
    ASSERT_OK_AND_ASSIGN(MetricThreshold t, ParseMetricThreshold(c.text, "notify_when"));
    EXPECT_EQ(t.metric, c.metric) << c.text;
    EXPECT_EQ(t.op, c.op) << c.text;
    EXPECT_EQ(t.value, c.value) << c.text;
    EXPECT_EQ(t.HoldsFor(r), c.holds) << c.text;
  }
  for (const char* bad : {"", "accuracy", ">=0.9", "accuracy>=", "accuracy>=high",
                          "accuracy>=nan", "accuracy!=0.9", "accuracy=>0.9", "acc uracy>1"}) {
    EXPECT_THAT(ParseMetricThreshold(bad, "notify_when"),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         absl::StrCat("notify_when: \"", bad, "\" is not METRIC OP NUMBER (OP: "
                                      ">=, <=, >, <, ==), e.g. accuracy>=0.9")));
  }
}

// A report at `step` with `metrics`, `ms` after `base`.
JobReport Report(int64_t step, std::map<std::string, double> metrics,
                 std::chrono::system_clock::time_point base, int ms) {
  JobReport r;
  r.step = step;
  r.metrics = std::move(metrics);
  r.time = base + std::chrono::milliseconds(ms);
  return r;
}

TEST_F(JobsTest, AThresholdsProgressEventGoesOnceEvenAcrossARestart) {
  Start();
  // Whole milliseconds, as the wire carries them.
  const auto base = std::chrono::time_point_cast<std::chrono::milliseconds>(
      std::chrono::system_clock::now());
  JobRecord j = Job("j1", JobState::kRunning);
  j.notify_when = "accuracy>=0.9";
  ASSERT_OK(Jobs("alicetok")->Report(j, "r1").status());
  j.report = Report(1, {{"accuracy", 0.5}}, base, 1);
  ASSERT_OK(Jobs("alicetok")->Report(j, "r1").status());
  EXPECT_THAT(events(), ElementsAre("queued j1", "started j1"));
  j.report = Report(2, {{"accuracy", 0.95}, {"loss", 0.25}}, base, 2);
  ASSERT_OK(Jobs("alicetok")->Report(j, "r1").status());
  ASSERT_OK(Jobs("alicetok")->Report(j, "r1").status());  // the same report again
  j.report = Report(3, {{"accuracy", 0.97}}, base, 3);
  ASSERT_OK_AND_ASSIGN(JobRecord got, Jobs("alicetok")->Report(j, "r1"));
  EXPECT_EQ(got.report.step, 3);
  EXPECT_EQ(got.report.time, j.report.time);
  EXPECT_THAT(got.report.metrics, ElementsAre(std::make_pair("accuracy", 0.97)));
  EXPECT_EQ(got.notify_when, "accuracy>=0.9");
  Start();  // the same state directory: it went already
  j.report = Report(4, {{"accuracy", 0.99}}, base, 4);
  ASSERT_OK(Jobs("alicetok")->Report(j, "r1").status());
  // An older report (a runner behind) does not replace the newer one.
  JobRecord late = j;
  late.report = Report(2, {{"accuracy", 0.95}}, base, 2);
  ASSERT_OK_AND_ASSIGN(got, Jobs("alicetok")->Report(late, "r1"));
  EXPECT_EQ(got.report.step, 4);
  EXPECT_THAT(events(), ElementsAre("queued j1", "started j1", "progress j1 when"));
}

// An event the observer could not keep (the notify outbox on a full disk)
// was marked sent all the same, lost for good. It goes again, before the
// events after it, each second until taken, and after a restart.
TEST_F(JobsTest, AnEventTheObserverRefusedGoesAgainInItsOrder) {
  Refuse(2);
  Start();
  auto alice = Jobs("alicetok");
  ASSERT_OK(alice->Report(Job("j1", JobState::kPending), "r1").status());
  ASSERT_OK(alice->Report(Job("j1", JobState::kRunning, {{"a1", "n1", 1, 2, 0}}), "r1").status());
  ASSERT_TRUE(::deepnex::test::WaitFor([&] { return events().size() == 2; }, 30s,
                                       "the refused events told again"));
  EXPECT_THAT(events(), ElementsAre("queued j1", "started j1"));
  EXPECT_THAT(refused(), ElementsAre("queued j1", "queued j1"));
  Refuse(1000);  // until central stops
  alice.reset();
  ASSERT_OK(Jobs("alicetok")->Report(Job("j1", JobState::kCompleted), "r1").status());
  EXPECT_THAT(refused(), ::testing::Contains("completed j1"));
  Refuse(0);
  Start();  // the same state directory: only what was never taken goes
  ASSERT_TRUE(::deepnex::test::WaitFor([&] { return events().size() == 3; }, 30s,
                                       "the refused event told after the restart"));
  EXPECT_THAT(events(), ElementsAre("queued j1", "started j1", "completed j1"));
  EXPECT_EQ(ids()[2], ids()[1].substr(0, ids()[1].rfind('/')) + "/3");
}

TEST_F(JobsTest, ProgressEveryIntervalGoesWithEachNewReportDueThen) {
  Start();
  const auto base = std::chrono::system_clock::now();
  JobRecord j = Job("j1", JobState::kRunning);
  j.notify_every = 1ms;
  ASSERT_OK(Jobs("alicetok")->Report(j, "r1").status());
  std::this_thread::sleep_for(2ms);  // the interval, from its start
  j.report = Report(1, {{"loss", 2}}, base, 1);
  ASSERT_OK(Jobs("alicetok")->Report(j, "r1").status());
  ASSERT_OK(Jobs("alicetok")->Report(j, "r1").status());  // no new report: no event
  std::this_thread::sleep_for(2ms);
  j.report = Report(2, {{"loss", 1}}, base, 2);
  ASSERT_OK(Jobs("alicetok")->Report(j, "r1").status());
  EXPECT_THAT(events(), ElementsAre("queued j1", "started j1", "progress j1 every",
                                    "progress j1 every"));
  j.notify_every = std::chrono::hours(1);  // a job's interval is its first report's
  std::this_thread::sleep_for(2ms);
  j.report = Report(3, {{"loss", 0.5}}, base, 3);
  ASSERT_OK(Jobs("alicetok")->Report(j, "r1").status());
  EXPECT_EQ(events().size(), 5u);
}

TEST_F(JobsTest, HistoryOutlivesARestart) {
  Start();
  {
    auto alice = Jobs("alicetok");
    JobRecord j = Job("j1", JobState::kRunning, {{"a1", "n1", 1, 1, 0}});
    ASSERT_OK(alice->Report(j, "r1").status());
    j.state = JobState::kFailed;
    j.exit_code = 3;
    ASSERT_OK(alice->Report(j, "r1").status());
    ASSERT_OK(alice->Report(Job("j2", JobState::kRunning), "r2").status());
  }
  ASSERT_OK_AND_ASSIGN(JobRecord before, Jobs("alicetok")->Get("j1"));
  Start();  // the same state directory
  auto alice = Jobs("alicetok");
  ASSERT_OK_AND_ASSIGN(JobRecord after, alice->Get("j1"));
  EXPECT_EQ(after.state, JobState::kFailed);
  EXPECT_EQ(after.exit_code, 3);
  EXPECT_EQ(after.started, before.started);
  EXPECT_EQ(after.ended, before.ended);
  EXPECT_EQ(after.gpu_hours, before.gpu_hours);
  EXPECT_THAT(Names(*alice, {}), ElementsAre("j2"));  // still running
  EXPECT_THAT(Names(*alice, All()), ElementsAre("j1", "j2"));
}

// A probe's second run of a cancelled job's name replaced the cancelled
// run in the history. Each ended run stays, as sacct keeps every run of a
// name, as <name>~<k>; the name is the newest run's.
TEST_F(JobsTest, ANewRunOfAnEndedJobsNameKeepsTheEarlierRuns) {
  Start();
  {
    auto alice = Jobs("alicetok");
    JobRecord j = Job("j1", JobState::kRunning);
    ASSERT_OK(alice->Report(j, "r1").status());
    ASSERT_OK(alice->Cancel("j1").status());
    j.state = JobState::kCompleted;
    ASSERT_OK(alice->Report(Job("j1", JobState::kRunning), "r2").status());
    ASSERT_OK(alice->Report(j, "r2").status());
  }
  Start();  // the same state directory
  auto alice = Jobs("alicetok");
  ASSERT_OK(alice->Report(Job("j1", JobState::kRunning), "r3").status());
  EXPECT_THAT(Names(*alice, All()), ElementsAre("j1~1", "j1~2", "j1"));  // as submitted
  ASSERT_OK_AND_ASSIGN(JobRecord first, alice->Get("j1~1"));
  EXPECT_EQ(first.state, JobState::kCancelled);
  ASSERT_OK_AND_ASSIGN(JobRecord second, alice->Get("j1~2"));
  EXPECT_EQ(second.state, JobState::kCompleted);
  ASSERT_OK_AND_ASSIGN(JobRecord now, alice->Get("j1"));
  EXPECT_EQ(now.state, JobState::kRunning);
  // Not a name a run may report under.
  EXPECT_THAT(alice->Report(Job("j1~1", JobState::kRunning), "r4"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is not a job name")));
}

TEST_F(JobsTest, RetentionDropsTheOldestByCountAndByAge) {
  JobHistoryOptions history;
  history.max_count = 2;
  Start(history);
  auto alice = Jobs("alicetok");
  for (const char* name : {"a", "b", "c"}) {
    ASSERT_OK(alice->Report(Job(name, JobState::kRunning), "r").status());
    ASSERT_OK(alice->Report(Job(name, JobState::kCompleted), "r").status());
  }
  EXPECT_THAT(Names(*alice, All()), ElementsAre("b", "c"));
  Start(history);  // the drop is in the ledger too
  EXPECT_THAT(Names(*Jobs("alicetok"), All()), ElementsAre("b", "c"));

  history.max_age = 200ms;
  Start(history);  // b and c are older than that by now, or will be
  alice = Jobs("alicetok");
  ASSERT_OK(alice->Report(Job("d", JobState::kCompleted), "r").status());
  ASSERT_OK_AND_ASSIGN(JobRecord d, alice->Get("d"));
  // Older in whole milliseconds, as records keep times: 200.5 ms after a
  // record's end is 200 ms by them, not older (1 run in 300 failed).
  ASSERT_TRUE(::deepnex::test::WaitFor(
      [&] { return std::chrono::system_clock::now() >= d.ended + 201ms; }, 5s,
      "d to be older than 200 ms"));
  ASSERT_OK(alice->Report(Job("e", JobState::kCompleted), "r").status());
  EXPECT_THAT(Names(*alice, All()), ElementsAre("e"));
}

// Past the count or the bytes, the user who holds the most loses their
// oldest: a probe's 5 reports under a count of 5 erased alice's history.
TEST_F(JobsTest, OneUsersManyJobsPushOutOnlyTheirOwnHistory) {
  JobHistoryOptions history;
  history.max_count = 3;
  Start(history);
  auto alice = Jobs("alicetok");
  auto bob = Jobs("bobtok");
  ASSERT_OK(alice->Report(Job("a1", JobState::kCompleted), "r").status());
  for (const char* name : {"b1", "b2", "b3", "b4"}) {
    ASSERT_OK(bob->Report(Job(name, JobState::kCompleted), "r").status());
  }
  EXPECT_THAT(Names(*Jobs("admintok"), All()), ::testing::UnorderedElementsAre("a1", "b3", "b4"));

  // By bytes: bob, with four records of 60 KiB commands, holds the most,
  // and loses his oldest until the rest fit.
  history.max_count = 100;
  history.max_bytes = 200 << 10;
  Start(history);
  alice = Jobs("alicetok");
  bob = Jobs("bobtok");
  for (const char* name : {"b5", "b6", "b7", "b8"}) {
    JobRecord j = Job(name, JobState::kCompleted);
    j.command = {std::string(60 << 10, 'x')};
    ASSERT_OK(bob->Report(j, "r").status());
  }
  ASSERT_OK(alice->Report(Job("a2", JobState::kCompleted), "r").status());
  EXPECT_THAT(Names(*Jobs("admintok"), All()), ::testing::UnorderedElementsAre("a1", "b6", "b7", "b8", "a2"));
  Start(history);  // the drops are in the ledger too
  EXPECT_THAT(Names(*Jobs("admintok"), All()), ::testing::UnorderedElementsAre("a1", "b6", "b7", "b8", "a2"));
}

// Every report writes its job's whole record: the ledger snapshots by bytes
// too, not only after 1000 records (a probe's 100 reports of one 3.5 MB job
// wrote 346 MB of log).
TEST_F(JobsTest, ReportsOfABigRecordDoNotGrowTheLogWithoutBound) {
  Start();
  auto alice = Jobs("alicetok");
  JobRecord j = Job("big", JobState::kRunning);
  j.command = {std::string(60 << 10, 'x')};
  j.containers.assign(1500, JobContainer{"w", std::string(100, 'n'), "worker", "running"});
  for (int i = 0; i < 500; ++i) {  // about 120 MiB of records
    j.restarts = i;
    ASSERT_OK(alice->Report(j, "r").status());
  }
  uint64_t bytes = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir_.path() + "/state/jobs")) {
    if (f.is_regular_file()) bytes += f.file_size();
  }
  EXPECT_LT(bytes, uint64_t{70} << 20);
  Start();  // and the snapshot holds the job
  ASSERT_OK_AND_ASSIGN(JobRecord got, Jobs("alicetok")->Get("big"));
  EXPECT_EQ(got.restarts, 499);
}

// A job's allocations, which the history sums into GPU-hours, are central's
// grants: a probe's runner reported -1000000 GPUs (-2438 GPU-hours), or
// none while it held some.
TEST_F(JobsTest, AJobsAllocationsAreCentralsGrants) {
  Start();
  auto alice = Jobs("alicetok");
  auto grants = Client("alicetok");
  Request r = test::Exclusive("alice", 1, 1);
  r.job = "j1";
  ASSERT_OK_AND_ASSIGN(Allocation a, grants->Allocate(r));
  ASSERT_OK(grants->Allocate(test::Exclusive("alice", 1, 1)).status());  // not the job's
  const auto ids = [](const JobRecord& j) {
    std::vector<std::string> out;
    for (const JobAllocation& x : j.allocations) {
      out.push_back(absl::StrCat(x.id, " ", x.node, " ", x.gpus, " ", x.cpus));
    }
    return out;
  };
  const std::string grant = absl::StrCat(a.id, " ", a.node, " 1 1");
  // Faked figures and an allocation central never made: central's grant.
  JobRecord j = Job("j1", JobState::kRunning, {{a.id, "n9", -1000000, 64, 0}, {"zz", "n1", 8, 8, 0}});
  ASSERT_OK_AND_ASSIGN(JobRecord got, alice->Report(j, "r1"));
  EXPECT_THAT(ids(got), ElementsAre(grant));
  // None reported: still its grant.
  j.allocations.clear();
  ASSERT_OK_AND_ASSIGN(got, alice->Report(j, "r1"));
  EXPECT_THAT(ids(got), ElementsAre(grant));
  // Released and still reported (a job's last report comes after it lets
  // its grants go): as the record had it; once no longer reported, gone.
  ASSERT_OK(grants->Release(a.id));
  j.allocations = {{a.id, "n9", 7, 7, 0}};
  ASSERT_OK_AND_ASSIGN(got, alice->Report(j, "r1"));
  EXPECT_THAT(ids(got), ElementsAre(grant));
  j.allocations.clear();
  ASSERT_OK_AND_ASSIGN(got, alice->Report(j, "r1"));
  EXPECT_THAT(ids(got), ElementsAre());
}

// Records a runner need not back with allocations: a user's jobs that have
// not ended are bounded too.
TEST_F(JobsTest, AUsersJobsThatHaveNotEndedAreBounded) {
  Start();
  auto bob = Jobs("bobtok");
  for (int i = 0; i < 1024; ++i) {
    ASSERT_OK(bob->Report(Job(absl::StrCat("b", i), JobState::kRunning), "r").status());
  }
  EXPECT_THAT(bob->Report(Job("more", JobState::kRunning), "r"),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       "user bob has 1024 jobs that have not ended; at most 1024 (deepnex job "
                       "cancel ends one)"));
  // Reports of those go on, another user's jobs too, and one that ended
  // makes room.
  ASSERT_OK(bob->Report(Job("b0", JobState::kCompleted), "r").status());
  ASSERT_OK(bob->Report(Job("more", JobState::kRunning), "r").status());
  ASSERT_OK(Jobs("alicetok")->Report(Job("a1", JobState::kRunning), "r").status());
}

TEST_F(JobsTest, AJobWhoseRunnerFallsSilentFailsAsLostAndItsReportRevivesIt) {
  JobHistoryOptions history;
  history.runner_timeout = 300ms;
  Start(history);
  auto alice = Jobs("alicetok");
  const JobRecord running = Job("j1", JobState::kRunning, {{"a1", "n1", 1, 1, 0}});
  ASSERT_OK(alice->Report(running, "r1").status());
  ASSERT_TRUE(
      J1Becomes([](const JobRecord& j) { return j.state == JobState::kFailed; }, "j1 to fail as lost"));
  ASSERT_OK_AND_ASSIGN(JobRecord lost, alice->Get("j1"));
  EXPECT_TRUE(lost.lost);
  EXPECT_EQ(lost.exit_code, 1);
  EXPECT_EQ(lost.message, "lost: its runner did not report for 0.3 s");
  // The record is visible once stored; its event goes out just after (CI
  // read the events in between).
  ASSERT_TRUE(::deepnex::test::WaitFor([&] { return events().size() >= 3; }, 10s,
                                       "the failed event"));
  EXPECT_THAT(events(), ElementsAre("queued j1", "started j1", "failed j1"));
  // Cut off, not gone: its next report makes it run again.
  ASSERT_OK_AND_ASSIGN(JobRecord back, alice->Report(running, "r1"));
  EXPECT_EQ(back.state, JobState::kRunning);
  EXPECT_FALSE(back.lost);
  EXPECT_EQ(back.ended, std::chrono::system_clock::time_point{});
  EXPECT_EQ(back.started, lost.started);
}

// The job runner's snapshot reads state that is not safe for two readers
// (its report client, made on first use): the reporter's thread reporting
// every 1 ms and the caller's ReportNow never run two snapshots at once.
// The two did in CI, and the job's runner threw bad_weak_ptr or crashed.
// After Finish, ReportNow sends nothing: the record stays final.
TEST_F(JobsTest, AReportersSnapshotsNeverOverlapAndNoneFollowsTheFinalOne) {
  Start();
  std::atomic<int> inside{0}, taken{0};
  std::atomic<bool> running{false}, overlapped{false};
  ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<JobReporter> reporter,
      JobReporter::Register(
          ClientOptions("alicetok"),
          [&] {
            if (++inside > 1) overlapped = true;
            std::this_thread::sleep_for(200us);  // widens a window of overlap
            ++taken;
            --inside;
            return Job("j1", running ? JobState::kRunning : JobState::kPending);
          },
          1ms));
  running = true;
  reporter->Run();
  for (int i = 0; i < 200; ++i) ASSERT_OK(reporter->ReportNow());
  ASSERT_OK(reporter->Finish(JobState::kCompleted, 0, ""));
  const int at_finish = taken.load();
  ASSERT_OK(reporter->ReportNow());
  EXPECT_EQ(taken.load(), at_finish);
  EXPECT_FALSE(overlapped.load());
  ASSERT_OK_AND_ASSIGN(JobRecord j1, Jobs("alicetok")->Get("j1"));
  EXPECT_EQ(j1.state, JobState::kCompleted);
}

// A lost job keeps its allocations for a runner that was cut off; a probe's
// `deepnex job cancel` of one answered "already ended: failed", leaving
// its user to release them by allocation id.
TEST_F(JobsTest, CancellingALostJobReleasesItsAllocations) {
  const JobRecord running = ReportedOnceOnAGrant({});
  auto alice = Jobs("alicetok");
  auto grants = Client("alicetok");
  // Cancelled as soon as its record says lost, perhaps before the watch
  // that failed it has published "failed": that was then told after
  // "cancelled" (CI). Events go out in the order they were made.
  ASSERT_TRUE(J1Becomes([](const JobRecord& j) { return j.lost; }, "j1 to fail as lost"));
  ASSERT_OK_AND_ASSIGN(auto held, grants->Allocations());
  EXPECT_EQ(held.size(), 1u);
  ASSERT_OK_AND_ASSIGN(JobRecord cancelled, alice->Cancel("j1"));
  EXPECT_EQ(cancelled.state, JobState::kCancelled);
  EXPECT_FALSE(cancelled.lost);
  EXPECT_EQ(cancelled.message,
            "cancelled by alice after it was lost: its runner did not report for 0.3 s");
  ASSERT_OK_AND_ASSIGN(auto left, grants->Allocations());
  EXPECT_TRUE(left.empty());
  // Its runner, back, hears it is cancelled rather than running again.
  ASSERT_OK_AND_ASSIGN(JobRecord heard, alice->Report(running, "r1"));
  EXPECT_EQ(heard.state, JobState::kCancelled);
  EXPECT_THAT(alice->Cancel("j1"), StatusIs(absl::StatusCode::kFailedPrecondition,
                                            "job \"j1\" already ended: cancelled"));
  EXPECT_THAT(events(), ElementsAre("queued j1", "started j1", "failed j1", "cancelled j1"));
}

// A runner killed with SIGKILL never comes back: its lost job's GPUs were
// held (and its workers on central's agents ran) until its user noticed.
// lost_release_after later central cancels it, and the allocations go back.
TEST_F(JobsTest, AJobLostForLostReleaseAfterIsCancelledAndItsAllocationsReleased) {
  JobHistoryOptions history;
  history.lost_release_after = 600ms;
  const JobRecord running = ReportedOnceOnAGrant(history);
  auto alice = Jobs("alicetok");
  auto grants = Client("alicetok");
  ASSERT_TRUE(J1Becomes([](const JobRecord& j) { return j.state == JobState::kCancelled; },
                        "j1 to be cancelled"));
  ASSERT_OK_AND_ASSIGN(JobRecord cancelled, alice->Get("j1"));
  EXPECT_FALSE(cancelled.lost);
  EXPECT_EQ(cancelled.cancelled_by, "deepnex-central");
  EXPECT_EQ(cancelled.message,
            "cancelled by deepnex-central after it was lost: its runner did not report for "
            "0.3 s; its allocations were held 0.6 s more for it");
  // Released just after the record says cancelled, as a Cancel does.
  EXPECT_TRUE(::deepnex::test::WaitFor(
      [&] {
        auto left = grants->Allocations();
        return left.ok() && left->empty();
      },
      10s, "j1's allocation to be released"));
  ASSERT_TRUE(::deepnex::test::WaitFor([&] { return events().size() >= 4; }, 10s,
                                       "the cancelled event"));
  EXPECT_THAT(events(), ElementsAre("queued j1", "started j1", "failed j1", "cancelled j1"));
  // Its runner, back after all, hears it is cancelled.
  ASSERT_OK_AND_ASSIGN(JobRecord heard, alice->Report(running, "r1"));
  EXPECT_EQ(heard.state, JobState::kCancelled);
}

// A runner heard again within lost_release_after keeps its job and its
// allocations.
TEST_F(JobsTest, ALostJobRevivedInTimeIsNotCancelled) {
  JobHistoryOptions history;
  history.lost_release_after = 2s;
  const JobRecord running = ReportedOnceOnAGrant(history);
  auto alice = Jobs("alicetok");
  auto grants = Client("alicetok");
  ASSERT_TRUE(J1Becomes([](const JobRecord& j) { return j.lost; }, "j1 to fail as lost"));
  // Reported every 100 ms from now on, past when it would have been released.
  const auto until = std::chrono::steady_clock::now() + 3s;
  while (std::chrono::steady_clock::now() < until) {
    ASSERT_OK_AND_ASSIGN(JobRecord j, alice->Report(running, "r1"));
    ASSERT_EQ(j.state, JobState::kRunning);
    std::this_thread::sleep_for(100ms);
  }
  ASSERT_OK_AND_ASSIGN(auto held, grants->Allocations());
  EXPECT_EQ(held.size(), 1u);
}

TEST_F(JobsTest, SinceKeepsJobsNotEndedBeforeIt) {
  Start();
  auto alice = Jobs("alicetok");
  ASSERT_OK(alice->Report(Job("old", JobState::kCompleted), "r").status());
  ASSERT_OK_AND_ASSIGN(JobRecord old, alice->Get("old"));
  ASSERT_TRUE(::deepnex::test::WaitFor([&] { return std::chrono::system_clock::now() > old.ended + 5ms; },
                            5s, "the clock to pass old's end"));
  JobFilter f;
  f.since = old.ended + 1ms;
  ASSERT_OK(alice->Report(Job("new", JobState::kCompleted), "r").status());
  ASSERT_OK(alice->Report(Job("live", JobState::kRunning), "r").status());
  EXPECT_THAT(Names(*alice, f), UnorderedElementsAre("new", "live"));
}

}  // namespace
}  // namespace deepnex::gpu
