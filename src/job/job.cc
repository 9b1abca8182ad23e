#include "deepnex/job/job.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "deepnex/collective/store.h"
#include "deepnex/env.h"
#include "deepnex/gpu/allocator.h"
#include "deepnex/gpu/central.h"
#include "deepnex/gpu/discovery.h"
#include "core/file_util.h"
#include "launch/util.h"
#include "nlohmann/json.hpp"

extern char** environ;

namespace deepnex::job {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

bool ValidJobName(const std::string& name) {
  if (name.empty() || name.size() > 40) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    char c = name[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || (i > 0 && c == '-');
    if (!ok) return false;
  }
  return true;
}

// A port the OS considers free now. The parameter servers listen on fixed
// ports (not :0) so that one restarted by its policy comes back where the
// workers already look for it.
absl::StatusOr<int> ReservePort() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("no free port: ", strerror(err)));
  }
  close(fd);
  return ntohs(addr.sin_port);
}

bool Connects(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

// The job's processes inherit this process's environment, as mpirun's and
// torchrun's do (PATH, PYTHONPATH, HOME, ...), minus any job variables of an
// enclosing job.
std::map<std::string, std::string> InheritedEnv() {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    size_t eq = kv.find('=');
    if (eq == std::string::npos) continue;
    std::string key = kv.substr(0, eq);
    if (key.rfind("DEEPNEX_", 0) == 0 && key != "DEEPNEX_BUILD_DIR" && key != "DEEPNEX_PS_BIN") {
      continue;
    }
    if (key == "CUDA_VISIBLE_DEVICES" || key == "NVIDIA_VISIBLE_DEVICES" || key == "RANK" ||
        key == "WORLD_SIZE" || key == "LOCAL_RANK" || key == "LOCAL_WORLD_SIZE" ||
        key == "MASTER_ADDR" || key == "MASTER_PORT") {
      continue;
    }
    env[key] = kv.substr(eq + 1);
  }
  return env;
}

int ExitCodeOf(const launch::ExitStatus& e) {
  switch (e.reason) {
    case launch::ExitReason::kExited: return e.code;
    case launch::ExitReason::kSignaled: return 128 + e.signal;
    case launch::ExitReason::kOomKilled: return 137;
    case launch::ExitReason::kLost: return 1;
  }
  return 1;
}

// Where the allocations come from: a local allocator over this machine, or
// deepnex-central.
class AllocationSource {
 public:
  static absl::StatusOr<std::unique_ptr<AllocationSource>> Create(const JobOptions& o) {
    auto a = std::unique_ptr<AllocationSource>(new AllocationSource);
    if (o.central.empty()) {
      DEEPNEX_ASSIGN_OR_RETURN(a->local_, gpu::Allocator::Create());
      DEEPNEX_ASSIGN_OR_RETURN(gpu::Node node, gpu::LocalNode("", o.gpu_mode));
      DEEPNEX_RETURN_IF_ERROR(a->local_->AddNode(node));
    } else {
      gpu::CentralClientOptions co;
      co.address = o.central;
      co.token = o.central_token;
      co.token_file = o.central_token_file;
      DEEPNEX_ASSIGN_OR_RETURN(a->central_, gpu::CentralClient::Create(co));
    }
    return a;
  }

  // All of the gang or nothing. The local allocator refuses what does not
  // fit now (nothing else would free it); deepnex-central queues it.
  absl::StatusOr<std::vector<gpu::Allocation>> Gang(const gpu::Request& request) {
    if (local_ != nullptr) {
      gpu::AllocateOptions ao;
      ao.wait = false;
      return local_->AllocateGang(request, ao);
    }
    return central_->AllocateGang(request);
  }

  absl::Status Release(const std::string& id) {
    return local_ != nullptr ? local_->Release(id) : central_->Release(id);
  }

 private:
  AllocationSource() = default;
  std::unique_ptr<gpu::Allocator> local_;
  std::unique_ptr<gpu::CentralClient> central_;
};

class JobImpl : public Job {
 public:
  explicit JobImpl(JobOptions options) : o_(std::move(options)) {}
  ~JobImpl() override {
    Stop().IgnoreError();
    launcher_.reset();
    std::error_code ignored;
    std::filesystem::remove_all(job_dir_, ignored);
  }

  const std::string& name() const override { return o_.name; }

  absl::Status Init() {
    if (o_.name.empty()) o_.name = "job-" + launch::RandomHex(4);
    if (!ValidJobName(o_.name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "name: \"", o_.name, "\" is not a job name ([a-z0-9][a-z0-9-]*, at most 40)"));
    }
    if (o_.command.empty()) return absl::InvalidArgumentError("command: empty");
    if (o_.workers < 1) {
      return absl::InvalidArgumentError(absl::StrCat("workers: ", o_.workers, " is below 1"));
    }
    std::string mode = o_.mode;
    if (mode.rfind("ssp:", 0) == 0) {
      int staleness = -1;
      if (!absl::SimpleAtoi(mode.substr(4), &staleness) || staleness < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "mode: \"", o_.mode, "\": ssp takes a staleness >= 0, e.g. ssp:2"));
      }
      ps_mode_ = "ssp";
      staleness_ = staleness;
    } else if (mode == "sync" || mode == "async") {
      ps_mode_ = mode;
    } else if (mode != "allreduce") {
      return absl::InvalidArgumentError(absl::StrCat(
          "mode: \"", o_.mode, "\" is not sync, ssp:S, async or allreduce"));
    }
    if (o_.ps < -1) return absl::InvalidArgumentError(absl::StrCat("ps: ", o_.ps, " is below 0"));
    if (o_.ps == -1) o_.ps = ps_mode_.empty() ? 0 : 1;
    if (!ps_mode_.empty() && o_.ps == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("ps: 0 parameter servers for mode \"", o_.mode, "\""));
    }
    if (o_.gpus_per_worker < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("gpus_per_worker: ", o_.gpus_per_worker, " is below 0"));
    }
    if (!(o_.cpus >= 0) || !std::isfinite(o_.cpus)) {
      return absl::InvalidArgumentError(absl::StrCat("cpus: ", o_.cpus, " is not >= 0"));
    }
    if (!(o_.lr > 0) || !std::isfinite(o_.lr)) {
      return absl::InvalidArgumentError(absl::StrCat("lr: ", o_.lr, " is not > 0"));
    }
    if (!(o_.momentum >= 0 && o_.momentum < 1)) {
      return absl::InvalidArgumentError(absl::StrCat("momentum: ", o_.momentum, " is not in [0, 1)"));
    }
    // deepnex-central knows who the token is; only a local allocator needs
    // to be told.
    if (o_.user.empty() && o_.central.empty()) {
      const char* user = getenv("USER");
      o_.user = user != nullptr && *user != '\0' ? user : "root";
    }
    if (o_.ps > 0) {
      if (o_.ps_binary.empty()) {
        const char* bin = getenv("DEEPNEX_PS_BIN");
        o_.ps_binary = bin != nullptr && *bin != '\0' ? bin : "deepnex-ps";
      }
      DEEPNEX_ASSIGN_OR_RETURN(o_.ps_binary, launch::FindOnPath(o_.ps_binary, launch::PathOf({})));
    }
    // Each line is one write, so that lines from workers, parameter servers and the
    // job itself, written to the same pipe, never interleave within a line.
    if (!o_.output) {
      o_.output = [](const std::string& who, const std::string& line) {
        std::cout << absl::StrCat("[", who, "] ", line, "\n") << std::flush;
      };
    }
    if (!o_.on_event) {
      o_.on_event = [](const std::string& message) { std::cerr << message + "\n"; };
    }
    if (o_.launcher.id.empty()) o_.launcher.id = o_.name;
    if (o_.registry_dir.empty()) {
      const char* dir = getenv("DEEPNEX_RUN_DIR");
      o_.registry_dir = dir != nullptr && *dir != '\0'
                            ? dir
                            : absl::StrCat("/tmp/deepnex-", getuid(), "/jobs");
    }
    job_dir_ = absl::StrCat(o_.registry_dir, "/", o_.name);
    if (o_.launcher.state_dir.empty()) o_.launcher.state_dir = job_dir_ + "/launch";
    return absl::OkStatus();
  }

  absl::Status Start() override {
    absl::Status s = StartAll();
    if (!s.ok()) Stop().IgnoreError();
    return s;
  }

  absl::StatusOr<JobResult> Wait(milliseconds timeout) override {
    // Clamped so that "forever" (milliseconds::max()) does not overflow.
    auto deadline = Clock::now() + std::min(timeout, milliseconds(int64_t{1} << 40));
    // As torchrun does: once a worker has failed for good (its restart
    // policy gave up), the others are stopped rather than left to hang in a
    // collective or a shrunken round.
    for (;;) {
      bool all_ended = true;
      bool failed = false;
      for (const auto& w : workers_) {
        launch::ContainerStatus st = w->Status();
        bool ended = st.state == launch::State::kExited || st.state == launch::State::kStopped;
        all_ended = all_ended && ended;
        failed = failed || (ended && st.last_exit.has_value() && !st.last_exit->ok());
      }
      if (all_ended || failed) break;
      if (Clock::now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("job ", o_.name, " is still running"));
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
    JobResult result;
    std::optional<launch::ExitStatus> first_failure;
    for (const auto& w : workers_) {
      launch::ContainerStatus st = w->Status();
      if (st.last_exit.has_value() && !st.last_exit->ok() && !first_failure.has_value() &&
          st.state == launch::State::kExited) {
        first_failure = st.last_exit;
      }
    }
    DEEPNEX_RETURN_IF_ERROR(Stop());
    for (const auto& w : workers_) {
      DEEPNEX_ASSIGN_OR_RETURN(launch::ExitStatus e, w->Wait(milliseconds(10000)));
      result.workers.push_back(e);
    }
    if (first_failure.has_value()) result.exit_code = ExitCodeOf(*first_failure);
    result.seconds = std::chrono::duration<double>(Clock::now() - started_).count();
    return result;
  }

  absl::Status Stop() override {
    std::lock_guard<std::mutex> lock(stop_mu_);
    absl::Status first;
    for (auto it = handles_.rbegin(); it != handles_.rend(); ++it) {
      absl::Status s = (*it)->Stop(milliseconds(2000));
      if (first.ok()) first = s;
    }
    for (auto& h : handles_) h->Wait(milliseconds(10000)).IgnoreError();
    for (auto& t : log_threads_) t.join();
    log_threads_.clear();
    if (allocations_ != nullptr) {
      for (const auto& a : grants_) {
        absl::Status s = allocations_->Release(a.id);
        if (first.ok()) first = s;
      }
    }
    grants_.clear();
    if (store_ != nullptr) store_->Stop();
    // Off `deepnex top`; the directory itself goes with the launcher, which
    // keeps its logs there until then.
    std::error_code ignored;
    std::filesystem::remove(job_dir_ + "/job.json", ignored);
    return first;
  }

  std::vector<std::shared_ptr<launch::Handle>> Containers() override { return handles_; }
  std::vector<gpu::Allocation> Allocations() override { return grants_; }

 private:
  absl::Status StartAll() {
    started_ = Clock::now();
    DEEPNEX_ASSIGN_OR_RETURN(allocations_, AllocationSource::Create(o_));
    gpu::Request request;
    request.user = o_.user;
    request.job = o_.name;
    request.gpus = o_.gpus_per_worker;
    request.mode = o_.gpu_mode;
    request.gpu_memory = o_.gpu_memory;
    // Every worker holds at least a core in the allocator's books, even
    // when its container is not limited (cpus 0), so that a machine is not
    // oversubscribed by jobs that did not say.
    request.cpus = std::max(1, static_cast<int>(std::ceil(o_.cpus)));
    request.memory = o_.memory;
    request.replicas = o_.workers;
    DEEPNEX_ASSIGN_OR_RETURN(grants_, allocations_->Gang(request));
    // The containers run for whom the allocations are (the token's user).
    if (o_.user.empty() && !grants_.empty()) o_.user = grants_[0].user;

    token_ = launch::RandomHex(16);
    collective::StoreServerOptions so;
    so.token = token_;
    DEEPNEX_ASSIGN_OR_RETURN(store_, collective::StoreServer::Create(so));
    DEEPNEX_ASSIGN_OR_RETURN(launcher_, launch::Launcher::Create(o_.launcher));

    std::vector<std::string> ps_addrs;
    std::vector<int> ps_ports;
    for (int i = 0; i < o_.ps; ++i) {
      DEEPNEX_ASSIGN_OR_RETURN(int port, ReservePort());
      ps_ports.push_back(port);
      ps_addrs.push_back(absl::StrCat("127.0.0.1:", port));
      DEEPNEX_RETURN_IF_ERROR(
          StartContainer(PsSpec(i, ps_addrs.back()), absl::StrCat("ps ", i)).status());
    }
    for (int port : ps_ports) DEEPNEX_RETURN_IF_ERROR(AwaitPort(port));

    DEEPNEX_ASSIGN_OR_RETURN(int master_port, ReservePort());
    std::map<std::string, std::string> base = InheritedEnv();
    for (const auto& [k, v] : o_.env) base[k] = v;
    for (int rank = 0; rank < o_.workers; ++rank) {
      // As torchrun: the rank and count of this worker among those on its
      // node.
      int local_rank = 0, local_world_size = 0;
      for (int other = 0; other < o_.workers; ++other) {
        if (grants_[other].node != grants_[rank].node) continue;
        if (other < rank) ++local_rank;
        ++local_world_size;
      }
      Context ctx;
      ctx.job_id = o_.name;
      ctx.role = Role::kWorker;
      ctx.rank = rank;
      ctx.world_size = o_.workers;
      ctx.local_rank = local_rank;
      ctx.ps_addrs = ps_addrs;
      ctx.store_addr = store_->address();
      ctx.token = token_;
      launch::ContainerSpec spec;
      spec.name = absl::StrCat(o_.name, "-worker", rank);
      spec.command = o_.command;
      spec.env = base;
      for (const auto& [k, v] : ctx.ToEnv()) spec.env[k] = v;
      spec.env["LOCAL_WORLD_SIZE"] = absl::StrCat(local_world_size);
      // torchrun's default keeps N workers from each starting a thread per
      // core of the machine; here a worker gets the cores it was granted.
      if (!base.count("OMP_NUM_THREADS")) {
        double cores = o_.cpus > 0 ? o_.cpus : grants_[rank].cpus;
        spec.env["OMP_NUM_THREADS"] = absl::StrCat(std::max(1, static_cast<int>(cores)));
      }
      // torchrun's rank 0 serves its own TCPStore on MASTER_PORT, so that
      // must be a free port, not the job's store.
      spec.env["MASTER_PORT"] = absl::StrCat(master_port);
      spec.working_dir = o_.working_dir.empty() ? CurrentDir() : o_.working_dir;
      spec.mounts = o_.mounts;
      spec.allocation = grants_[rank];
      spec.user = o_.user;
      spec.cpus = o_.cpus;
      spec.memory = o_.memory;
      spec.restart = o_.restart;
      spec.labels["deepnex.job"] = o_.name;
      spec.labels["deepnex.role"] = "worker";
      DEEPNEX_ASSIGN_OR_RETURN(auto h, StartContainer(spec, absl::StrCat("worker ", rank)));
      workers_.push_back(h);
    }
    WriteRecord();
    return absl::OkStatus();
  }

  // job.json for `deepnex top`; best effort (a full /tmp must not fail a
  // job that runs).
  void WriteRecord() {
    nlohmann::json allocations = nlohmann::json::array();
    for (const auto& a : grants_) {
      nlohmann::json gpus = nlohmann::json::array();
      for (const auto& g : a.gpus) gpus.push_back(g.index);
      allocations.push_back({{"id", a.id}, {"node", a.node}, {"gpus", gpus},
                             {"cpus", a.cpus}, {"memory", a.memory}});
    }
    nlohmann::json r = {
        {"name", o_.name},          {"pid", getpid()},
        {"mode", o_.mode},          {"workers", o_.workers},
        {"ps", o_.ps},              {"backend", o_.launcher.backend},
        {"user", o_.user},          {"state_dir", o_.launcher.state_dir},
        {"allocations", allocations},
        {"started_at", std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count()}};
    if (MakeDirectories(job_dir_).ok()) {
      WriteFileAtomically(job_dir_ + "/job.json", r.dump(1) + "\n").IgnoreError();
    }
  }

  launch::ContainerSpec PsSpec(int i, const std::string& addr) {
    launch::ContainerSpec spec;
    spec.name = absl::StrCat(o_.name, "-ps", i);
    // The server's own name (its checkpoint is <dir>/ps<i>.ckpt) stays the
    // same across jobs, so a new job can restore an old job's checkpoint.
    std::vector<std::string>& c = spec.command;
    c = {o_.ps_binary, "--listen", addr, "--mode", ps_mode_, "--workers",
         absl::StrCat(o_.workers), "--optimizer", o_.optimizer, "--lr", absl::StrCat(o_.lr),
         "--momentum", absl::StrCat(o_.momentum), "--job", o_.name,
         "--name", absl::StrCat("ps", i)};
    if (ps_mode_ == "ssp") {
      c.insert(c.end(), {"--staleness", absl::StrCat(staleness_)});
    }
    if (!o_.checkpoint_dir.empty()) {
      // Restored when a checkpoint is there: a server restarted by its
      // policy comes back with what it had.
      c.insert(c.end(), {"--checkpoint-dir", o_.checkpoint_dir, "--checkpoint-every", "1",
                         "--restore", o_.checkpoint_dir, "--restore-if-present"});
    }
    spec.env = InheritedEnv();
    // Not on the command line, which every user of the machine can read in
    // /proc; deepnex-ps reads $DEEPNEX_TOKEN.
    spec.env["DEEPNEX_TOKEN"] = token_;
    spec.working_dir = o_.working_dir.empty() ? CurrentDir() : o_.working_dir;
    spec.mounts = o_.mounts;
    spec.user = o_.user;
    spec.cpus = o_.cpus;
    spec.restart = o_.restart;
    spec.labels["deepnex.job"] = o_.name;
    spec.labels["deepnex.role"] = "ps";
    return spec;
  }

  // Starts `spec` as `who` ("worker 0"): its output and restarts are told
  // under that name.
  absl::StatusOr<std::shared_ptr<launch::Handle>> StartContainer(launch::ContainerSpec spec,
                                                                 const std::string& who) {
    // The job's store and parameter servers listen on this host's addresses.
    spec.host_network = true;
    spec.on_restart = [this, who](const launch::RestartEvent& e) {
      o_.on_event(absl::StrCat(who, " ", e.ToString()));
    };
    DEEPNEX_ASSIGN_OR_RETURN(std::shared_ptr<launch::Handle> h, launcher_->Start(spec));
    handles_.push_back(h);
    log_threads_.emplace_back([this, h, who] {
      std::string partial;
      h->FollowLogs([&](const std::string& chunk) {
         partial += chunk;
         size_t nl;
         while ((nl = partial.find('\n')) != std::string::npos) {
           o_.output(who, partial.substr(0, nl));
           partial.erase(0, nl + 1);
         }
         return true;
       }).IgnoreError();
      if (!partial.empty()) o_.output(who, partial);
    });
    return h;
  }

  absl::Status AwaitPort(int port) {
    auto deadline = Clock::now() + std::chrono::seconds(30);
    while (!Connects(port)) {
      for (const auto& h : handles_) {
        launch::ContainerStatus st = h->Status();
        if (st.state == launch::State::kExited) {
          return absl::UnavailableError(absl::StrCat(
              "parameter server ", st.name, " ended before serving: ",
              st.last_exit ? st.last_exit->ToString() : "no status"));
        }
      }
      if (Clock::now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("parameter server on 127.0.0.1:", port, " did not serve within 30 s"));
      }
      std::this_thread::sleep_for(milliseconds(20));
    }
    return absl::OkStatus();
  }

  static std::string CurrentDir() {
    char buf[4096];
    return getcwd(buf, sizeof(buf)) != nullptr ? buf : "/";
  }

  JobOptions o_;
  std::string ps_mode_;  // empty for allreduce
  int staleness_ = 0;
  std::string token_;
  std::string job_dir_;
  Clock::time_point started_;
  std::unique_ptr<AllocationSource> allocations_;
  std::vector<gpu::Allocation> grants_;
  std::unique_ptr<collective::StoreServer> store_;
  std::unique_ptr<launch::Launcher> launcher_;
  std::vector<std::shared_ptr<launch::Handle>> handles_;
  std::vector<std::shared_ptr<launch::Handle>> workers_;
  std::vector<std::thread> log_threads_;
  std::mutex stop_mu_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Job>> Job::Create(const JobOptions& options) {
  auto job = std::make_unique<JobImpl>(options);
  DEEPNEX_RETURN_IF_ERROR(job->Init());
  return job;
}

absl::StatusOr<JobResult> RunJob(const JobOptions& options) {
  DEEPNEX_ASSIGN_OR_RETURN(auto job, Job::Create(options));
  DEEPNEX_RETURN_IF_ERROR(job->Start());
  return job->Wait(milliseconds::max());
}

}  // namespace deepnex::job
