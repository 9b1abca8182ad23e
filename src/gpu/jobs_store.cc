#include "gpu/jobs_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <type_traits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/grpc_util.h"
#include "core/text.h"
#include "deepnex/jobs.grpc.pb.h"
#include "gpu/ledger.h"

namespace deepnex::gpu {
namespace {

using std::chrono::milliseconds;
using std::chrono::system_clock;

// Log records (beyond one per job), or bytes (beyond the last snapshot's),
// after which the store snapshots.
constexpr uint64_t kSnapshotEvery = 1000, kSnapshotBytes = 64 << 20;

int64_t NowMs() {
  return std::chrono::duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
}

int64_t MsOf(system_clock::time_point t) {
  return std::chrono::duration_cast<milliseconds>(t.time_since_epoch()).count();
}

system_clock::time_point TimeOf(int64_t ms) {
  return system_clock::time_point(std::chrono::duration_cast<system_clock::duration>(
      milliseconds(ms)));
}

bool Ended(const pb::Job& j) {
  return j.state() == "completed" || j.state() == "failed" || j.state() == "cancelled";
}

// The sums a reader sees (jobs.h's JobRecord says how), as of `now_ms`.
pb::Job Filled(pb::Job j, int64_t now_ms) {
  const int64_t end = j.ended_ms() != 0 ? j.ended_ms() : now_ms;
  const double elapsed = j.started_ms() != 0 ? std::max<int64_t>(0, end - j.started_ms()) / 1000.0
                                             : 0.0;
  double gpus = 0, cpus = 0, cpu_seconds = 0;
  uint64_t peak = 0;
  for (const auto& a : j.allocations()) {
    gpus += a.gpus();
    cpus += a.cpus();
  }
  for (const auto& c : j.containers()) {
    cpu_seconds += c.cpu_seconds();
    peak = std::max<uint64_t>(peak, c.memory_peak());
  }
  j.set_elapsed_s(elapsed);
  j.set_gpu_hours(gpus * elapsed / 3600.0);
  j.set_cpu_hours(cpu_seconds > 0 ? cpu_seconds / 3600.0 : cpus * elapsed / 3600.0);
  j.set_peak_memory(peak);
  return j;
}

JobEvent EventOf(const std::string& kind, const pb::Job& j, const std::string& reason = "") {
  JobEvent e;
  e.kind = kind;
  e.reason = reason;
  auto record = FromProto(Filled(j, NowMs()));
  if (record.ok()) e.job = std::move(*record);
  return e;
}

// The id of event `seq` of this run of `j`.
std::string EventId(const pb::Job& j, uint64_t seq) {
  return absl::StrCat(j.name(), "/", j.run(), "/", seq);
}

// Gives `events` (of `j`) their sequence numbers and ids, and notes them in
// `j` as unsent: the record that makes the change durable also holds what
// is still to be published for it.
void Note(pb::Job* j, std::vector<JobEvent>* events, size_t from) {
  for (size_t i = from; i < events->size(); ++i) {
    JobEvent& e = (*events)[i];
    j->set_events(j->events() + 1);
    e.id = EventId(*j, j->events());
    pb::JobEventNote* n = j->add_unsent();
    n->set_seq(j->events());
    n->set_kind(e.kind);
    n->set_reason(e.reason);
    n->set_resized_from(e.resized_from);
  }
}

// The parts of a report its runner writes freely, bounded: central keeps
// every job's record in memory and writes it whole to its ledger at each
// report. Probes: 4 MiB commands wrote 18 MB of history in 2.4 s; 200 jobs
// of 3.5 MB container lists took 900 MB of memory and 700 MB of disk; one
// job's 20000 notify URLs made 60000 POSTs. No job `deepnex run` reports
// comes near these: a worker's container is about 100 bytes of a record.
constexpr size_t kMaxCommand = 64 << 10, kMaxRecord = 256 << 10, kMaxMessage = 4 << 10,
                 kMaxMetrics = 256, kMaxMetricName = 128, kMaxUrl = 2048;
// Jobs not ended per user: records a runner need not back with allocations.
constexpr size_t kMaxLiveJobs = 1024;

template <typename Parts>
size_t BytesOf(const Parts& parts) {
  size_t n = 0;
  for (const auto& p : parts) {
    if constexpr (std::is_same_v<std::decay_t<decltype(p)>, std::string>) {
      n += p.size();
    } else {
      n += p.ByteSizeLong();
    }
  }
  return n;
}

// A job's allocations as central knows them, which the history sums into
// GPU-hours: its grants now (allocations carry the job's name), and those
// its runner still reports that the record had when central still held
// them (released since). A runner's own figures are not taken: a probe's
// reported -1000000 GPUs, or none while it held some.
google::protobuf::RepeatedPtrField<pb::JobAllocation> AllocationsOf(
    const pb::Job& in, const pb::Job& recorded, const std::vector<Allocation>& granted) {
  google::protobuf::RepeatedPtrField<pb::JobAllocation> out;
  std::set<std::string> ids;
  for (const Allocation& a : granted) {
    pb::JobAllocation* p = out.Add();
    p->set_id(a.id);
    p->set_node(a.node);
    p->set_gpus(static_cast<int>(a.gpus.size()));
    p->set_cpus(a.cpus);
    p->set_memory(a.memory);
    ids.insert(a.id);
  }
  for (const pb::JobAllocation& reported : in.allocations()) {
    if (ids.count(reported.id()) != 0) continue;
    for (const pb::JobAllocation& kept : recorded.allocations()) {
      if (kept.id() == reported.id()) {
        *out.Add() = kept;
        ids.insert(kept.id());
        break;
      }
    }
  }
  return out;
}

absl::Status BelowZero(const std::string& field, int64_t value) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", value, " is below 0"));
}

absl::Status CheckReportBounds(const pb::Job& in) {
  size_t command = 0;
  for (const std::string& arg : in.command()) command += arg.size() + 1;
  if (command > kMaxCommand) {
    return absl::InvalidArgumentError(absl::StrCat("command: ", command, " bytes; at most ",
                                                   kMaxCommand));
  }
  if (in.notify_size() > static_cast<int>(kMaxJobNotifyUrls)) {
    return absl::InvalidArgumentError(
        absl::StrCat("notify: ", in.notify_size(), " URLs; at most ", kMaxJobNotifyUrls));
  }
  for (const std::string& url : in.notify()) {
    if (url.size() > kMaxUrl) {
      return absl::InvalidArgumentError(absl::StrCat("notify: ", Quoted(url), " is ",
                                                     url.size(), " bytes; at most ", kMaxUrl));
    }
  }
  if (in.report().metrics_size() > static_cast<int>(kMaxMetrics)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "report.metrics: ", in.report().metrics_size(), " metrics; at most ", kMaxMetrics));
  }
  for (const auto& [name, value] : in.report().metrics()) {
    if (name.size() > kMaxMetricName) {
      return absl::InvalidArgumentError(absl::StrCat(
          "report.metrics: ", Quoted(name), " is ", name.size(),
          " bytes; a metric's name is at most ", kMaxMetricName));
    }
  }
  // The message is cut, not refused: it comes with the run's last report.
  const size_t record = in.ByteSizeLong() - command - in.message().size();
  if (record > kMaxRecord) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the report is ", record, " bytes besides its command and message; at most ",
        kMaxRecord, " (containers ", BytesOf(in.containers()), ", allocations ",
        BytesOf(in.allocations()), ", nodes ", BytesOf(in.nodes()), ")"));
  }
  // Counts, and the CPU seconds the history sums into CPU-hours (its
  // GPU-hours are central's: AllocationsOf).
  const std::pair<const char*, int> counts[] = {
      {"workers", in.workers()},         {"ps", in.ps()},
      {"min_workers", in.min_workers()}, {"max_workers", in.max_workers()},
      {"restarts", in.restarts()},       {"resizes", in.resizes()}};
  for (const auto& [field, value] : counts) {
    if (value < 0) return BelowZero(field, value);
  }
  for (int i = 0; i < in.containers_size(); ++i) {
    const pb::JobContainer& c = in.containers(i);
    if (c.restarts() < 0) {
      return BelowZero(absl::StrCat("containers[", i, "].restarts"), c.restarts());
    }
    if (!(c.cpu_seconds() >= 0 && std::isfinite(c.cpu_seconds()))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "containers[", i, "].cpu_seconds: ", c.cpu_seconds(), " is not a count of seconds"));
    }
  }
  return absl::OkStatus();
}

// Takes event `id` off the unsent ones of `j`; whether it was there.
bool MarkSent(pb::Job* j, const std::string& id) {
  auto* unsent = j->mutable_unsent();
  for (auto it = unsent->begin(); it != unsent->end(); ++it) {
    if (EventId(*j, it->seq()) == id) {
      unsent->erase(it);
      return true;
    }
  }
  return false;
}

bool CanSee(const Identity& who, const pb::Job& j) {
  return who.Reaches(j.name()) && (who.role == AuthRole::kAdmin || j.user() == who.name);
}

}  // namespace

const char* JobStateName(JobState state) {
  switch (state) {
    case JobState::kPending: return "pending";
    case JobState::kRunning: return "running";
    case JobState::kCompleted: return "completed";
    case JobState::kFailed: return "failed";
    case JobState::kCancelled: return "cancelled";
  }
  return "pending";
}

bool IsJobName(const std::string& name) {
  if (name.empty() || name.size() > 40) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || (i > 0 && c == '-'))) return false;
  }
  return true;
}

absl::StatusOr<JobState> ParseJobState(const std::string& text, const char* field) {
  for (JobState s : {JobState::kPending, JobState::kRunning, JobState::kCompleted,
                     JobState::kFailed, JobState::kCancelled}) {
    if (text == JobStateName(s)) return s;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": \"", text, "\" is not pending, running, completed, failed or cancelled"));
}

absl::StatusOr<MetricThreshold> ParseMetricThreshold(const std::string& text,
                                                     const char* field) {
  // Two-character operators first: ">=" must not read as ">" and "=0.9".
  for (const char* op : {">=", "<=", "==", ">", "<"}) {
    const size_t at = text.find(op);
    if (at == std::string::npos) continue;
    MetricThreshold t;
    t.metric = std::string(absl::StripAsciiWhitespace(text.substr(0, at)));
    t.op = op;
    const std::string number(absl::StripAsciiWhitespace(text.substr(at + std::strlen(op))));
    // "accuracy=>0.9" must not read as metric "accuracy=" and ">".
    const bool name_ok =
        !t.metric.empty() && t.metric.find_first_of("<>=! \t") == std::string::npos;
    if (name_ok && absl::SimpleAtod(number, &t.value) && std::isfinite(t.value)) {
      return t;
    }
    break;
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ": \"", text,
                                                 "\" is not METRIC OP NUMBER (OP: >=, <=, >, <, "
                                                 "==), e.g. accuracy>=0.9"));
}

bool MetricThreshold::HoldsFor(const JobReport& report) const {
  auto it = report.metrics.find(metric);
  if (it == report.metrics.end()) return false;
  const double v = it->second;
  if (op == ">=") return v >= value;
  if (op == "<=") return v <= value;
  if (op == ">") return v > value;
  if (op == "<") return v < value;
  return v == value;
}

bool JobEnded(JobState state) {
  return state == JobState::kCompleted || state == JobState::kFailed ||
         state == JobState::kCancelled;
}

void ToProto(const JobRecord& job, pb::Job* p) {
  p->set_name(job.name);
  p->set_user(job.user);
  for (const auto& c : job.command) p->add_command(c);
  p->set_mode(job.mode);
  p->set_workers(job.workers);
  p->set_min_workers(job.min_workers);
  p->set_max_workers(job.max_workers);
  p->set_resizes(job.resizes);
  p->set_last_resize(job.last_resize);
  p->set_ps(job.ps);
  for (const auto& a : job.allocations) {
    pb::JobAllocation* pa = p->add_allocations();
    pa->set_id(a.id);
    pa->set_node(a.node);
    pa->set_gpus(a.gpus);
    pa->set_cpus(a.cpus);
    pa->set_memory(a.memory);
  }
  for (const auto& n : job.nodes) p->add_nodes(n);
  p->set_state(JobStateName(job.state));
  p->set_submitted_ms(MsOf(job.submitted));
  p->set_started_ms(MsOf(job.started));
  p->set_ended_ms(MsOf(job.ended));
  p->set_exit_code(job.exit_code);
  p->set_restarts(job.restarts);
  p->set_lost(job.lost);
  for (const auto& c : job.containers) {
    pb::JobContainer* pc = p->add_containers();
    pc->set_name(c.name);
    pc->set_node(c.node);
    pc->set_role(c.role);
    pc->set_state(c.state);
    pc->set_restarts(c.restarts);
    pc->set_last_exit(c.last_exit);
    pc->set_cpu_seconds(c.cpu_seconds);
    pc->set_memory_peak(c.memory_peak);
  }
  p->set_message(job.message);
  p->set_cancelled_by(job.cancelled_by);
  for (const std::string& url : job.notify) p->add_notify(url);
  p->mutable_report()->set_step(job.report.step);
  p->mutable_report()->set_time_ms(MsOf(job.report.time));
  for (const auto& [k, v] : job.report.metrics) (*p->mutable_report()->mutable_metrics())[k] = v;
  p->set_notify_every_ms(job.notify_every.count());
  p->set_notify_when(job.notify_when);
  p->set_elapsed_s(job.elapsed_seconds);
  p->set_gpu_hours(job.gpu_hours);
  p->set_cpu_hours(job.cpu_hours);
  p->set_peak_memory(job.peak_memory);
}

absl::StatusOr<JobRecord> FromProto(const pb::Job& p) {
  JobRecord j;
  j.name = p.name();
  j.user = p.user();
  j.command.assign(p.command().begin(), p.command().end());
  j.mode = p.mode();
  j.workers = p.workers();
  j.min_workers = p.min_workers();
  j.max_workers = p.max_workers();
  j.resizes = p.resizes();
  j.last_resize = p.last_resize();
  j.ps = p.ps();
  for (const auto& a : p.allocations()) {
    j.allocations.push_back({a.id(), a.node(), a.gpus(), a.cpus(), a.memory()});
  }
  j.nodes.assign(p.nodes().begin(), p.nodes().end());
  DEEPNEX_ASSIGN_OR_RETURN(j.state, ParseJobState(p.state(), "state"));
  j.submitted = TimeOf(p.submitted_ms());
  j.started = TimeOf(p.started_ms());
  j.ended = TimeOf(p.ended_ms());
  j.exit_code = p.exit_code();
  j.restarts = p.restarts();
  j.lost = p.lost();
  for (const auto& c : p.containers()) {
    j.containers.push_back({c.name(), c.node(), c.role(), c.state(), c.restarts(), c.last_exit(),
                            c.cpu_seconds(), c.memory_peak()});
  }
  j.message = p.message();
  j.cancelled_by = p.cancelled_by();
  j.notify.assign(p.notify().begin(), p.notify().end());
  j.report.step = p.report().step();
  j.report.time = TimeOf(p.report().time_ms());
  j.report.metrics.insert(p.report().metrics().begin(), p.report().metrics().end());
  j.notify_every = milliseconds(p.notify_every_ms());
  j.notify_when = p.notify_when();
  j.elapsed_seconds = p.elapsed_s();
  j.gpu_hours = p.gpu_hours();
  j.cpu_hours = p.cpu_hours();
  j.peak_memory = p.peak_memory();
  return j;
}

JobStore::JobStore(JobStoreOptions options, Allocator& allocator)
    : options_(std::move(options)), allocator_(allocator) {}

JobStore::~JobStore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
    cv_.notify_all();
  }
  if (watcher_.joinable()) watcher_.join();
}

void JobStore::Watch() {
  // What the last central made durable but did not publish goes out first.
  Commit(0).IgnoreError();
  const auto timeout = options_.history.runner_timeout;
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, std::min<milliseconds>(timeout / 4, milliseconds(1000)),
                       [this] { return closing_; })) {
    const auto now = std::chrono::steady_clock::now();
    std::vector<JobEvent> events;
    for (auto it = heard_.begin(); it != heard_.end();) {
      auto job = jobs_.find(it->first);
      if (job == jobs_.end() || Ended(job->second)) {
        it = heard_.erase(it);
        continue;
      }
      if (now - it->second < timeout) {
        ++it;
        continue;
      }
      // Its allocations stay: a runner cut off from central may still run
      // on them (leases, where the job asked for them, end that).
      pb::Job j = job->second;
      j.set_state("failed");
      j.set_lost(true);
      j.set_ended_ms(NowMs());
      j.set_exit_code(1);
      j.set_message(absl::StrCat("lost: its runner did not report for ", timeout.count() / 1000.0,
                                 " s"));
      events.push_back(EventOf("failed", j));
      Note(&j, &events, events.size() - 1);
      PutLocked(j);
      it = heard_.erase(it);
    }
    // Lost for lost_release_after: its runner is gone for good, most likely
    // (SIGKILL, its host down), and its allocations would be held for ever.
    std::vector<std::string> abandoned;
    const auto release_after = options_.history.lost_release_after;
    if (release_after.count() > 0) {
      const int64_t now_ms = NowMs();
      for (const auto& [name, j] : jobs_) {
        if (j.lost() && now_ms - j.ended_ms() >= release_after.count()) abandoned.push_back(name);
      }
    }
    // With no event, what the observer refused goes again.
    const uint64_t ticket = events.empty() ? 0 : last_ticket_;
    QueueLocked(std::move(events));
    lock.unlock();
    Commit(ticket).IgnoreError();
    for (const std::string& name : abandoned) {
      // Lost still: its runner may have been heard meanwhile.
      Cancel(Identity{"deepnex-central", AuthRole::kAdmin, ""}, name,
             absl::StrCat("; its allocations were held ", release_after.count() / 1000.0,
                          " s more for it"),
             /*lost_only=*/true)
          .IgnoreError();
    }
    lock.lock();
  }
}

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const JobStoreOptions& options,
                                                         Allocator& allocator) {
  auto store = std::unique_ptr<JobStore>(new JobStore(options, allocator));
  if (!options.dir.empty()) {
    LedgerOptions lo;
    lo.fsync = options.fsync;
    DEEPNEX_ASSIGN_OR_RETURN(
        store->ledger_,
        Ledger::Open(options.dir, lo,
                     [s = store.get()](const std::string& r) { return s->Apply(r); }));
  }
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(store->mu_);
    store->PruneLocked(NowMs());
    ticket = store->last_ticket_;
    // Their runners get the timeout from now: central was not listening.
    for (const auto& [name, j] : store->jobs_) {
      if (!Ended(j)) store->heard_[name] = std::chrono::steady_clock::now();
      for (const pb::JobEventNote& n : j.unsent()) {
        JobEvent e = EventOf(n.kind(), j, n.reason());
        e.resized_from = n.resized_from();
        e.id = EventId(j, n.seq());
        store->unpublished_.push_back(std::move(e));
      }
    }
  }
  if (ticket != 0) DEEPNEX_RETURN_IF_ERROR(store->ledger_->Sync(ticket));
  return store;
}

void JobStore::StartWatching() {
  watcher_ = std::thread([this] { Watch(); });
}

absl::Status JobStore::Apply(const std::string& record) {
  pb::JobRecord r;
  if (!r.ParseFromString(record)) return absl::DataLossError("job store: a record does not parse");
  if (r.has_put()) {
    jobs_[r.put().name()] = r.put();
  } else if (r.has_sent()) {
    auto it = jobs_.find(r.sent().name());
    if (it != jobs_.end()) MarkSent(&it->second, r.sent().id());
  } else {
    jobs_.erase(r.drop());
  }
  return absl::OkStatus();
}

void JobStore::PutLocked(const pb::Job& job) {
  jobs_[job.name()] = job;
  if (!ledger_) return;
  pb::JobRecord r;
  *r.mutable_put() = job;
  AppendLocked(r);
}

void JobStore::PruneLocked(int64_t now_ms) {
  const JobHistoryOptions& history = options_.history;
  // Each user's ended records, oldest first: over the count or the bytes,
  // the user holding the most loses their oldest, so that one user's flood
  // of jobs pushes out only their own (a probe's 5 reports under a count
  // of 5 erased another user's whole history).
  struct Held {
    std::vector<std::tuple<int64_t, size_t, std::string>> ended;  // (ended_ms, bytes, name)
    size_t next = 0;                                               // ended[next] goes first
    size_t bytes = 0;
    size_t count() const { return ended.size() - next; }
  };
  std::map<std::string, Held> by_user;
  std::vector<std::string> drop;
  uint64_t count = 0, bytes = 0;
  for (const auto& [name, j] : jobs_) {
    if (!Ended(j)) continue;
    if (j.ended_ms() < now_ms - history.max_age.count()) {
      drop.push_back(name);
      continue;
    }
    Held& held = by_user[j.user()];
    held.ended.emplace_back(j.ended_ms(), j.ByteSizeLong(), name);
    held.bytes += std::get<1>(held.ended.back());
    ++count;
    bytes += std::get<1>(held.ended.back());
  }
  for (auto& [user, held] : by_user) std::sort(held.ended.begin(), held.ended.end());
  while (count > history.max_count || bytes > history.max_bytes) {
    const bool by_count = count > history.max_count;
    Held* most = nullptr;
    for (auto& [user, held] : by_user) {
      if (most == nullptr || (by_count ? held.count() > most->count() : held.bytes > most->bytes)) {
        most = &held;
      }
    }
    const auto& [ended_ms, size, name] = most->ended[most->next++];
    most->bytes -= size;
    --count;
    bytes -= size;
    drop.push_back(name);
  }
  for (const std::string& name : drop) {
    jobs_.erase(name);
    if (ledger_) {
      pb::JobRecord r;
      r.set_drop(name);
      AppendLocked(r);
    }
  }
}

void JobStore::AppendLocked(const pb::JobRecord& r) {
  const std::string bytes = r.SerializeAsString();
  appended_bytes_ += bytes.size();
  last_ticket_ = ledger_->Append(bytes);
}

void JobStore::RollBack() {
  std::lock_guard<std::mutex> lock(mu_);  // and so no Append meanwhile
  if (!ledger_->failed()) return;  // another caller rolled back already
  // The jobs as the disk has them: a refused report was still listed, and
  // the ledger refused every later write (a full disk, once it had room
  // again, failed each report until a restart).
  jobs_.clear();
  absl::Status s = ledger_->Recover([this](const std::string& r) { return Apply(r); });
  if (!s.ok()) std::fprintf(stderr, "deepnex-central: job store: %s\n", s.ToString().c_str());
  // A durable one's caller publishes it still.
  made_.erase(std::remove_if(made_.begin(), made_.end(),
                             [this](const auto& m) { return !ledger_->durable(m.first); }),
              made_.end());
}

void JobStore::QueueLocked(std::vector<JobEvent> events) {
  for (JobEvent& e : events) made_.emplace_back(last_ticket_, std::move(e));
}

void JobStore::SnapshotIfDueLocked() {
  // By bytes too: every report writes its job's whole record (a probe's 100
  // reports of one 3.5 MB job wrote 346 MB of log).
  if (!ledger_ || (ledger_->records_since_snapshot() < kSnapshotEvery + jobs_.size() &&
                   appended_bytes_ < kSnapshotBytes + snapshot_bytes_)) {
    return;
  }
  std::vector<std::string> records;
  size_t bytes = 0;
  for (const auto& [name, j] : jobs_) {
    pb::JobRecord r;
    *r.mutable_put() = j;
    records.push_back(r.SerializeAsString());
    bytes += records.back().size();
  }
  // A failed snapshot leaves the log, which still holds everything.
  absl::Status s = ledger_->Snapshot(records);
  if (!s.ok()) {
    std::fprintf(stderr, "deepnex-central: job store snapshot: %s\n", s.ToString().c_str());
    return;
  }
  appended_bytes_ = 0;
  snapshot_bytes_ = bytes;
}

absl::Status JobStore::Commit(uint64_t ticket) {
  if (ticket != 0) {
    absl::Status synced = ledger_->Sync(ticket);
    if (!synced.ok()) {
      RollBack();
      return synced;
    }
  }
  // One publisher at a time, the recovered events first: a job's events
  // reach the notifier in the order they were made.
  std::lock_guard<std::mutex> publishing(publish_mu_);
  std::vector<JobEvent> all = std::move(unpublished_);
  unpublished_.clear();
  {
    // Those made up to `ticket` are durable with it (the ledger writes in
    // order); those after it are their own callers'.
    std::lock_guard<std::mutex> lock(mu_);
    while (!made_.empty() && made_.front().first <= ticket) {
      all.push_back(std::move(made_.front().second));
      made_.pop_front();
    }
  }
  // A test's crash between a durable change and its Publish (issue 19's
  // "no event lost"): DEEPNEX_TEST_EXIT_BEFORE_PUBLISH=KIND.
  static const char* const exit_before = std::getenv("DEEPNEX_TEST_EXIT_BEFORE_PUBLISH");
  for (auto e = all.begin(); e != all.end(); ++e) {
    if (exit_before != nullptr && e->kind == exit_before) std::_Exit(86);
    absl::Status told = options_.on_event ? options_.on_event(*e) : absl::OkStatus();
    if (!told.ok()) {
      // Unsent in its job's record still; those after it wait, so that a
      // job's events keep their order.
      if (!refusing_) {
        std::fprintf(stderr, "deepnex-central: job event %s not published, tried again each "
                     "second: %s\n", e->id.c_str(), told.ToString().c_str());
      }
      refusing_ = true;
      unpublished_.assign(e, all.end());
      return absl::OkStatus();
    }
    refusing_ = false;
    // Not synced: lost, the event is published again and deduplicated.
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(e->job.name);
    if (it != jobs_.end() && MarkSent(&it->second, e->id) && ledger_) {
      pb::JobRecord r;
      r.mutable_sent()->set_name(e->job.name);
      r.mutable_sent()->set_id(e->id);
      AppendLocked(r);
    }
  }
  return absl::OkStatus();
}

std::string JobStore::ArchivedNameLocked(const std::string& name) const {
  const std::string prefix = name + "~";
  int64_t last = 0;
  for (auto it = jobs_.lower_bound(prefix);
       it != jobs_.end() && absl::StartsWith(it->first, prefix); ++it) {
    int64_t k;
    if (absl::SimpleAtoi(absl::string_view(it->first).substr(prefix.size()), &k)) {
      last = std::max(last, k);
    }
  }
  return absl::StrCat(prefix, last + 1);
}

absl::StatusOr<pb::Job*> JobStore::FindLocked(const Identity& who, const std::string& name) {
  auto it = jobs_.find(name);
  if (it == jobs_.end() || !CanSee(who, it->second)) {
    return absl::NotFoundError(absl::StrCat("job \"", name, "\" not found"));
  }
  return &it->second;
}

absl::StatusOr<pb::Job> JobStore::Report(const Identity& who, const pb::Job& in) {
  // Checked here, not only by deepnex run: a name and a run id make the
  // event id that webhooks carry in a header, where a CR LF from a C++
  // client's JobsClient::Report injected headers of its own.
  if (!IsJobName(in.name())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "name: ", Quoted(in.name()), " is not a job name ([a-z0-9][a-z0-9-]*, at most 40)"));
  }
  constexpr char kRunChars[] =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-";
  if (in.run().empty() || in.run().size() > 64 ||
      in.run().find_first_not_of(kRunChars) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "run: ", Quoted(in.run()), " is not a run id (1-64 letters, digits, '-' or '_')"));
  }
  DEEPNEX_RETURN_IF_ERROR(CheckReportBounds(in));
  DEEPNEX_ASSIGN_OR_RETURN(JobState state, ParseJobState(in.state(), "state"));
  std::optional<MetricThreshold> when;
  if (!in.notify_when().empty()) {
    DEEPNEX_ASSIGN_OR_RETURN(when, ParseMetricThreshold(in.notify_when(), "notify_when"));
  }
  if (in.notify_every_ms() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("notify_every_ms: ", in.notify_every_ms(), " is below 0"));
  }
  const std::string user = in.user().empty() ? who.name : in.user();
  if (who.role != AuthRole::kAdmin && user != who.name) {
    return absl::PermissionDeniedError(
        absl::StrCat("user ", who.name, " cannot run a job for user ", user));
  }
  if (!who.Reaches(in.name())) {
    return absl::PermissionDeniedError(absl::StrCat("the token of \"", who.name,
                                                    "\" is for job \"", who.job, "\", not \"",
                                                    in.name(), "\""));
  }
  // The grants that carry the job's name, read before mu_ as Cancel
  // releases them after it.
  std::vector<Allocation> granted;
  for (Allocation& a : allocator_.Allocations(user)) {
    if (a.job == in.name()) granted.push_back(std::move(a));
  }
  // This run of the caller's job. A run's id is no secret (it is in every
  // event's id, at every URL the events go to): with another user's job's
  // name and run, bob's reports were alice's job's, and told her URLs so.
  auto same_run = [&](const pb::Job& j) { return j.run() == in.run() && j.user() == user; };
  if (options_.check_notify_url && in.notify_size() > 0) {
    // Once per run: outside the lock, as it may ask the resolver. A run
    // already known had its URLs checked when it came.
    bool known;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = jobs_.find(in.name());
      known = it != jobs_.end() && same_run(it->second);
    }
    for (int i = 0; i < in.notify_size() && !known; ++i) {
      DEEPNEX_RETURN_IF_ERROR(options_.check_notify_url(user, in.notify(i)));
    }
  }
  std::vector<JobEvent> events;
  uint64_t ticket;
  pb::Job reply;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t now = NowMs();
    auto it = jobs_.find(in.name());
    pb::Job j;
    if (it != jobs_.end() && same_run(it->second)) {
      j = it->second;
    } else if (it != jobs_.end() && !(Ended(it->second) && it->second.user() == user)) {
      // Names are central-wide: allocations carry only the job's name.
      return absl::AlreadyExistsError(absl::StrCat(
          "job \"", in.name(), "\" exists: a job of that name ",
          Ended(it->second) ? "was run by another user" : "is running", "; choose another name"));
    } else {
      size_t live = 0;
      for (const auto& [name, other] : jobs_) live += !Ended(other) && other.user() == user;
      if (live >= kMaxLiveJobs) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "user ", user, " has ", live, " jobs that have not ended; at most ", kMaxLiveJobs,
            " (deepnex job cancel ends one)"));
      }
      if (it != jobs_.end()) {
        // A new run of the caller's ended job: the old run stays in the
        // history, as sacct keeps every run of a name (a probe's rerun
        // replaced a cancelled run without a word).
        pb::Job old = it->second;
        old.set_name(ArchivedNameLocked(in.name()));
        PutLocked(old);
      }
      j.set_name(in.name());
      j.set_user(user);
      j.set_run(in.run());
      j.set_state("pending");
      j.set_submitted_ms(now);
      *j.mutable_notify() = in.notify();  // before the first event: its URLs
      j.set_notify_every_ms(in.notify_every_ms());
      j.set_notify_when(in.notify_when());
      events.push_back(EventOf("queued", j));
    }
    if (j.lost()) {
      // Its runner is back (it was cut off): running again, or ended as it
      // says.
      j.set_lost(false);
      j.set_state(j.started_ms() != 0 ? "running" : "pending");
      j.set_ended_ms(0);
      j.set_exit_code(0);
      j.clear_message();
    }
    const int restarts_before = j.restarts();
    const int resizes_before = j.resizes();
    const int workers_before = j.workers();
    // What the runner knows; central keeps the state, times and who cancelled.
    *j.mutable_command() = in.command();
    j.set_mode(in.mode());
    j.set_workers(in.workers());
    j.set_min_workers(in.min_workers());
    j.set_max_workers(in.max_workers());
    j.set_resizes(in.resizes());
    j.set_last_resize(in.last_resize());
    j.set_ps(in.ps());
    *j.mutable_allocations() = AllocationsOf(in, j, granted);
    *j.mutable_nodes() = in.nodes();
    *j.mutable_containers() = in.containers();
    j.set_restarts(in.restarts());
    if (in.report().time_ms() > j.report().time_ms()) {
      *j.mutable_report() = in.report();
      ProgressLocked(&j, when, now, &events);
    }
    if (j.state() == "cancelled") {
      if (JobEnded(state)) j.set_exit_code(in.exit_code());
    } else if (!Ended(j)) {
      if (state != JobState::kPending && j.started_ms() == 0) {
        j.set_started_ms(now);
        j.set_state("running");
        events.push_back(EventOf("started", j));
      }
      if (j.restarts() > restarts_before) events.push_back(EventOf("worker restarted", j));
      // Resizes between two reports are told as one, from the count before.
      if (j.resizes() > resizes_before && j.workers() != workers_before) {
        events.push_back(EventOf("resized", j, j.last_resize()));
        events.back().resized_from = workers_before;
      }
      if (JobEnded(state)) {
        j.set_state(JobStateName(state));
        j.set_ended_ms(now);
        j.set_exit_code(in.exit_code());
        // Cut, not refused: it comes with the run's last report.
        j.set_message(CutText(in.message(), kMaxMessage));
        events.push_back(EventOf(j.state(), j));
      }
    }
    Note(&j, &events, 0);
    PutLocked(j);
    reply = Filled(j, now);
    if (Ended(j)) {
      heard_.erase(j.name());
      PruneLocked(now);
    } else {
      heard_[j.name()] = std::chrono::steady_clock::now();
    }
    ticket = last_ticket_;
    QueueLocked(std::move(events));
    SnapshotIfDueLocked();
  }
  DEEPNEX_RETURN_IF_ERROR(Commit(ticket));
  return reply;
}

void JobStore::ProgressLocked(pb::Job* j, const std::optional<MetricThreshold>& when,
                              int64_t now_ms, std::vector<JobEvent>* events) {
  if (Ended(*j)) return;
  auto record = FromProto(*j);
  if (!record.ok()) return;
  // One event per report: the threshold's, once, says more than a periodic one.
  if (when && !j->when_fired() && when->HoldsFor(record->report)) {
    j->set_when_fired(true);
    j->set_progress_sent_ms(now_ms);
    events->push_back(EventOf("progress", *j, "when"));
  } else if (j->notify_every_ms() > 0 &&
             now_ms - std::max(j->progress_sent_ms(), j->started_ms()) >= j->notify_every_ms()) {
    j->set_progress_sent_ms(now_ms);
    events->push_back(EventOf("progress", *j, "every"));
  }
}

absl::StatusOr<std::vector<pb::Job>> JobStore::List(const Identity& who,
                                                    const pb::JobsRequest& req) {
  std::string user = req.user();
  if (who.role != AuthRole::kAdmin) {
    if (!user.empty() && user != who.name) {
      return absl::PermissionDeniedError(
          absl::StrCat("user ", who.name, " cannot list the jobs of ", user));
    }
    user = who.name;
  }
  if (!req.state().empty()) DEEPNEX_RETURN_IF_ERROR(ParseJobState(req.state(), "state").status());
  std::vector<pb::Job> out;
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t now = NowMs();
  for (const auto& [name, j] : jobs_) {
    if (!CanSee(who, j) || (!user.empty() && j.user() != user)) continue;
    if (!req.state().empty()) {
      if (j.state() != req.state()) continue;
    } else if (!req.all() && req.since_ms() == 0 && Ended(j)) {
      continue;
    }
    if (req.since_ms() != 0 && j.ended_ms() != 0 && j.ended_ms() < req.since_ms()) continue;
    out.push_back(Filled(j, now));
  }
  std::sort(out.begin(), out.end(), [](const pb::Job& a, const pb::Job& b) {
    return std::make_pair(a.submitted_ms(), a.name()) < std::make_pair(b.submitted_ms(), b.name());
  });
  return out;
}

absl::StatusOr<pb::Job> JobStore::Get(const Identity& who, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  DEEPNEX_ASSIGN_OR_RETURN(pb::Job * j, FindLocked(who, name));
  return Filled(*j, NowMs());
}

absl::StatusOr<pb::Job> JobStore::Cancel(const Identity& who, const std::string& name,
                                         const std::string& why, bool lost_only) {
  pb::Job j;
  uint64_t ticket;
  std::vector<JobEvent> events;
  {
    std::lock_guard<std::mutex> lock(mu_);
    DEEPNEX_ASSIGN_OR_RETURN(pb::Job * found, FindLocked(who, name));
    // A lost job ended only in central's eyes: its allocations stay for a
    // runner that was cut off, and cancelling it is how its user lets them
    // go (a probe's lost job could only be released by allocation id).
    if ((Ended(*found) || lost_only) && !found->lost()) {
      return absl::FailedPreconditionError(
          absl::StrCat("job \"", name, "\" already ended: ", found->state()));
    }
    j = *found;
    const int64_t now = NowMs();
    j.set_state("cancelled");
    j.set_ended_ms(now);
    j.set_cancelled_by(who.name);
    j.set_message(absl::StrCat("cancelled by ", who.name,
                               j.lost() ? absl::StrCat(" after it was ", j.message()) : "", why));
    j.set_lost(false);  // a runner that comes back finds it cancelled
    events.push_back(EventOf("cancelled", j));
    Note(&j, &events, 0);
    PutLocked(j);
    PruneLocked(now);
    ticket = last_ticket_;
    QueueLocked(std::move(events));
    SnapshotIfDueLocked();
  }
  DEEPNEX_RETURN_IF_ERROR(Commit(ticket));
  // What it waits for in the queue is never granted: its runner's
  // allocate fails at once.
  for (const PendingRequest& p : allocator_.Pending(j.user())) {
    uint64_t ticket = 0;
    if (p.request.job == name && absl::SimpleAtoi(p.id.substr(1), &ticket)) {
      allocator_.Withdraw(ticket);
    }
  }
  // Central's launcher stops the containers on these within a second; the
  // runner stops its own at its next report.
  for (const Allocation& a : allocator_.Allocations(j.user())) {
    if (a.job == name) allocator_.Release(a.id).IgnoreError();
  }
  return Filled(j, NowMs());
}

namespace {

class JobsService final : public pb::Jobs::CallbackService {
 public:
  JobsService(JobStore& store, const TokenTable& tokens) : store_(store), tokens_(tokens) {}

  grpc::ServerUnaryReactor* ReportJob(grpc::CallbackServerContext* ctx, const pb::Job* req,
                                      pb::Job* reply) override {
    return Answer(ctx, [&](const Identity& who) { return store_.Report(who, *req); }, reply);
  }
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* ctx, const pb::JobName* req,
                                   pb::Job* reply) override {
    return Answer(ctx, [&](const Identity& who) { return store_.Get(who, req->name()); }, reply);
  }
  grpc::ServerUnaryReactor* CancelJob(grpc::CallbackServerContext* ctx, const pb::JobName* req,
                                      pb::Job* reply) override {
    return Answer(ctx, [&](const Identity& who) { return store_.Cancel(who, req->name()); },
                  reply);
  }
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx,
                                     const pb::JobsRequest* req, pb::JobList* reply) override {
    auto who = AuthenticateCall(tokens_, *ctx);
    if (!who.ok()) return Reply(ctx, who.status());
    auto jobs = store_.List(*who, *req);
    if (jobs.ok()) {
      for (auto& j : *jobs) *reply->add_jobs() = std::move(j);
    }
    return Reply(ctx, jobs.status());
  }

 private:
  template <class Fn>
  grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* ctx, Fn fn, pb::Job* reply) {
    auto who = AuthenticateCall(tokens_, *ctx);
    if (!who.ok()) return Reply(ctx, who.status());
    absl::StatusOr<pb::Job> job = fn(*who);
    if (job.ok()) *reply = std::move(*job);
    return Reply(ctx, job.status());
  }

  JobStore& store_;
  const TokenTable& tokens_;
};

}  // namespace

std::unique_ptr<grpc::Service> JobStore::MakeService(const TokenTable& tokens) {
  return std::make_unique<JobsService>(*this, tokens);
}

}  // namespace deepnex::gpu
