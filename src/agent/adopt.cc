#include "agent/adopt.h"

#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <iostream>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "agent/report.h"
#include "core/file_util.h"
#include "deepnex/units.h"
#include "launch/cgroup.h"
#include "launch/command.h"
#include "launch/docker.h"
#include "launch/record.h"
#include "launch/procfs.h"
#include "launch/util.h"

namespace deepnex::agent {
namespace {

constexpr std::chrono::milliseconds kPoll{100};
constexpr std::chrono::seconds kRuncTimeout{30};

// The record of a container whose process is gone, or whose pid now names
// another process, as ended: "lost", as its exit went with its parent. So
// neither `deepnex ps` nor a later agent takes it for running.
void RecordEnded(const std::string& path, nlohmann::json r) {
  launch::ExitStatus e;
  e.reason = launch::ExitReason::kLost;
  e.restarts = r.value("restarts", 0);
  r["state"] = launch::StateName(launch::State::kExited);
  r["last_exit"] = e.ToString();
  r.erase("start_time");
  WriteFileAtomically(path, r.dump(1) + "\n").IgnoreError();
}

// The spec of the recorded container, as far as its record tells.
launch::ContainerSpec RecordedSpec(const nlohmann::json& r) {
  launch::ContainerSpec spec;
  spec.name = r.value("name", "");
  spec.user = r.value("user", "");
  spec.cpus = r.value("cpus", 0.0);
  spec.memory = r.value("memory", uint64_t{0});
  if (!r.value("allocation", "").empty()) {
    gpu::Allocation a;
    a.id = r.value("allocation", "");
    a.user = spec.user;
    spec.allocation = a;
  }
  return spec;
}

// The recorded container, running its run `id`.
launch::ContainerStatus RecordedStatus(const nlohmann::json& r, const std::string& id) {
  launch::ContainerStatus st;
  st.name = r.value("name", "");
  st.id = id;
  st.state = launch::State::kRunning;
  st.restarts = r.value("restarts", 0);
  st.started_at = std::chrono::system_clock::time_point(
      std::chrono::duration_cast<std::chrono::system_clock::duration>(
          std::chrono::duration<double>(r.value("started_at", 0.0))));
  return st;
}

// How an adopted container is reached, by its backend.
struct Reach {
  // Sends a signal to every process of the container.
  std::function<void(int sig)> signal;
  // Once it ended (oci: runc's state of it); may be empty.
  std::function<void()> remove;
  std::string cgroup;  // the record's, for usage; empty: none
};

// runc as the oci backend calls it (its --root), for adopted containers.
struct Runc {
  std::string binary, root;
  absl::StatusOr<std::string> Call(std::vector<std::string> args) const {
    args.insert(args.begin(), {binary, "--root", root});
    DEEPNEX_ASSIGN_OR_RETURN(launch::CommandResult r,
                             launch::RunCommand(args, launch::OwnEnv(), kRuncTimeout));
    if (!r.ok()) return absl::UnavailableError(launch::DescribeFailure(args, r));
    return r.out;
  }
};

// What every adopted container shares: waiting by polling its status, its
// logs from ReadLogs.
class AdoptedBase : public launch::Handle {
 public:
  explicit AdoptedBase(launch::ContainerSpec spec) : spec_(std::move(spec)) {}

  const launch::ContainerSpec& spec() const override { return spec_; }

  absl::StatusOr<launch::ExitStatus> Wait(std::chrono::milliseconds timeout) override {
    timeout = CappedWait(timeout);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      launch::ContainerStatus st = Status();
      if (st.state == launch::State::kStopped || st.state == launch::State::kExited) {
        return *st.last_exit;
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("container \"", spec_.name, "\" still runs"));
      }
      std::this_thread::sleep_for(kPoll);
    }
  }

  absl::StatusOr<std::string> Logs() override {
    DEEPNEX_ASSIGN_OR_RETURN(launch::LogChunk c, ReadLogs(0, UINT64_MAX));
    return c.data;
  }

  absl::Status FollowLogs(const std::function<bool(const std::string&)>& sink) override {
    return FollowByReading(*this, sink, kPoll);
  }

 protected:
  bool Ended() {
    launch::ContainerStatus st = Status();
    return st.state == launch::State::kStopped || st.state == launch::State::kExited;
  }

  // What `read` measures while the container runs, else its last reading:
  // an ended run's cgroup (or engine container) goes with it, and a usage
  // that then fell to nothing took its CPU seconds (a counter, a job's
  // CPU-hours) and memory peak with it.
  absl::StatusOr<launch::Usage> Measured(
      const std::function<absl::StatusOr<launch::Usage>()>& read) {
    std::lock_guard<std::mutex> lock(usage_mu_);
    if (!Ended()) {
      absl::StatusOr<launch::Usage> now = read();
      if (now.ok()) last_usage_ = *now;
      return last_usage_;
    }
    launch::Usage ended = last_usage_;  // nothing of it runs now
    ended.memory = 0;
    ended.pids = 0;
    ended.gpu_memory.clear();
    return ended;
  }

 private:
  const launch::ContainerSpec spec_;
  std::mutex usage_mu_;
  launch::Usage last_usage_;
};

// A process or oci container: its process, its log file and its cgroup.
class Adopted final : public AdoptedBase {
 public:
  Adopted(launch::ContainerSpec spec, pid_t pid, uint64_t start_time, std::string log,
          launch::ContainerStatus st, Reach reach)
      : AdoptedBase(std::move(spec)), pid_(pid), start_time_(start_time), log_(std::move(log)),
        status_(std::move(st)), reach_(std::move(reach)) {}

  launch::ContainerStatus Status() override {
    launch::ContainerStatus st;
    bool ended_now = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Gone, or its pid reused since: the start time tells.
      if (status_.state == launch::State::kRunning &&
          (!launch::ProcessAlive(pid_) || launch::ProcessStartTime(pid_) != start_time_)) {
        status_.state = stopped_ ? launch::State::kStopped : launch::State::kExited;
        launch::ExitStatus e;
        e.reason = stopped_ ? launch::ExitReason::kSignaled : launch::ExitReason::kLost;
        e.signal = stopped_ ? SIGTERM : 0;
        e.restarts = status_.restarts;
        status_.last_exit = e;
        ended_now = true;
      }
      st = status_;
    }
    // Nothing reads what the backend keeps of it after its end (its exit
    // went with its parent), so it goes now, once.
    if (ended_now && reach_.remove) reach_.remove();
    return st;
  }

  absl::Status Stop(std::chrono::milliseconds grace) override {
    grace = CappedWait(grace);
    // An ended one's pid may be another process's by now.
    if (Ended()) return absl::OkStatus();
    bool first;
    {
      std::lock_guard<std::mutex> lock(mu_);
      first = !stopped_;
      stopped_ = true;
    }
    // The TERM goes once (as the launcher's backends send it); a later Stop
    // with a shorter grace kills sooner.
    if (first) reach_.signal(SIGTERM);
    if (Wait(grace).ok()) return absl::OkStatus();
    reach_.signal(SIGKILL);
    return Wait(std::chrono::seconds(10)).status();
  }

  // Offsets count the current run's output only.
  absl::StatusOr<launch::LogChunk> ReadLogs(uint64_t offset, uint64_t max_bytes) override {
    const bool ended = Ended();
    std::ifstream f(log_, std::ios::binary);
    launch::LogChunk c;
    c.next_offset = offset;
    if (!f) {
      c.ended = ended;
      return c;
    }
    f.seekg(0, std::ios::end);
    const uint64_t size = static_cast<uint64_t>(f.tellg());
    if (offset < size) {
      const uint64_t n = std::min(size - offset, max_bytes);
      c.data.resize(n);
      f.seekg(static_cast<std::streamoff>(offset));
      f.read(c.data.data(), static_cast<std::streamsize>(n));
      c.next_offset = offset + n;
    }
    c.ended = ended && c.next_offset >= size;
    return c;
  }

  absl::StatusOr<launch::Usage> Usage() override {
    if (reach_.cgroup.empty()) return launch::Usage{};
    return Measured([&]() -> absl::StatusOr<launch::Usage> {
      DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<launch::Cgroup> cg,
                               launch::Cgroup::Open(reach_.cgroup));
      return cg->ReadUsage();
    });
  }

 private:
  const pid_t pid_;
  const uint64_t start_time_;
  const std::string log_;
  std::mutex mu_;
  launch::ContainerStatus status_;
  const Reach reach_;
  bool stopped_ = false;
};

// A docker container: its run on the engine, found by its labels; logs,
// usage, stop and its exit through the engine's API.
class AdoptedDocker final : public AdoptedBase {
 public:
  AdoptedDocker(launch::ContainerSpec spec, std::unique_ptr<launch::Run> run,
                launch::ContainerStatus st)
      : AdoptedBase(std::move(spec)), run_(std::move(run)), status_(std::move(st)) {}

  // Once central removed it (or the agent stops): the engine's container
  // goes too, as the launcher's Remove deletes its own.
  ~AdoptedDocker() override {
    if (Ended()) run_->Remove().IgnoreError();
  }

  launch::ContainerStatus Status() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_.state != launch::State::kRunning) return status_;
    absl::StatusOr<std::optional<launch::ExitStatus>> exit =
        run_->Wait(std::chrono::milliseconds(0));
    if (exit.ok() && !exit->has_value()) return status_;
    launch::ExitStatus e;
    if (exit.ok()) {
      e = **exit;
    } else {
      e.reason = launch::ExitReason::kLost;  // the engine cannot tell
    }
    e.restarts = status_.restarts;
    status_.state = stopped_ ? launch::State::kStopped : launch::State::kExited;
    status_.last_exit = e;
    return status_;
  }

  absl::Status Stop(std::chrono::milliseconds grace) override {
    grace = CappedWait(grace);
    if (Ended()) return absl::OkStatus();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
    }
    // SIGTERM now, SIGKILL after `grace`.
    DEEPNEX_RETURN_IF_ERROR(run_->Stop(grace));
    return Wait(grace + std::chrono::seconds(10)).status();
  }

  // The engine keeps the current run's output; offsets count it.
  absl::StatusOr<launch::LogChunk> ReadLogs(uint64_t offset, uint64_t max_bytes) override {
    const bool ended = Ended();
    DEEPNEX_ASSIGN_OR_RETURN(std::string all, run_->Logs());
    launch::LogChunk c;
    c.next_offset = offset;
    if (offset < all.size()) {
      c.data = all.substr(offset, std::min<uint64_t>(all.size() - offset, max_bytes));
      c.next_offset = offset + c.data.size();
    }
    c.ended = ended && c.next_offset >= all.size();
    return c;
  }

  absl::StatusOr<launch::Usage> Usage() override {
    return Measured([&] { return run_->Usage(); });
  }

 private:
  const std::unique_ptr<launch::Run> run_;
  std::mutex mu_;
  launch::ContainerStatus status_;
  bool stopped_ = false;
};

}  // namespace

std::vector<std::shared_ptr<launch::Handle>> AdoptOrphans(const launch::LauncherOptions& options,
                                                          const std::string& own_launcher_id) {
  std::vector<std::shared_ptr<launch::Handle>> out;
  const std::string& state_dir = options.state_dir;
  const std::string& backend = options.backend;
  if (state_dir.empty() || (backend != "process" && backend != "oci" && backend != "docker")) {
    return out;
  }
  Runc runc{options.oci.runc, options.oci.root.empty() ? state_dir + "/runc" : options.oci.root};
  if (backend == "oci") {
    absl::StatusOr<std::string> found = launch::FindOnPath(runc.binary, launch::PathOf({}));
    if (!found.ok()) return out;  // the launcher's Create said why already
    runc.binary = *found;
  }
  std::error_code ec;
  for (const auto& dir : std::filesystem::directory_iterator(state_dir + "/containers", ec)) {
    const std::string path = dir.path().string() + "/" + launch::kRecordFile;
    auto text = ReadWholeFile(path, "container record");
    if (!text.ok()) continue;
    nlohmann::json r = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (!r.is_object() || r.value("backend", "") != backend) continue;
    // The agent's launcher holds the state_dir's lock: any other launcher
    // of a record here is gone, whatever its pid shows now.
    if (r.value("launcher_id", "") == own_launcher_id) continue;
    const std::string state = r.value("state", "");
    if (state != "running" && state != "starting" && state != "restarting") continue;
    const std::string id = r.value("id", "");
    if (backend == "docker") {
      // Found by the labels its launcher set, as that launcher's Cleanup
      // finds them.
      absl::StatusOr<std::unique_ptr<launch::Run>> run =
          launch::FindDockerRun(options, r.value("launcher_id", ""), r.value("name", ""));
      if (absl::IsNotFound(run.status())) {
        RecordEnded(path, std::move(r));
      } else if (!run.ok()) {
        std::cerr << "deepnex-agent: container " << r.value("name", "")
                  << ": not re-attached: " << run.status().message() << "\n";
      } else {
        launch::ContainerStatus st = RecordedStatus(r, (*run)->id());
        out.push_back(
            std::make_shared<AdoptedDocker>(RecordedSpec(r), std::move(*run), std::move(st)));
      }
      continue;
    }
    pid_t pid = 0;
    Reach reach;
    reach.cgroup = r.value("cgroup", "");
    if (backend == "process") {
      try {
        pid = static_cast<pid_t>(std::stol(id));
      } catch (...) {
        continue;
      }
      // A pid alone may be another process's by now: the start time
      // recorded with it tells.
      const std::optional<uint64_t> start = launch::ProcessStartTime(pid);
      const uint64_t recorded = r.value("start_time", uint64_t{0});
      if (!start || !launch::ProcessAlive(pid) || *start != recorded) {
        if (start) {
          std::cerr << "deepnex-agent: container " << r.value("name", "") << ": pid " << pid
                    << " is another process now (start_time " << *start << ", recorded "
                    << recorded << "): not re-attached\n";
        }
        RecordEnded(path, std::move(r));
        continue;
      }
      // The process backend made it a session (and group) leader.
      reach.signal = [pid](int sig) { kill(-pid, sig); };
      // At its end what it left goes, and its cgroup, as the launcher's
      // Remove does for its own runs.
      if (!reach.cgroup.empty()) {
        reach.remove = [cgroup = reach.cgroup] {
          if (auto cg = launch::Cgroup::Open(cgroup); cg.ok()) (*cg)->Remove().IgnoreError();
        };
      }
    } else {
      // The run name is runc's id; its init's pid is in runc's state.
      absl::StatusOr<std::string> state = runc.Call({"state", id});
      if (!state.ok()) continue;
      nlohmann::json s = nlohmann::json::parse(*state, nullptr, /*allow_exceptions=*/false);
      if (!s.is_object() || s.value("status", "") != "running") continue;
      pid = s.value("pid", 0);
      reach.signal = [runc, id](int sig) {
        runc.Call({"kill", "--all", id, std::to_string(sig)}).IgnoreError();
      };
      reach.remove = [runc, id] { runc.Call({"delete", "--force", id}).IgnoreError(); };
    }
    if (pid <= 1 || !launch::ProcessAlive(pid)) continue;
    const std::optional<uint64_t> start_time = launch::ProcessStartTime(pid);
    if (!start_time) continue;
    launch::ContainerStatus st = RecordedStatus(r, id);
    const std::string log =
        absl::StrCat(dir.path().string(), "/run-", st.restarts, "/output.log");
    out.push_back(
        std::make_shared<Adopted>(RecordedSpec(r), pid, *start_time, log, std::move(st),
                                  std::move(reach)));
  }
  return out;
}

}  // namespace deepnex::agent
