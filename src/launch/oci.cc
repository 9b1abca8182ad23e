// The oci backend: every run is a real runc container whose bundle (the
// config.json of the OCI runtime spec) is written from the ContainerSpec.
//
// A run is `runc run --keep` in the foreground, a child of this process:
// runc's exit status is the container's (128+n when a signal killed it), and
// --keep leaves the stopped container and its cgroup in place, so that the
// OOM-kill counter, which the kernel keeps in the victim's own cgroup, can
// be read after the end; Remove then runs `runc delete`. `--pid-file` marks
// the moment the command runs: Start returns then.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <algorithm>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/file_util.h"
#include "launch/backend.h"
#include "launch/cgroup.h"
#include "launch/command.h"
#include "launch/oci_config.h"
#include "launch/oci_image.h"
#include "launch/procfs.h"
#include "launch/spec.h"
#include "launch/util.h"

extern char** environ;

namespace deepnex::launch {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// How long runc may take to get the command running.
constexpr auto kStartTimeout = std::chrono::seconds(30);
// How long one runc call other than `run` may take.
constexpr auto kCommandTimeout = std::chrono::seconds(30);

std::string Errno(int err) { return strerror(err); }

// Waits for child `pid` to end; its wait status.
int Reap(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

// runc with a fixed state root. Copyable; every call is independent.
class Runc {
 public:
  Runc(std::string binary, std::string root)
      : binary_(std::move(binary)), root_(std::move(root)) {}

  // {runc, --root, <root>, args...}.
  std::vector<std::string> Argv(const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {binary_, "--root", root_};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  }
  // stdout, or an error carrying runc's stderr.
  absl::StatusOr<std::string> Call(const std::vector<std::string>& args) const {
    std::vector<std::string> argv = Argv(args);
    DEEPNEX_ASSIGN_OR_RETURN(CommandResult r, RunCommand(argv, OwnEnv(), kCommandTimeout));
    if (!r.ok()) return absl::InternalError(DescribeFailure(argv, r));
    return r.out;
  }
  const std::string& root() const { return root_; }

 private:
  std::string binary_;
  std::string root_;
};

// SIGKILL to every process of container `id` (through its cgroup when runc
// cannot, e.g. its state is gone).
void KillContainer(const Runc& runc, const std::string& id, const std::string& cgroup_path) {
  if (!runc.Call({"kill", "--all", id, "KILL"}).ok()) {
    absl::StatusOr<std::unique_ptr<Cgroup>> cg = Cgroup::Open(cgroup_path);
    if (cg.ok()) (*cg)->KillAll().IgnoreError();
  }
}

// A run's overlay (see Bundle::root) lies in its bundle directory `dir`:
// the container's writes go to upper/, their view is rootfs/.
std::string OverlayRoot(const std::string& dir) { return dir + "/rootfs"; }
std::string OverlayUpper(const std::string& dir) { return dir + "/upper"; }

absl::Status MountOverlay(const std::string& lower, const std::string& dir) {
  const std::string work = dir + "/work";
  for (const std::string& d : {OverlayUpper(dir), work, OverlayRoot(dir)}) {
    DEEPNEX_RETURN_IF_ERROR(MakeDirectories(d));
  }
  const std::string data =
      absl::StrCat("lowerdir=", lower, ",upperdir=", OverlayUpper(dir), ",workdir=", work);
  if (mount("overlay", OverlayRoot(dir).c_str(), "overlay", 0, data.c_str()) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot mount the writable layer of the container (overlayfs ", data, " on ",
        OverlayRoot(dir), "): ", Errno(errno), "; the oci backend needs overlayfs"));
  }
  return absl::OkStatus();
}

// Detached: a process still in it (being killed) does not keep it busy.
void UnmountOverlay(const std::string& dir) { umount2(OverlayRoot(dir).c_str(), MNT_DETACH); }

// ---------------------------------------------------------------------------
// A run.

class OciRun : public Run {
 public:
  // `init`: the container's PID 1 is the init, with the command under it.
  // `image`: what it runs; `overlay`: on a writable layer (MountOverlay in
  // `dir`), which the run unmounts when removed. `term`: its environment
  // names a TERM.
  OciRun(Runc runc, std::string id, std::string dir, std::string cgroup_path, bool init,
         Image image, bool overlay, bool term, pid_t pid, Fd pidfd)
      : runc_(std::move(runc)),
        id_(std::move(id)),
        dir_(std::move(dir)),
        cgroup_path_(std::move(cgroup_path)),
        init_(init),
        image_(std::move(image)),
        overlay_(overlay),
        term_(term),
        pid_(pid),
        pidfd_(std::move(pidfd)) {}

  ~OciRun() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!ended_) {
      lock.unlock();
      KillContainer(runc_, id_, cgroup_path_);
      lock.lock();
      if (!ended_) Finish();
    }
    lock.unlock();
    Remove().IgnoreError();
  }

  std::string id() const override { return id_; }
  // Readable once `runc run` has exited.
  int pidfd() const { return pidfd_.get(); }

  absl::StatusOr<std::optional<ExitStatus>> Wait(std::chrono::milliseconds timeout) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ended_) return Result();
    }
    struct pollfd p = {pidfd_.get(), POLLIN, 0};
    int n = poll(&p, 1, static_cast<int>(std::clamp<int64_t>(timeout.count(), 0, INT32_MAX)));
    if (n < 0 && errno != EINTR) return absl::InternalError("poll: " + Errno(errno));
    if (n <= 0) return std::optional<ExitStatus>();
    std::lock_guard<std::mutex> lock(mu_);
    if (!ended_) Finish();
    return Result();
  }

  absl::Status Stop(std::chrono::milliseconds grace) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_) return absl::OkStatus();
    const auto kill_at = std::chrono::steady_clock::now() + grace;
    if (killer_.joinable()) {
      // Stopping already: the TERM went once (as kubelet's does); a later
      // Stop only brings the SIGKILL forward.
      kill_at_ = std::min(kill_at_, kill_at);
      return absl::OkStatus();
    }
    kill_at_ = kill_at;
    // The init passes the TERM on to the command; when that ends, the
    // kernel kills what is left in the container's PID namespace. Without
    // an init, --all: the command is PID 1 and ignores a TERM it has no
    // handler for; its children do not.
    std::vector<std::string> kill = {"kill", id_, "TERM"};
    if (!init_) kill.insert(kill.begin() + 1, "--all");
    runc_.Call(kill).IgnoreError();
    // Wakes at least every 100 ms for a later Stop's earlier deadline.
    killer_ = std::thread([this] {
      for (;;) {
        std::chrono::steady_clock::time_point at;
        {
          std::lock_guard<std::mutex> lock(mu_);
          at = kill_at_;
        }
        const int64_t left = std::chrono::ceil<std::chrono::milliseconds>(
                                 at - std::chrono::steady_clock::now()).count();
        if (left <= 0) {
          KillContainer(runc_, id_, cgroup_path_);
          return;
        }
        struct pollfd p = {pidfd_.get(), POLLIN, 0};
        if (poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 100))) > 0) return;
      }
    });
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Logs() override {
    return ReadWholeFile(dir_ + "/output.log", "log of " + id_);
  }

  absl::StatusOr<launch::Usage> Usage() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ended_) return final_usage_;
    }
    absl::StatusOr<std::unique_ptr<Cgroup>> cg = Cgroup::Open(cgroup_path_);
    if (!cg.ok()) return launch::Usage();  // runc has not made it yet
    return (*cg)->ReadUsage();
  }

  // `runc exec` takes the container's process (user, env, cwd) for the
  // command's; with a tty it makes the container's pty and copies between it
  // and ours, resizing it on our SIGWINCH.
  absl::StatusOr<std::unique_ptr<ExecProcess>> Exec(const ExecOptions& options) override {
    if (options.command.empty()) return absl::InvalidArgumentError("command is empty");
    std::vector<std::string> args = {"exec"};
    if (options.tty) args.push_back("--tty");
    if (options.tty && !term_) args.insert(args.end(), {"--env", kExecTtyTerm});
    args.push_back(id_);
    args.insert(args.end(), options.command.begin(), options.command.end());
    ExecPlan plan;
    plan.argv = runc_.Argv(args);
    DEEPNEX_ASSIGN_OR_RETURN(plan.argv[0], FindOnPath(plan.argv[0], PathOf({})));
    plan.env = OwnEnv();
    return SpawnExec(plan, options);
  }

  absl::StatusOr<uint64_t> Commit(const std::string& image) override {
    if (!overlay_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "container ", id_, " runs the host image, whose files are the host's: nothing to "
          "commit"));
    }
    return CommitChanges(image_, OverlayUpper(dir_), dir_, image);
  }

  // Its init's: runc's pid file holds its pid on this host.
  absl::StatusOr<std::string> NetworkNamespace() override {
    DEEPNEX_ASSIGN_OR_RETURN(std::string pid, ReadWholeFile(dir_ + "/pid", "pid of " + id_));
    return absl::StrCat("/proc/", absl::StripAsciiWhitespace(pid), "/ns/net");
  }

  absl::Status Remove() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!ended_) {
      return absl::FailedPreconditionError(
          absl::StrCat("container ", id_, " is still running"));
    }
    if (removed_) return absl::OkStatus();
    removed_ = true;
    std::thread killer = std::move(killer_);
    lock.unlock();
    if (killer.joinable()) killer.join();
    pidfd_.reset();
    absl::StatusOr<std::string> deleted = runc_.Call({"delete", "--force", id_});
    // runc delete can leave the cgroup of a stopped container in hierarchies
    // it did not create it in; whatever is left goes here. The rest goes
    // even when runc's delete failed: this is the only Remove, and a
    // mounted writable layer would outlive the bundle directory.
    if (absl::StatusOr<std::unique_ptr<Cgroup>> cg = Cgroup::Open(cgroup_path_); cg.ok()) {
      (*cg)->Remove().IgnoreError();
    }
    for (const char* file : {"/config.json", "/pid"}) unlink((dir_ + file).c_str());
    if (overlay_) UnmountOverlay(dir_);
    if (!deleted.ok() && !absl::StrContains(deleted.status().message(), "does not exist")) {
      return deleted.status();
    }
    return absl::OkStatus();
  }

 private:
  // REQUIRES: mu_ held, runc has exited (or been killed). Reaps it and reads
  // the verdict from the container's cgroup, which --keep left in place.
  void Finish() {
    const int status = Reap(pid_);
    ended_ = true;
    if (WIFSIGNALED(status)) {
      // runc itself died: what became of the container is unknown.
      lost_ = absl::StrCat("runc run of ", id_, " was killed by ",
                           SignalName(WTERMSIG(status)));
      KillContainer(runc_, id_, cgroup_path_);
      return;
    }
    const int code = WEXITSTATUS(status);
    // runc reports a container killed by signal n as exit 128+n.
    if (code > 128 && code < 128 + NSIG) {
      exit_ = ExitStatus{ExitReason::kSignaled, 0, code - 128};
    } else {
      exit_ = ExitStatus{ExitReason::kExited, code, 0};
    }
    absl::StatusOr<std::unique_ptr<Cgroup>> cg = Cgroup::Open(cgroup_path_);
    if (!cg.ok()) return;
    final_usage_ = (*cg)->ReadUsage();
    final_usage_.memory = 0;
    final_usage_.pids = 0;
    if (!exit_.ok() && (*cg)->OomKilled()) {
      exit_ = ExitStatus{ExitReason::kOomKilled, 0, exit_.signal ? exit_.signal : SIGKILL};
    }
  }

  absl::StatusOr<std::optional<ExitStatus>> Result() const {
    if (!lost_.empty()) return absl::UnavailableError(lost_);
    return std::optional<ExitStatus>(exit_);
  }

  const Runc runc_;
  const std::string id_;
  const std::string dir_;
  const std::string cgroup_path_;
  const bool init_;
  const Image image_;
  const bool overlay_;
  const bool term_;
  const pid_t pid_;  // of `runc run`
  Fd pidfd_;

  std::mutex mu_;
  bool ended_ = false;
  bool removed_ = false;
  ExitStatus exit_;
  std::string lost_;
  launch::Usage final_usage_;
  std::chrono::steady_clock::time_point kill_at_;  // of the SIGKILL, once stopping
  std::thread killer_;  // Stop's SIGKILL at kill_at_
};

// The launcher whose container runs in `cgroup`, by the annotation in the
// bundle that its `runc run` names: the parent of its init, the one process
// there whose parent is outside it (a process inside could take any
// arguments). "" when that runc or the bundle is gone.
std::string LauncherOfRunning(Cgroup& cgroup) {
  const std::vector<pid_t> pids = cgroup.Processes();
  for (pid_t pid : pids) {
    std::optional<pid_t> parent = ParentOf(pid);
    if (!parent || std::find(pids.begin(), pids.end(), *parent) != pids.end()) continue;
    const std::vector<std::string> args = ArgumentsOf(*parent);
    auto bundle = std::find(args.begin(), args.end(), "--bundle");
    if (bundle == args.end() || ++bundle == args.end()) continue;
    absl::StatusOr<std::string> text = ReadWholeFile(*bundle + "/config.json", "bundle config");
    const json config = text.ok() ? json::parse(*text, nullptr, false) : json();
    if (config.is_object() && config.contains("annotations") &&
        config["annotations"].is_object()) {
      return config["annotations"].value(kLauncherLabel, "");
    }
  }
  return "";
}

// ---------------------------------------------------------------------------
// The backend.

class OciBackend : public Backend {
 public:
  // `init`: the init's host path, "" for none.
  OciBackend(const LauncherOptions& options, std::string runc_binary, std::string init)
      : runc_(std::move(runc_binary),
              options.oci.root.empty() ? options.state_dir + "/runc" : options.oci.root),
        cgroup_parent_(CgroupParent(options)),
        init_(std::move(init)),
        images_(options.state_dir) {}

  absl::Status Check(const ContainerSpec& spec) override {
    // The init (tini) forks the command: with one process allowed, the
    // container started and died at once with tini's "fork failed" (probe).
    if (spec.pids_limit == 1) {
      return absl::InvalidArgumentError(
          "spec.pids_limit: 1: the oci backend's init and the command need at least 2");
    }
    DEEPNEX_ASSIGN_OR_RETURN(Image image, images_.Resolve(spec.image));
    return CheckInImage(image, Mounts(image, spec, MakeBundle(spec, nullptr)), spec);
  }

  absl::StatusOr<std::unique_ptr<Run>> Start(const ContainerSpec& spec,
                                             const RunContext& context) override {
    DEEPNEX_ASSIGN_OR_RETURN(Image image, images_.Resolve(spec.image));
    Bundle bundle = MakeBundle(spec, &context);
    // The host image's files are the host's, bound in read-only: nothing to
    // write over.
    if (!image.host) bundle.root = OverlayRoot(context.dir);
    const std::string pid_file = context.dir + "/pid";
    unlink(pid_file.c_str());
    std::string resolv_conf;
    if (spec.host_network) {
      resolv_conf = ReadWholeFile("/etc/resolv.conf", "resolv.conf").value_or("");
    }
    DEEPNEX_RETURN_IF_ERROR(WriteEtc(bundle.etc_dir, EtcFiles(spec, bundle, resolv_conf)));
    StagedMounts staged;  // until runc has made its own mounts (the pid file)
    DEEPNEX_ASSIGN_OR_RETURN(ContainerSpec pinned, PinMountSources(spec, context.dir, &staged));
    DEEPNEX_RETURN_IF_ERROR(WriteFileAtomically(
        context.dir + "/config.json", MakeConfig(image, pinned, context, bundle).dump(1)));

    // runc writes the pid file (to a temporary name, then renamed) once the
    // command runs: watch for it rather than poll.
    Fd inotify(inotify_init1(IN_CLOEXEC | IN_NONBLOCK));
    if (inotify.get() < 0 ||
        inotify_add_watch(inotify.get(), context.dir.c_str(), IN_MOVED_TO | IN_CREATE) < 0) {
      return absl::InternalError(absl::StrCat("inotify on ", context.dir, ": ", Errno(errno)));
    }
    const std::string log = context.dir + "/output.log";
    Fd log_fd(open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    if (log_fd.get() < 0) {
      return absl::InternalError(absl::StrCat("cannot open ", log, ": ", Errno(errno)));
    }
    const std::vector<std::string> argv = runc_.Argv(
        {"run", "--keep", "--bundle", context.dir, "--pid-file", pid_file, context.run_name});
    const bool overlay = !bundle.root.empty();
    if (overlay) DEEPNEX_RETURN_IF_ERROR(MountOverlay(image.rootfs, context.dir));
    absl::StatusOr<pid_t> pid = Spawn(argv, environ, log_fd.get(), log_fd.get());
    Fd pidfd(pid.ok() ? static_cast<int>(syscall(SYS_pidfd_open, *pid, 0)) : -1);
    if (pidfd.get() < 0) {
      const int err = errno;
      if (pid.ok()) {
        kill(*pid, SIGKILL);
        Reap(*pid);
      }
      if (overlay) UnmountOverlay(context.dir);
      return pid.ok() ? absl::InternalError("pidfd_open: " + Errno(err)) : pid.status();
    }
    auto run = std::make_unique<OciRun>(runc_, context.run_name, context.dir, bundle.cgroup_path,
                                        !init_.empty(), image, overlay, spec.env.count("TERM") > 0,
                                        *pid, std::move(pidfd));

    const auto deadline = std::chrono::steady_clock::now() + kStartTimeout;
    while (access(pid_file.c_str(), F_OK) != 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        return absl::DeadlineExceededError(absl::StrCat(
            "container ", context.run_name, " did not start within ",
            std::chrono::duration_cast<std::chrono::seconds>(kStartTimeout).count(), " s"));
      }
      DEEPNEX_ASSIGN_OR_RETURN(std::optional<ExitStatus> ended, run->Wait(std::chrono::milliseconds(0)));
      if (ended) {
        if (access(pid_file.c_str(), F_OK) == 0) break;  // ran, and already ended
        absl::StatusOr<std::string> output = run->Logs();
        return absl::FailedPreconditionError(absl::StrCat(
            "runc could not start container ", context.run_name, ": ",
            absl::StripAsciiWhitespace(output.ok() ? *output : output.status().message())));
      }
      struct pollfd p[2] = {{inotify.get(), POLLIN, 0}, {run->pidfd(), POLLIN, 0}};
      poll(p, 2, static_cast<int>(left.count()));
      char events[4096];
      while (read(inotify.get(), events, sizeof events) > 0) {
      }
    }
    return run;
  }

  absl::StatusOr<int> Cleanup(const std::string& launcher_id) override {
    int swept = 0;
    DEEPNEX_ASSIGN_OR_RETURN(std::string listed, runc_.Call({"list", "--format", "json"}));
    json containers = json::parse(listed, nullptr, false);
    std::set<std::string> ids;  // every container runc has here, whoever's
    if (containers.is_array()) {
      for (const json& c : containers) {
        const std::string id = c.value("id", "");
        ids.insert(id);
        const json& labels = c.contains("annotations") ? c["annotations"] : json::object();
        if (!labels.is_object() || labels.value(kLauncherLabel, "") != launcher_id) continue;
        KillContainer(runc_, id, absl::StrCat(cgroup_parent_, "/", id));
        runc_.Call({"delete", "--force", id}).IgnoreError();
        std::error_code ec;
        const std::string bundle = c.value("bundle", "");
        if (!bundle.empty()) {
          UnmountOverlay(bundle);
          fs::remove_all(bundle, ec);
        }
        ++swept;
      }
    }
    // Cgroups of containers whose runc state is gone (another --root, a
    // state dir removed): found by the run name's launcher-id prefix. But
    // "<id>-" also begins the run names of a launcher whose id extends this
    // one's ("a" and "a-b"): a container that runc has here, or whose bundle
    // names another launcher, is not one of these (probe: Cleanup("a")
    // killed launcher a-b's running container).
    for (const std::string& child : Cgroup::Children(cgroup_parent_)) {
      if (!absl::StartsWith(child, launcher_id + "-") || ids.count(child)) continue;
      absl::StatusOr<std::unique_ptr<Cgroup>> cg =
          Cgroup::Open(absl::StrCat(cgroup_parent_, "/", child));
      if (!cg.ok()) continue;
      const std::string owner = LauncherOfRunning(**cg);
      if (!owner.empty() && owner != launcher_id) continue;
      if ((*cg)->Remove().ok()) ++swept;
    }
    return swept;
  }

 private:
  // The bundle of a run of `spec`; without `context` (a spec being
  // checked), no cgroup and no generated /etc.
  Bundle MakeBundle(const ContainerSpec& spec, const RunContext* context) const {
    Bundle b;
    if (context != nullptr) {
      b.cgroup_path = absl::StrCat(cgroup_parent_, "/", context->run_name);
      b.etc_dir = context->dir + "/etc";
    }
    b.init = init_;
    const RunAs identity = ContainerRunAs(spec);
    b.uid = identity.uid;
    b.gid = identity.gid;
    return b;
  }

  const Runc runc_;
  const std::string cgroup_parent_;
  const std::string init_;
  ImageStore images_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeOciBackend(const LauncherOptions& options) {
  if (geteuid() != 0) {
    return absl::FailedPreconditionError(
        "the oci backend needs root: rootless runc is not supported");
  }
  absl::StatusOr<std::string> runc = FindOnPath(options.oci.runc, PathOf({}));
  if (!runc.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("runc is not usable: ", runc.status().message()));
  }
  absl::StatusOr<CommandResult> version = RunCommand({*runc, "--version"}, OwnEnv(), kCommandTimeout);
  if (!version.ok() || !version->ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "runc is not usable: ",
        version.ok() ? DescribeFailure({*runc, "--version"}, *version) : version.status().message()));
  }
  absl::Status cgroups = Cgroup::Usable();
  if (!cgroups.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the oci backend needs writable cgroups: ", cgroups.message()));
  }
  if (options.state_dir.empty()) {
    return absl::InvalidArgumentError("the oci backend needs options.state_dir");
  }
  std::string init;
  if (options.oci.init != "none") {
    absl::StatusOr<std::string> found = FindOnPath(options.oci.init, PathOf({}));
    if (!found.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "oci.init: \"", options.oci.init, "\" is not usable (", found.status().message(),
          "); install tini (Debian: apt-get install tini) or set it to \"none\""));
    }
    init = fs::absolute(*found).string();  // a bind's source
  }
  return std::make_unique<OciBackend>(options, *runc, init);
}

}  // namespace deepnex::launch
