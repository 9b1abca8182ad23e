// The "process" backend: fork/exec on this host, in a session and process
// group of its own, with a cgroup of its own (CPU, memory and pids limits)
// where the cgroup tree is writable; stdout and stderr go to a file in the
// run's directory.
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/file_util.h"
#include "core/text.h"
#include "launch/backend.h"
#include "launch/cgroup.h"
#include "launch/spec.h"
#include "launch/procfs.h"
#include "launch/util.h"

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

namespace deepnex::launch {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kLogFile[] = "output.log";

// What the child reports through its close-on-exec pipe when it cannot get
// as far as exec.
struct ChildError {
  enum Stage : int { kChdir = 1, kExec = 2, kIdentity = 3, kCgroup = 4 } stage;
  int error;
};

// From the forked child (async-signal-safe): tells the parent why, and ends.
void ReportAndExit(int fd, ChildError::Stage stage) {
  ChildError e{stage, errno};
  (void)!write(fd, &e, sizeof(e));
  _exit(127);
}

// argv/envp for execve, built before fork so the child allocates nothing.
struct CStrings {
  explicit CStrings(std::vector<std::string> s) : strings(std::move(s)) {
    for (std::string& x : strings) pointers.push_back(x.data());
    pointers.push_back(nullptr);
  }
  std::vector<std::string> strings;
  std::vector<char*> pointers;
};

absl::Status ErrnoError(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", strerror(errno)));
}

class ProcessRun : public Run {
 public:
  ProcessRun(pid_t pid, Fd pidfd, std::unique_ptr<Cgroup> cgroup, std::string log_path)
      : pid_(pid), pidfd_(std::move(pidfd)), limited_(cgroup != nullptr),
        cgroup_(std::move(cgroup)), log_path_(std::move(log_path)) {}

  ~ProcessRun() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!exit_) {
      KillTreeLocked(SIGKILL);
      int status;
      waitpid(pid_, &status, 0);
    }
    if (cgroup_) cgroup_->Remove().IgnoreError();
  }

  std::string id() const override { return std::to_string(pid_); }

  // Also delivers the SIGKILL that Stop scheduled: the supervisor calls
  // Wait in short slices for as long as the run lives.
  absl::StatusOr<std::optional<ExitStatus>> Wait(std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    while (true) {
      auto slice = deadline;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (exit_) return exit_;
        if (ReapLocked()) return exit_;
        if (kill_at_) {
          if (Clock::now() >= *kill_at_) {
            KillTreeLocked(SIGKILL);
            kill_at_.reset();
          } else {
            slice = std::min(slice, *kill_at_);
          }
        }
      }
      const auto now = Clock::now();
      if (now >= deadline) return std::nullopt;
      int ms = static_cast<int>(
          std::chrono::duration_cast<std::chrono::milliseconds>(slice - now).count()) + 1;
      if (pidfd_.get() >= 0) {
        struct pollfd p = {pidfd_.get(), POLLIN, 0};
        poll(&p, 1, ms);
      } else {
        usleep(std::min(ms, 10) * 1000);
      }
    }
  }

  absl::Status Stop(std::chrono::milliseconds grace) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (exit_) return absl::OkStatus();
    const bool first = !stopped_;
    stopped_ = true;
    if (grace.count() <= 0) {
      KillTreeLocked(SIGKILL);
      return absl::OkStatus();
    }
    // The TERM goes once, as kubelet's does: a later Stop (an admin's after
    // the user's, central's reaper again) only brings the SIGKILL forward. A
    // second TERM would tell many programs to quit without cleaning up.
    if (first) KillTreeLocked(SIGTERM);
    auto at = Clock::now() + grace;
    if (!kill_at_ || at < *kill_at_) kill_at_ = at;
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Logs() override {
    return ReadWholeFile(log_path_, "log of process " + id());
  }

  absl::StatusOr<launch::Usage> Usage() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (cgroup_) return cgroup_->ReadUsage();
    if (!exit_) {
      launch::Usage now = ProcUsage(ProcessGroupMembers(pid_));
      now.memory_peak = std::max(now.memory_peak, last_usage_.memory_peak);
      now.cpu_seconds = std::max(now.cpu_seconds, last_usage_.cpu_seconds);
      last_usage_ = now;
    }
    return last_usage_;
  }

  // Runs `options.command` as the run's command runs: its environment,
  // identity and working directory, in its cgroup.
  absl::StatusOr<std::unique_ptr<ExecProcess>> Exec(const ExecOptions& options) override {
    if (options.command.empty()) return absl::InvalidArgumentError("command is empty");
    ExecPlan plan = exec_;
    if (options.tty && std::none_of(plan.env.begin(), plan.env.end(), [](const std::string& e) {
          return absl::StartsWith(e, "TERM=");
        })) {
      plan.env.push_back(kExecTtyTerm);
    }
    DEEPNEX_ASSIGN_OR_RETURN(std::string exe, FindOnPath(options.command[0], exec_path_));
    plan.argv = options.command;
    plan.argv[0] = exe;
    // A process beside a run that has ended would outlive it, and once its
    // cgroup is gone, every limit: a user's exec timed against her
    // container's end left processes running free after her grant went.
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (exit_ || ReapLocked()) return Ended();
      // v1: the child joins the cgroup itself (see Cgroup::SelfJoinFiles);
      // one removed meanwhile ends it (126), one it joins after the
      // cgroup's last kill is killed by Remove.
      if (cgroup_) plan.join_files = cgroup_->SelfJoinFiles();
    }
    if (plan.join_files.empty()) {
      plan.join = [this](pid_t pid) {
        std::lock_guard<std::mutex> lock(mu_);
        if (exit_ || (limited_ && !cgroup_)) return Ended();
        return cgroup_ ? cgroup_->AddProcess(pid) : absl::OkStatus();
      };
    }
    return SpawnExec(plan, options);
  }

  // What Exec runs with (set once, by Start).
  ExecPlan exec_;
  std::string exec_path_;  // PATH to look commands up on

  absl::Status Remove() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!exit_) {
      KillTreeLocked(SIGKILL);
      int status;
      if (waitpid(pid_, &status, 0) == pid_) exit_ = ExitStatusFromWait(status);
    }
    if (!cgroup_) return absl::OkStatus();
    last_usage_ = cgroup_->ReadUsage();
    absl::Status removed = cgroup_->Remove();
    cgroup_.reset();
    return removed;
  }

 private:
  static absl::Status Ended() { return absl::FailedPreconditionError("the container has ended"); }

  // Whether the process has ended; then exit_ is set and whatever it left
  // behind in its group or cgroup is killed, as a container's are when its
  // init ends.
  bool ReapLocked() {
    int status;
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == 0) return false;
    ExitStatus e;
    if (r == pid_) {
      e = ExitStatusFromWait(status);
    } else {
      e.reason = ExitReason::kLost;
    }
    // After a Stop the SIGKILL is most likely ours, whatever the cgroup saw.
    if (cgroup_ && !stopped_ && e.reason == ExitReason::kSignaled && e.signal == SIGKILL &&
        cgroup_->OomKilled()) {
      e.reason = ExitReason::kOomKilled;
    }
    exit_ = e;
    KillTreeLocked(SIGKILL);
    pidfd_.reset();
    return true;
  }

  // `signal` to the process group and, with a cgroup, to every process in it
  // (a child may have left the group with setsid).
  void KillTreeLocked(int signal) {
    // The group's id stays reserved while any member lives, so this cannot
    // hit a stranger even after the leader was reaped.
    kill(-pid_, signal);
    if (!cgroup_) return;
    if (signal == SIGKILL) {
      cgroup_->KillAll().IgnoreError();
    } else {
      // Those that left the group only: one signal each, as a second TERM
      // would tell many programs to quit without cleaning up.
      for (pid_t p : cgroup_->Processes()) {
        if (getpgid(p) != pid_) kill(p, signal);
      }
    }
  }

  const pid_t pid_;
  std::mutex mu_;
  Fd pidfd_;
  const bool limited_;  // started in a cgroup (cgroup_ is reset by Remove)
  std::unique_ptr<Cgroup> cgroup_;
  const std::string log_path_;
  std::optional<ExitStatus> exit_;
  std::optional<Clock::time_point> kill_at_;
  bool stopped_ = false;
  launch::Usage last_usage_;
};

class ProcessBackend : public Backend {
 public:
  explicit ProcessBackend(const LauncherOptions& options)
      : cgroup_parent_(CgroupParent(options)), cgroups_(Cgroup::Usable()) {}

  absl::Status Check(const ContainerSpec& spec) override {
    if (absl::StartsWith(spec.image, "/")) {
      struct stat st;
      if (stat(spec.image.c_str(), &st) != 0) {
        return absl::NotFoundError(
            absl::StrCat("spec.image: \"", spec.image, "\" does not exist"));
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.image: \"", spec.image,
          "\": the process backend runs on the host and cannot use an image's files "
          "(use image \"host\", or the oci backend)"));
    }
    // A process sees the host's files: a mount that would change nothing is
    // taken, any other refused rather than silently not made.
    for (size_t i = 0; i < spec.mounts.size(); ++i) {
      const Mount& m = spec.mounts[i];
      char target[PATH_MAX];
      if (m.read_only || realpath(m.target.c_str(), target) == nullptr || m.source != target) {
        return absl::InvalidArgumentError(absl::StrCat(
            "spec.mounts[", i, "]: the process backend runs on the host's files and cannot mount ",
            QuotedPath(m.source), " at ", QuotedPath(m.target), m.read_only ? " read-only" : "",
            "; it takes only a writable mount of a path onto itself, which changes nothing"));
      }
    }
    return CheckRunsOnHost(spec);
  }

  absl::StatusOr<std::unique_ptr<Run>> Start(const ContainerSpec& spec,
                                             const RunContext& context) override {
    DEEPNEX_ASSIGN_OR_RETURN(std::string exe, FindOnPath(spec.command[0], PathOf(spec.env)));
    std::map<std::string, std::string> env = HostEnv(spec);
    env[kLauncherIdEnv] = context.launcher_id;
    std::vector<std::string> env_strings;
    for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
    CStrings argv(spec.command), envp(std::move(env_strings));

    const std::string log_path = context.dir + "/" + kLogFile;
    Fd log(open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    if (log.get() < 0) return ErrnoError("cannot open " + log_path);
    Fd devnull(open("/dev/null", O_RDONLY | O_CLOEXEC));
    int go[2], err[2];
    if (pipe2(go, O_CLOEXEC) != 0) return ErrnoError("pipe2");
    Fd go_read(go[0]), go_write(go[1]);
    if (pipe2(err, O_CLOEXEC) != 0) return ErrnoError("pipe2");
    Fd err_read(err[0]), err_write(err[1]);
    struct rlimit core;
    getrlimit(RLIMIT_CORE, &core);
    core.rlim_cur = 0;  // no core files from containers filling the disk
    const std::string dir = HostWorkingDir(spec);
    const char* workdir = dir.empty() ? nullptr : dir.c_str();
    sigset_t no_signals;
    sigemptyset(&no_signals);
    // The identity to take in the child: only root may drop its
    // supplementary groups; anyone may "become" their own uid and gid.
    const bool become = spec.run_as.has_value();
    const uid_t uid = become ? spec.run_as->uid : 0;
    const gid_t gid = become ? spec.run_as->gid : 0;
    const bool set_groups = become && geteuid() == 0;

    // Last before fork, so that no error above leaves a cgroup behind.
    std::unique_ptr<Cgroup> cgroup;
    if (cgroups_.ok()) {
      CgroupLimits limits;
      limits.cpus = spec.cpus;
      limits.memory = spec.memory;
      limits.pids = PidsLimitOf(spec);
      // The grant's GPUs only (index = the device node's minor, as
      // nvidia-smi numbers them); without an allocation GPUs are not managed.
      if (spec.allocation) {
        limits.gpu_minors.emplace();
        for (const gpu::GrantedGpu& g : spec.allocation->gpus) limits.gpu_minors->push_back(g.index);
      }
      DEEPNEX_ASSIGN_OR_RETURN(
          cgroup, Cgroup::Create(cgroup_parent_ + "/" + context.run_name, limits));
    }
    // v1: the child joins the cgroup itself (see Cgroup::SelfJoinFiles).
    const std::vector<std::string> join_files =
        cgroup ? cgroup->SelfJoinFiles() : std::vector<std::string>();
    std::vector<const char*> join_paths;
    for (const std::string& f : join_files) join_paths.push_back(f.c_str());

    pid_t pid = fork();
    if (pid < 0) {
      absl::Status failed = ErrnoError("fork");
      if (cgroup) cgroup->Remove().IgnoreError();
      return failed;
    }
    if (pid == 0) {
      // Only async-signal-safe calls from here: other threads may have held
      // locks at fork.
      sigprocmask(SIG_SETMASK, &no_signals, nullptr);
      for (int s = 1; s < NSIG; ++s) signal(s, SIG_DFL);
      setsid();
      char c;
      // The parent puts us into the cgroup before we run anything.
      if (read(go_read.get(), &c, 1) != 1) _exit(127);
      if (!JoinCgroupSelf(join_paths)) ReportAndExit(err_write.get(), ChildError::kCgroup);
      dup2(devnull.get(), 0);
      dup2(log.get(), 1);
      dup2(log.get(), 2);
      // Before the chdir, so that the directory is entered as the user. A
      // root that setuid()s to another uid loses every capability;
      // no-new-privileges keeps setuid binaries from giving them back.
      if (become) {
        if ((set_groups && setgroups(1, &gid) != 0) || setgid(gid) != 0 || setuid(uid) != 0 ||
            prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 ||
            prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
          ReportAndExit(err_write.get(), ChildError::kIdentity);
        }
      }
      // A home that cannot be entered leaves "/", as login(1) does; a
      // working_dir the spec named is an error.
      if (workdir != nullptr && chdir(workdir) != 0 &&
          (!spec.working_dir.empty() || chdir("/") != 0)) {
        ReportAndExit(err_write.get(), ChildError::kChdir);
      }
      setrlimit(RLIMIT_CORE, &core);
      syscall(SYS_close_range, 3, ~0U, CLOSE_RANGE_CLOEXEC);
      execve(exe.c_str(), argv.pointers.data(), envp.pointers.data());
      ReportAndExit(err_write.get(), ChildError::kExec);
    }
    go_read.reset();
    err_write.reset();
    Fd pidfd(static_cast<int>(syscall(SYS_pidfd_open, pid, 0)));
    absl::Status joined =
        cgroup && join_paths.empty() ? cgroup->AddProcess(pid) : absl::OkStatus();
    if (!joined.ok()) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      cgroup->Remove().IgnoreError();
      return joined;
    }
    (void)!write(go_write.get(), "g", 1);
    go_write.reset();
    ChildError child;
    ssize_t n;
    do {
      n = read(err_read.get(), &child, sizeof(child));
    } while (n < 0 && errno == EINTR);
    if (n == static_cast<ssize_t>(sizeof(child))) {
      waitpid(pid, nullptr, 0);
      if (cgroup) cgroup->Remove().IgnoreError();
      if (child.stage == ChildError::kIdentity) {
        return absl::FailedPreconditionError(
            absl::StrCat("spec.run_as: cannot run as uid ", uid, " gid ", gid, ": ",
                         strerror(child.error)));
      }
      if (child.stage == ChildError::kCgroup) {
        return absl::FailedPreconditionError(
            absl::StrCat("cannot join the container's cgroup: ", strerror(child.error)));
      }
      if (child.stage == ChildError::kChdir) {
        return absl::NotFoundError(absl::StrCat("spec.working_dir: cannot enter ",
                                                QuotedPath(spec.working_dir), ": ",
                                                strerror(child.error)));
      }
      std::string msg = absl::StrCat("command \"", spec.command[0], "\": exec ", exe,
                                     " failed: ", strerror(child.error));
      if (child.error == ENOENT) return absl::NotFoundError(msg);
      if (child.error == EACCES) return absl::PermissionDeniedError(msg);
      return absl::FailedPreconditionError(msg);
    }
    auto run = std::make_unique<ProcessRun>(pid, std::move(pidfd), std::move(cgroup), log_path);
    run->exec_.env = envp.strings;
    // Where the process started (not the launcher's own directory, which a
    // spec naming none left an exec in; probe).
    run->exec_.working_dir = dir;
    run->exec_.or_root = spec.working_dir.empty();
    run->exec_.run_as = spec.run_as;
    run->exec_path_ = PathOf(spec.env);
    return std::unique_ptr<Run>(std::move(run));
  }

  absl::StatusOr<int> Cleanup(const std::string& launcher_id) override {
    int swept = 0;
    absl::Status first;
    const std::string prefix = launcher_id + "-";
    for (const std::string& child : Cgroup::Children(cgroup_parent_)) {
      if (!absl::StartsWith(child, prefix)) continue;
      auto cg = Cgroup::Open(cgroup_parent_ + "/" + child);
      // Gone since it was listed: an ended run's own removal, which goes on
      // after its Wait was answered (README's example stopped a container
      // and cleaned up at once, and failed on that NotFound in CI once).
      if (absl::IsNotFound(cg.status())) continue;
      // "<id>-" also begins the runs of a launcher whose id extends this one's, as
      // job names do ("a" and "a-b"): a cgroup with a process labelled by another
      // launcher is that one's (probe: cleanup("amb") killed job amb-x's worker).
      if (cg.ok() && RunsOfAnother(**cg, launcher_id)) continue;
      absl::Status removed = cg.ok() ? (*cg)->Remove() : cg.status();
      if (removed.ok()) ++swept;
      first.Update(removed);
    }
    // Without cgroups (or for a process that left its cgroup) the label in
    // the environment is what finds them.
    for (pid_t pid : ProcessesWithEnv(kLauncherIdEnv, launcher_id)) {
      if (pid == getpid() || !ProcessAlive(pid)) continue;
      if (kill(pid, SIGKILL) == 0) ++swept;
    }
    if (!first.ok()) return first;
    return swept;
  }

 private:
  static bool RunsOfAnother(Cgroup& cgroup, const std::string& launcher_id) {
    for (pid_t pid : cgroup.Processes()) {
      std::optional<std::string> label = EnvOf(pid, kLauncherIdEnv);
      if (label && *label != launcher_id) return true;
    }
    return false;
  }

  const std::string cgroup_parent_;
  const absl::Status cgroups_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeProcessBackend(const LauncherOptions& options) {
  if (options.require_cgroups) {
    absl::Status cgroups = Cgroup::Usable();
    if (!cgroups.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the process backend cannot make cgroups here, so containers would run without their "
          "limits and GPU device rules: ",
          cgroups.message()));
    }
  }
  return std::unique_ptr<Backend>(new ProcessBackend(options));
}

}  // namespace deepnex::launch
