// The slurm backend: each run is one batch job. sbatch submits a script that
// execs the command with the spec's environment; squeue and scontrol watch
// it; scancel stops it. Measured on Slurm 22.05 (tests/launch/slurm.sh
// starts the cluster the tests use):
//
// - GPUs: the job asks for --gres=gpu:N, N the allocation's GPU count, and
//   Slurm picks which GPUs: inside the job Slurm's CUDA_VISIBLE_DEVICES wins
//   over the allocation's indices (and the allocation's NVIDIA_VISIBLE_DEVICES
//   UUIDs, which may name other GPUs, are dropped). Shared GPUs are asked for
//   whole; DEEPNEX_GPU_MEMORY_LIMIT still tells the job its share.
// - Environment: exactly the spec's (plus PATH and DEEPNEX_LAUNCHER_ID as the
//   process backend adds them) and what Slurm itself sets (SLURM_*,
//   CUDA_VISIBLE_DEVICES, HOSTNAME, TMPDIR ...). sbatch copies its own
//   environment into the job, so it runs with nothing but the Slurm options'
//   env; --export=NONE would instead make Slurm load the user's login
//   environment, which added about 4 s to every start.
// - Stop: Slurm treats any signal to a batch job from scancel as a cancel:
//   SIGTERM to every process of the job, SIGKILL after the cluster's
//   KillWait, and further signals are ignored meanwhile. So `grace` cannot
//   shorten or lengthen that; the process tree goes within KillWait plus a
//   few seconds (about 5 s with KillWait=2).
// - Usage: the cluster may have no accounting (sacct fails, sstat prints
//   garbage with jobacct_gather/none), so usage comes from `scontrol
//   listpids` and /proc where the job runs on this host, and is 0 elsewhere.
// - Memory and CPUs are requested (--mem, --cpus-per-task); whether they are
//   enforced is the cluster's TaskPlugin's business, so there is no OOM
//   kill without a memory cgroup: a job Slurm reports OUT_OF_MEMORY ends as
//   oom_killed.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/file_util.h"
#include "core/text.h"
#include "launch/backend.h"
#include "launch/command.h"
#include "launch/spec.h"
#include "launch/procfs.h"
#include "launch/util.h"

extern char** environ;

namespace deepnex::launch {
namespace {

constexpr auto kCommandTimeout = std::chrono::seconds(30);
constexpr char kLogFile[] = "output.log";
// The longest --comment Slurm (22.05) takes: 1100 bytes failed with
// "Pathname of a file, directory or other parameter too long".
constexpr size_t kMaxComment = 1000;
constexpr char kScriptFile[] = "job.sh";
const char* const kTools[] = {"sbatch", "squeue", "scontrol", "scancel", "sinfo"};

// Creates (empty) or keeps file `path`, owned by `who` and only theirs.
absl::Status CreateOwnedBy(const std::string& path, const RunAs& who) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0 || ::fchown(fd, who.uid, who.gid) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    return absl::InternalError(absl::StrCat("slurm: making ", path, " the file of uid ", who.uid,
                                            " gid ", who.gid, ": ", std::strerror(err)));
  }
  ::close(fd);
  return absl::OkStatus();
}

// Job states after which nothing of the job runs any more.
bool IsFinal(absl::string_view state) {
  static const char* const kFinal[] = {
      "COMPLETED", "FAILED",    "CANCELLED", "OUT_OF_MEMORY", "TIMEOUT", "NODE_FAIL",
      "BOOT_FAIL", "DEADLINE",  "PREEMPTED", "REVOKED",       "SPECIAL_EXIT"};
  for (const char* f : kFinal) {
    if (state == f) return true;
  }
  return false;
}

// Whether a squeue/scontrol/scancel error says the controller no longer
// knows the job.
bool UnknownJob(const CommandResult& r) {
  return absl::StrContains(r.err, "Invalid job id");
}

// `s` as one word of a POSIX shell command line.
std::string ShellQuote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') {
      q += "'\\''";
    } else {
      q += c;
    }
  }
  return q + "'";
}

// The value of `key` in one line of `scontrol show job -o`: space-separated
// key=value pairs. The fields read here come before the free-form ones
// (Comment, Command) that may hold spaces.
std::string RecordField(const std::string& record, const std::string& key) {
  for (absl::string_view field : absl::StrSplit(record, ' ', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&field, key + "=")) return std::string(field);
  }
  return "";
}

// How a job that ended ended, from its scontrol record.
absl::StatusOr<ExitStatus> ExitFromRecord(const std::string& record) {
  const std::string state = RecordField(record, "JobState");
  const std::string code = RecordField(record, "ExitCode");
  std::pair<std::string, std::string> parts = absl::StrSplit(code, ':');
  int exit_code = 0, signal = 0;
  if (!absl::SimpleAtoi(parts.first, &exit_code) || !absl::SimpleAtoi(parts.second, &signal)) {
    return absl::InternalError(
        absl::StrCat("slurm: no ExitCode=code:signal in the job record: ", record));
  }
  ExitStatus e;
  if (state == "OUT_OF_MEMORY") {
    e.reason = ExitReason::kOomKilled;
    e.signal = signal != 0 ? signal : SIGKILL;
  } else if (state == "NODE_FAIL" || state == "BOOT_FAIL") {
    e.reason = ExitReason::kLost;
  } else if (signal != 0 || state == "CANCELLED") {
    // A job cancelled before it ran carries no signal.
    e.reason = ExitReason::kSignaled;
    e.signal = signal != 0 ? signal : SIGTERM;
  } else {
    e.code = exit_code;
  }
  return e;
}

// The Slurm commands with their environment. Shared by the backend and its
// runs (a run may outlive the backend); immutable, so thread-safe.
class SlurmClient {
 public:
  static absl::StatusOr<std::shared_ptr<const SlurmClient>> Create(const SlurmOptions& options) {
    auto client = std::shared_ptr<SlurmClient>(new SlurmClient);
    const std::string path = PathOf({});
    for (const char* tool : kTools) {
      std::string where = options.bin_dir.empty() ? "PATH=" + path : "bin_dir " + options.bin_dir;
      absl::StatusOr<std::string> exe =
          options.bin_dir.empty() ? FindOnPath(tool, path)
                                  : FindOnPath(options.bin_dir + "/" + tool, "");
      if (!exe.ok()) {
        return absl::FailedPreconditionError(
            absl::StrCat("slurm: ", tool, " not found in ", where));
      }
      client->tools_[tool] = *exe;
    }
    std::map<std::string, std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      std::pair<std::string, std::string> kv = absl::StrSplit(*e, absl::MaxSplits('=', 1));
      env.insert(kv);
    }
    for (const auto& [k, v] : options.env) env[k] = v;
    std::map<std::string, std::string> submit_env = options.env;
    if (auto conf = env.find("SLURM_CONF"); conf != env.end()) {
      // Slurm's commands take about a minute to give up on a config file
      // that is not there.
      struct stat st;
      if (stat(conf->second.c_str(), &st) != 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("slurm: SLURM_CONF=", conf->second, " does not exist"));
      }
      submit_env.insert(*conf);
    }
    for (const auto& [k, v] : env) client->env_.push_back(k + "=" + v);
    for (const auto& [k, v] : submit_env) client->submit_env_.push_back(k + "=" + v);
    return client;
  }

  std::vector<std::string> Argv(const std::string& tool,
                                const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {tools_.at(tool)};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  }

  // Runs `tool args...` with the launcher's environment plus the options'.
  absl::StatusOr<CommandResult> Run(const std::string& tool,
                                    const std::vector<std::string>& args) const {
    return RunCommand(Argv(tool, args), env_, kCommandTimeout);
  }

  // Its stdout, or FailedPrecondition naming the command line and its stderr.
  absl::StatusOr<std::string> Call(const std::string& tool,
                                   const std::vector<std::string>& args) const {
    return Output(Argv(tool, args), env_);
  }

  // sbatch, whose environment becomes the job's: only the options' env
  // (and SLURM_CONF) goes in.
  absl::StatusOr<std::string> Submit(const std::vector<std::string>& args) const {
    return Output(Argv("sbatch", args), submit_env_);
  }

 private:
  SlurmClient() = default;

  static absl::StatusOr<std::string> Output(const std::vector<std::string>& argv,
                                            const std::vector<std::string>& env) {
    DEEPNEX_ASSIGN_OR_RETURN(CommandResult r, RunCommand(argv, env, kCommandTimeout));
    if (!r.ok()) return absl::FailedPreconditionError(DescribeFailure(argv, r));
    return r.out;
  }

  std::map<std::string, std::string> tools_;
  std::vector<std::string> env_;
  std::vector<std::string> submit_env_;
};

// One batch job. Thread-safe.
class SlurmRun : public Run {
 public:
  SlurmRun(std::shared_ptr<const SlurmClient> client, std::string job_id, std::string log_path,
           std::chrono::milliseconds poll)
      : client_(std::move(client)),
        job_id_(std::move(job_id)),
        log_path_(std::move(log_path)),
        poll_(poll) {}

  std::string id() const override { return job_id_; }

  absl::StatusOr<std::optional<ExitStatus>> Wait(std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (exit_.has_value()) return exit_;
      }
      absl::StatusOr<std::optional<ExitStatus>> e = Poll();
      const auto now = std::chrono::steady_clock::now();
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!e.ok()) {
          if (!silence_.Tolerates(now)) return e.status();
        } else {
          silence_.Answered();
          if (e->has_value()) {
            exit_ = *e;
            return exit_;
          }
        }
      }
      auto left = deadline - now;
      if (left <= std::chrono::milliseconds(0)) return std::nullopt;
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(left, poll_));
    }
  }

  // `grace` is the cluster's KillWait (see the top of this file). scancel
  // of a job that has ended succeeds too.
  absl::Status Stop(std::chrono::milliseconds) override {
    if (Ended()) return absl::OkStatus();
    return client_->Call("scancel", {job_id_}).status();
  }

  absl::StatusOr<std::string> Logs() override {
    struct stat st;
    // Nothing is written before the job starts.
    if (stat(log_path_.c_str(), &st) != 0) return std::string();
    return ReadWholeFile(log_path_, "the job's output");
  }

  absl::StatusOr<launch::Usage> Usage() override {
    launch::Usage u;
    if (!Ended()) {
      // Answers only on the node that runs the job: elsewhere usage stays 0.
      absl::StatusOr<CommandResult> r = client_->Run("scontrol", {"listpids", job_id_});
      if (r.ok() && r->ok()) u = ProcUsage(ParsePids(r->out));
    }
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = std::max({peak_, u.memory_peak, u.memory});
    u.memory_peak = peak_;
    return u;
  }

  absl::Status Remove() override { return Stop(std::chrono::milliseconds(0)); }

  std::string Queued() override {
    std::lock_guard<std::mutex> lock(mu_);
    return queued_;
  }

 private:
  bool Ended() {
    std::lock_guard<std::mutex> lock(mu_);
    return exit_.has_value();
  }

  // The job's exit status once it has ended; nullopt while it has not.
  absl::StatusOr<std::optional<ExitStatus>> Poll() {
    // The state, and why: Slurm's reason, a word ("Resources", "Priority",
    // "QOSMaxGRESPerUser"), or "None".
    const std::vector<std::string> args = {"-h", "-t", "all", "-j", job_id_, "-o", "%T %r"};
    DEEPNEX_ASSIGN_OR_RETURN(CommandResult q, client_->Run("squeue", args));
    if (!q.ok() && !UnknownJob(q)) {
      return absl::FailedPreconditionError(DescribeFailure(client_->Argv("squeue", args), q));
    }
    const std::pair<std::string, std::string> said =
        absl::StrSplit(absl::StripAsciiWhitespace(q.out), absl::MaxSplits(' ', 1));
    const std::string& state = said.first;
    if (q.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      // CONFIGURING: its nodes are booting.
      queued_ = state != "PENDING" && state != "CONFIGURING"
                    ? ""
                    : absl::StrCat(state, " in Slurm's queue",
                                   said.second.empty() || said.second == "None"
                                       ? ""
                                       : absl::StrCat(" (", said.second, ")"));
    }
    if (q.ok() && !state.empty() && !IsFinal(state)) return std::nullopt;
    DEEPNEX_ASSIGN_OR_RETURN(CommandResult record,
                             client_->Run("scontrol", {"show", "job", "-o", job_id_}));
    if (!record.ok()) {
      if (!UnknownJob(record)) {
        return absl::FailedPreconditionError(
            DescribeFailure(client_->Argv("scontrol", {"show", "job", "-o", job_id_}), record));
      }
      // Gone without a record (purged, or the controller lost its state).
      ExitStatus lost;
      lost.reason = ExitReason::kLost;
      return lost;
    }
    if (!IsFinal(RecordField(record.out, "JobState"))) return std::nullopt;
    return ExitFromRecord(record.out);
  }

  // The PID column of `scontrol listpids`.
  static std::vector<pid_t> ParsePids(const std::string& out) {
    std::vector<pid_t> pids;
    for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
      std::vector<absl::string_view> cols = absl::StrSplit(line, ' ', absl::SkipEmpty());
      int pid;
      if (!cols.empty() && absl::SimpleAtoi(cols[0], &pid)) pids.push_back(pid);
    }
    return pids;
  }

  const std::shared_ptr<const SlurmClient> client_;
  const std::string job_id_;
  const std::string log_path_;
  const std::chrono::milliseconds poll_;
  std::mutex mu_;
  std::optional<ExitStatus> exit_;
  // When Slurm's commands began to fail, while they do.
  EngineSilence silence_;  // guarded by mu_
  uint64_t peak_ = 0;
  // Run::Queued as squeue last said; sbatch queues it (guarded by mu_).
  std::string queued_ = "PENDING in Slurm's queue";
};

class SlurmBackend : public Backend {
 public:
  SlurmBackend(std::shared_ptr<const SlurmClient> client, const SlurmOptions& options)
      : client_(std::move(client)), options_(options) {}

  absl::Status Check(const ContainerSpec& spec) override {
    if (spec.image != "host") {
      struct stat st;
      if (absl::StartsWith(spec.image, "/") && stat(spec.image.c_str(), &st) != 0) {
        return absl::NotFoundError(
            absl::StrCat("spec.image: \"", spec.image, "\" does not exist"));
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.image: \"", spec.image,
          "\": the slurm backend runs the command on the nodes' own system; use image \"host\""));
    }
    if (!spec.mounts.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.mounts: ", spec.mounts.size(),
          " mounts: the slurm backend runs on the nodes' own filesystem and mounts nothing"));
    }
    if (spec.network_none) {
      return absl::InvalidArgumentError(
          "spec.network_none: true: a Slurm job cannot be cut off the network");
    }
    if (spec.pids_limit > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.pids_limit: ", spec.pids_limit, ": Slurm cannot limit a job's processes"));
    }
    return CheckRunsOnHost(spec);
  }

  absl::StatusOr<std::unique_ptr<Run>> Start(const ContainerSpec& spec,
                                             const RunContext& context) override {
    DEEPNEX_ASSIGN_OR_RETURN(std::string exe, FindOnPath(spec.command[0], PathOf(spec.env)));
    // sbatch drops a backslash from --output and then expands no '%' (22.05): a
    // probe's job in such a directory ended by signal 53 with no output.
    if (context.dir.find('\\') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "slurm: the run directory ", Quoted(context.dir),
          " holds a '\\', which Slurm drops from a job's output path; choose a state "
          "directory without one"));
    }
    const size_t gpus = spec.allocation.has_value() ? spec.allocation->gpus.size() : 0;
    std::map<std::string, std::string> env = HostEnv(spec);
    env[kLauncherIdEnv] = context.launcher_id;
    if (gpus > 0) {
      env.erase("CUDA_VISIBLE_DEVICES");
      env.erase("NVIDIA_VISIBLE_DEVICES");
    }
    std::string workdir = HostWorkingDir(spec);
    // env(1) rather than the shell's export takes any variable name, and its
    // --chdir fails the job where slurmstepd, unable to enter the working
    // directory as the user, would run it in /tmp.
    std::string script = absl::StrCat("#!/bin/sh\n# deepnex run ", context.run_name,
                                      "\nexec /usr/bin/env");
    if (!workdir.empty()) absl::StrAppend(&script, " --chdir=", ShellQuote(workdir));
    absl::StrAppend(&script, " --");
    if (workdir.empty()) {
      char cwd[4096];
      if (getcwd(cwd, sizeof cwd) == nullptr) return absl::InternalError("getcwd failed");
      workdir = cwd;
    }
    for (const auto& [k, v] : env) absl::StrAppend(&script, " ", ShellQuote(k + "=" + v));
    // env(1) takes an operand with '=' for one more variable, and would run
    // the next word: a program "/opt/d=1/prog" is handed to sh to run.
    if (exe.find('=') != std::string::npos) absl::StrAppend(&script, " /bin/sh -c 'exec \"$0\" \"$@\"'");
    absl::StrAppend(&script, " ", ShellQuote(exe));
    for (size_t i = 1; i < spec.command.size(); ++i) {
      absl::StrAppend(&script, " ", ShellQuote(spec.command[i]));
    }
    script += "\n";
    const std::string script_path = context.dir + "/" + kScriptFile;
    // It holds the job's environment: root's alone (sbatch reads it as root).
    DEEPNEX_RETURN_IF_ERROR(WriteFileAtomically(script_path, script, 0600));

    // deepnex.launcher first, so that Cleanup can match the comment's head.
    std::string comment = absl::StrCat(kLauncherLabel, "=", context.launcher_id);
    for (const auto& [k, v] : context.labels) {
      if (k != kLauncherLabel) absl::StrAppend(&comment, ",", k, "=", v);
    }
    if (comment.size() > kMaxComment) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.labels: the Slurm job's comment (the labels, with deepnex.launcher and "
          "deepnex.name) would be ", comment.size(), " bytes; Slurm takes at most ", kMaxComment));
    }
    const std::string log_path = context.dir + "/" + kLogFile;
    // Another user's job: slurmstepd opens the output as that user, so the
    // file is made theirs here (the run directory must be searchable).
    const bool become = spec.run_as && (spec.run_as->uid != geteuid() ||
                                        spec.run_as->gid != getegid());
    if (become) DEEPNEX_RETURN_IF_ERROR(CreateOwnedBy(log_path, *spec.run_as));
    // Slurm expands %u, %j and the like in these paths; %% is a '%'.
    const std::string output = absl::StrReplaceAll(log_path, {{"%", "%%"}});
    std::vector<std::string> args = {
        "--parsable", "--job-name=" + context.run_name, "--comment=" + comment,
        "--nodes=1", "--ntasks=1", "--no-requeue",
        "--output=" + output, "--error=" + output, "--open-mode=append",
        "--chdir=" + workdir,
        absl::StrCat("--cpus-per-task=", std::max(1, static_cast<int>(std::ceil(spec.cpus))))};
    if (spec.memory > 0) {
      args.push_back(absl::StrCat("--mem=", (spec.memory + (1 << 20) - 1) >> 20, "M"));
    }
    if (gpus > 0) args.push_back(absl::StrCat("--gres=gpu:", gpus));
    // The allocation chose the node (see Nodes); Slurm refuses a node it
    // does not know ("Invalid node name specified").
    if (spec.allocation.has_value() && !spec.allocation->node.empty()) {
      args.push_back("--nodelist=" + spec.allocation->node);
    }
    if (!options_.partition.empty()) args.push_back("--partition=" + options_.partition);
    // Only root may submit as another user (the launcher checked that).
    if (become) {
      args.push_back(absl::StrCat("--uid=", spec.run_as->uid));
      args.push_back(absl::StrCat("--gid=", spec.run_as->gid));
    }
    args.push_back(script_path);
    DEEPNEX_ASSIGN_OR_RETURN(std::string out, client_->Submit(args));
    // --parsable prints "<id>" or "<id>;<cluster>".
    std::string job_id(absl::StripAsciiWhitespace(out.substr(0, out.find(';'))));
    int64_t number;
    if (!absl::SimpleAtoi(job_id, &number)) {
      return absl::InternalError(absl::StrCat("slurm: sbatch printed no job id: ", out));
    }
    return std::make_unique<SlurmRun>(client_, job_id, log_path, options_.poll);
  }

  absl::StatusOr<int> Cleanup(const std::string& launcher_id) override {
    // squeue lists the jobs that have not ended, every user's. A comment is
    // its user's text, newlines included: a probe's job commented
    // $'x\n<id> RUNNING deepnex.launcher=<ours>' forged a line, and root's
    // sweep cancelled another user's job <id>. So a job a line names is asked
    // for again alone, and is this launcher's only if that answer is one
    // line whose comment is the label's.
    DEEPNEX_ASSIGN_OR_RETURN(std::string out, client_->Call("squeue", {"-h", "-o", "%i %k"}));
    const std::string label = absl::StrCat(kLauncherLabel, "=", launcher_id);
    auto labelled = [&](absl::string_view comment) {
      return comment == label || absl::StartsWith(comment, label + ",");
    };
    std::set<std::string> named;
    for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
      std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(' ', 1));
      int64_t number;
      if (f.size() == 2 && absl::SimpleAtoi(f[0], &number) && labelled(f[1])) {
        named.emplace(f[0]);
      }
    }
    std::vector<std::string> ids;
    for (const std::string& id : named) {
      // Gone since (squeue refuses an id it no longer knows): nothing to do.
      absl::StatusOr<std::string> alone = client_->Call("squeue", {"-h", "-j", id, "-o", "%T %k"});
      if (!alone.ok()) continue;
      absl::string_view record = *alone;
      absl::ConsumeSuffix(&record, "\n");
      std::vector<absl::string_view> f = absl::StrSplit(record, absl::MaxSplits(' ', 1));
      // A job already completing is on its way out.
      if (f.size() == 2 && record.find('\n') == absl::string_view::npos &&
          f[0] != "COMPLETING" && labelled(f[1])) {
        ids.push_back(id);
      }
    }
    if (ids.empty()) return 0;
    DEEPNEX_RETURN_IF_ERROR(client_->Call("scancel", ids).status());
    return static_cast<int>(ids.size());
  }

  // The partition's nodes that take jobs, from `sinfo -N`: one line per
  // node and partition, "NAME CPUS MEMORY_MB GRES STATE", GRES as
  // "gpu:2", "gpu:a100:2(S:0-1)" or "(null)".
  absl::StatusOr<std::vector<gpu::Node>> Nodes() override {
    std::vector<std::string> args = {"-h", "-N", "-o", "%N %c %m %G %t"};
    if (!options_.partition.empty()) args.push_back("--partition=" + options_.partition);
    DEEPNEX_ASSIGN_OR_RETURN(std::string out, client_->Call("sinfo", args));
    std::vector<gpu::Node> nodes;
    for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() != 5) {
        return absl::InternalError(absl::StrCat("slurm: sinfo printed \"", line,
                                                "\", not NAME CPUS MEMORY GRES STATE"));
      }
      // down, drained, failing or not responding (a trailing '*').
      const std::string& state = f[4];
      if (absl::StartsWith(state, "down") || absl::StartsWith(state, "drain") ||
          absl::StartsWith(state, "fail") || absl::EndsWith(state, "*")) {
        continue;
      }
      if (std::any_of(nodes.begin(), nodes.end(),
                      [&](const gpu::Node& n) { return n.name == f[0]; })) {
        continue;
      }
      gpu::Node node;
      node.name = f[0];
      int64_t memory_mb = 0;
      if (!absl::SimpleAtoi(f[1], &node.cpus) || !absl::SimpleAtoi(f[2], &memory_mb)) {
        return absl::InternalError(absl::StrCat("slurm: sinfo printed \"", line,
                                                "\": CPUS and MEMORY are not numbers"));
      }
      node.memory = static_cast<uint64_t>(memory_mb) << 20;
      for (absl::string_view gres : absl::StrSplit(f[3], ',')) {
        if (!absl::ConsumePrefix(&gres, "gpu:")) continue;
        gres = gres.substr(0, gres.find('('));
        int count = 0;
        if (absl::SimpleAtoi(gres.substr(gres.rfind(':') + 1), &count)) {
          for (int i = 0; i < count; ++i) {
            gpu::Gpu g;
            g.index = i;
            node.gpus.push_back(g);
          }
        }
      }
      nodes.push_back(std::move(node));
    }
    if (nodes.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "slurm: no node takes jobs", options_.partition.empty() ? "" : " in partition ",
          options_.partition, " (sinfo -N lists none up)"));
    }
    return nodes;
  }

 private:
  const std::shared_ptr<const SlurmClient> client_;
  const SlurmOptions options_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeSlurmBackend(const LauncherOptions& options) {
  DEEPNEX_ASSIGN_OR_RETURN(std::shared_ptr<const SlurmClient> client,
                           SlurmClient::Create(options.slurm));
  absl::StatusOr<std::string> listed = client->Call("sinfo", {"-h", "-o", "%R"});
  if (!listed.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("slurm: the controller does not answer: ", listed.status().message()));
  }
  if (!options.slurm.partition.empty()) {
    std::vector<std::string> partitions =
        absl::StrSplit(absl::StripAsciiWhitespace(*listed), '\n', absl::SkipEmpty());
    if (std::find(partitions.begin(), partitions.end(), options.slurm.partition) ==
        partitions.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("slurm: partition \"", options.slurm.partition,
                       "\" does not exist (partitions: ", absl::StrJoin(partitions, ", "), ")"));
    }
  }
  return std::make_unique<SlurmBackend>(std::move(client), options.slurm);
}

}  // namespace deepnex::launch
