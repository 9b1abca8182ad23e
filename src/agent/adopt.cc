#include "agent/adopt.h"

#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "agent/report.h"
#include "core/file_util.h"
#include "launch/cgroup.h"
#include "launch/command.h"
#include "launch/util.h"

namespace deepnex::agent {
namespace {

constexpr std::chrono::milliseconds kPoll{100};
constexpr std::chrono::seconds kRuncTimeout{30};

// Alive and not a zombie (an orphan's zombie is init's to reap).
bool Alive(pid_t pid) {
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(") ");
  return paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] != 'Z' &&
         text[paren + 2] != 'X';
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

class Adopted final : public launch::Handle {
 public:
  Adopted(launch::ContainerSpec spec, pid_t pid, std::string log, launch::ContainerStatus st,
          Reach reach)
      : spec_(std::move(spec)), pid_(pid), log_(std::move(log)), status_(std::move(st)),
        reach_(std::move(reach)) {}

  const launch::ContainerSpec& spec() const override { return spec_; }

  launch::ContainerStatus Status() override {
    launch::ContainerStatus st;
    bool ended_now = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (status_.state == launch::State::kRunning && !Alive(pid_)) {
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

  absl::StatusOr<launch::ExitStatus> Wait(std::chrono::milliseconds timeout) override {
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

  absl::Status Stop(std::chrono::milliseconds grace) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
    }
    reach_.signal(SIGTERM);
    if (Wait(grace).ok()) return absl::OkStatus();
    reach_.signal(SIGKILL);
    return Wait(std::chrono::seconds(10)).status();
  }

  absl::StatusOr<std::string> Logs() override {
    DEEPNEX_ASSIGN_OR_RETURN(launch::LogChunk c, ReadLogs(0, UINT64_MAX));
    return c.data;
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

  absl::Status FollowLogs(const std::function<bool(const std::string&)>& sink) override {
    return FollowByReading(*this, sink, kPoll);
  }

  absl::StatusOr<launch::Usage> Usage() override {
    if (reach_.cgroup.empty() || Ended()) return launch::Usage{};
    absl::StatusOr<std::unique_ptr<launch::Cgroup>> cg = launch::Cgroup::Open(reach_.cgroup);
    if (!cg.ok()) return launch::Usage{};
    return (*cg)->ReadUsage();
  }

 private:
  bool Ended() {
    launch::ContainerStatus st = Status();
    return st.state == launch::State::kStopped || st.state == launch::State::kExited;
  }

  const launch::ContainerSpec spec_;
  const pid_t pid_;
  const std::string log_;
  std::mutex mu_;
  launch::ContainerStatus status_;
  const Reach reach_;
  bool stopped_ = false;
};

}  // namespace

std::vector<std::shared_ptr<launch::Handle>> AdoptOrphans(const launch::LauncherOptions& options,
                                                          const std::string& own_launcher_id) {
  std::vector<std::shared_ptr<launch::Handle>> out;
  const std::string& state_dir = options.state_dir;
  const std::string& backend = options.backend;
  if (state_dir.empty() || (backend != "process" && backend != "oci")) return out;
  Runc runc{options.oci.runc, options.oci.root.empty() ? state_dir + "/runc" : options.oci.root};
  if (backend == "oci") {
    absl::StatusOr<std::string> found = launch::FindOnPath(runc.binary, launch::PathOf({}));
    if (!found.ok()) return out;  // the launcher's Create said why already
    runc.binary = *found;
  }
  std::error_code ec;
  for (const auto& dir : std::filesystem::directory_iterator(state_dir + "/containers", ec)) {
    auto text = ReadWholeFile(dir.path().string() + "/record.json", "container record");
    if (!text.ok()) continue;
    nlohmann::json r = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (!r.is_object() || r.value("backend", "") != backend) continue;
    const int launcher_pid = r.value("launcher_pid", 0);
    if (r.value("launcher_id", "") == own_launcher_id ||
        (launcher_pid > 0 && (launcher_pid == getpid() || Alive(launcher_pid)))) {
      continue;
    }
    const std::string state = r.value("state", "");
    if (state != "running" && state != "starting" && state != "restarting") continue;
    const std::string id = r.value("id", "");
    pid_t pid = 0;
    Reach reach;
    reach.cgroup = r.value("cgroup", "");
    if (backend == "process") {
      try {
        pid = static_cast<pid_t>(std::stol(id));
      } catch (...) {
        continue;
      }
      // The process backend made it a session (and group) leader.
      reach.signal = [pid](int sig) { kill(-pid, sig); };
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
    if (pid <= 1 || !Alive(pid)) continue;
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
    launch::ContainerStatus st;
    st.name = spec.name;
    st.id = id;
    st.state = launch::State::kRunning;
    st.restarts = r.value("restarts", 0);
    st.started_at = std::chrono::system_clock::time_point(
        std::chrono::duration_cast<std::chrono::system_clock::duration>(
            std::chrono::duration<double>(r.value("started_at", 0.0))));
    const std::string log =
        absl::StrCat(dir.path().string(), "/run-", st.restarts, "/output.log");
    out.push_back(
        std::make_shared<Adopted>(std::move(spec), pid, log, std::move(st), std::move(reach)));
  }
  return out;
}

}  // namespace deepnex::agent
