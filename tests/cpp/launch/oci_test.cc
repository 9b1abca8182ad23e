// The oci backend against real runc containers: the bundle it writes, and
// what a process inside sees and suffers (env, devices, read-only root, no
// new privileges, OOM kill, Stop of a whole process tree, Cleanup), plus
// images from a rootfs directory and from an OCI image layout.
#include <limits.h>
#include <signal.h>
#include <stdlib.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/random.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "launch/backend.h"
#include "launch/cgroup.h"
#include "launch/oci_config.h"
#include "launch/util.h"
#include "deepnex/launch/launcher.h"
#include "test_matchers.h"
#include "test_util.h"

namespace deepnex::launch {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::deepnex::test::WaitFor;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using json = nlohmann::json;
namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs a bash script; its exit status.
int Bash(const std::string& script) {
  return system(("bash -euc '" + script + "' >/dev/null 2>&1").c_str());
}

// The ids of the containers in runc root `root`.
std::vector<std::string> RuncIds(const std::string& root) {
  std::string ids;
  FILE* p = popen(("runc --root " + root + " list -q 2>/dev/null").c_str(), "r");
  char buf[256];
  while (p != nullptr && fgets(buf, sizeof buf, p) != nullptr) ids += buf;
  if (p != nullptr) pclose(p);
  return absl::StrSplit(ids, '\n', absl::SkipEmpty());
}

class OciTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/deepnex-oci-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    options_.backend = "oci";
    options_.state_dir = dir_ + "/state";
    options_.id = "ocitest" + RandomHex(4);
    // Each test's own: one test's removal of a parent shared with the test
    // running beside it (ctest -j2) raced that test's runc creating a
    // cgroup under it ("unable to apply cgroup configuration: mkdir", CI).
    options_.cgroup_parent = "deepnex-oci-test-" + options_.id;
    fs::create_directories(options_.state_dir);
    absl::StatusOr<std::unique_ptr<Backend>> backend = MakeOciBackend(options_);
    if (absl::IsFailedPrecondition(backend.status())) {
      GTEST_SKIP() << "oci backend not usable here: " << backend.status().message();
    }
    ASSERT_THAT(backend, IsOk());
    backend_ = std::move(*backend);
  }

  void TearDown() override {
    runs_.clear();  // kills what still runs, deletes the containers
    if (backend_ != nullptr) {
      EXPECT_THAT(backend_->Cleanup(options_.id), IsOk());
      EXPECT_THAT(RuncIds(options_.state_dir + "/runc"), ElementsAre());
      EXPECT_THAT(OurCgroups(), ElementsAre());
      absl::StatusOr<std::unique_ptr<Cgroup>> parent = Cgroup::Open(options_.cgroup_parent);
      if (parent.ok()) EXPECT_THAT((*parent)->Remove(), IsOk());
    }
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::vector<std::string> OurCgroups() {
    std::vector<std::string> ours;
    for (const std::string& c : Cgroup::Children(options_.cgroup_parent)) {
      if (absl::StartsWith(c, options_.id + "-")) ours.push_back(c);
    }
    return ours;
  }

  ContainerSpec Spec(const std::string& name, std::vector<std::string> command) {
    ContainerSpec spec;
    spec.name = name;
    spec.command = std::move(command);
    return spec;
  }

  RunContext Context(const ContainerSpec& spec) {
    RunContext c;
    c.launcher_id = options_.id;
    c.run_name = RunName(options_.id, spec.name, 0);
    c.dir = absl::StrCat(options_.state_dir, "/runs/", c.run_name);
    fs::create_directories(c.dir);
    c.labels = spec.labels;
    c.labels["deepnex.launcher"] = options_.id;
    c.labels["deepnex.name"] = spec.name;
    return c;
  }

  // Checks and starts `spec`; the run stays owned by the fixture.
  absl::StatusOr<launch::Run*> Start(const ContainerSpec& spec) {
    DEEPNEX_RETURN_IF_ERROR(backend_->Check(spec));
    RunContext context = Context(spec);
    DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<launch::Run> run, backend_->Start(spec, context));
    runs_.push_back(std::move(run));
    return runs_.back().get();
  }

  // Starts `spec`, waits for its end; its exit status and output.
  std::pair<ExitStatus, std::string> RunToEnd(const ContainerSpec& spec) {
    absl::StatusOr<launch::Run*> run = Start(spec);
    EXPECT_THAT(run, IsOk());
    if (!run.ok()) return {};
    absl::StatusOr<std::optional<ExitStatus>> end = (*run)->Wait(seconds(30));
    EXPECT_THAT(end, IsOk());
    EXPECT_TRUE(end.ok() && end->has_value()) << spec.name << " still runs after 30 s";
    absl::StatusOr<std::string> logs = (*run)->Logs();
    EXPECT_THAT(logs, IsOk());
    return {end.ok() && end->has_value() ? **end : ExitStatus{ExitReason::kLost},
            logs.ok() ? *logs : ""};
  }

  // The output of `spec` run as `run_as`, which must succeed.
  std::string OutputAs(ContainerSpec spec, const RunAs& run_as) {
    spec.run_as = run_as;
    auto [exit, logs] = RunToEnd(spec);
    EXPECT_TRUE(exit.ok()) << exit.ToString() << " " << logs;
    return logs;
  }

  json Config(const ContainerSpec& spec) {
    return json::parse(ReadFile(Context(spec).dir + "/config.json"));
  }

  std::string dir_;
  LauncherOptions options_;
  std::unique_ptr<Backend> backend_;
  std::vector<std::unique_ptr<launch::Run>> runs_;
};

TEST_F(OciTest, EnvHostnameAndExitCode) {
  ContainerSpec spec = Spec("w0", {"sh", "-c", "echo \"X=$X\"; hostname; exit 3"});
  spec.env["X"] = "hello world";
  auto [exit, logs] = RunToEnd(spec);
  EXPECT_EQ(exit.ToString(), "exited(3)");
  EXPECT_EQ(logs, "X=hello world\nw0\n");
}

TEST_F(OciTest, ReadOnlyRootWritableTmpNoNewPrivilegesFewCapabilities) {
  auto [exit, logs] = RunToEnd(Spec(
      "ro", {"sh", "-c",
             "touch /x 2>/dev/null && echo root-writable; touch /tmp/y && echo tmp-ok; "
             "echo hi >/dev/null && echo devnull-ok; grep -E '^(NoNewPrivs|CapEff)' "
             "/proc/self/status; test -e /sys/fs/cgroup/memory || echo no-cgroupfs"}));
  EXPECT_TRUE(exit.ok()) << exit.ToString();
  // CapEff 0x20000420: CAP_AUDIT_WRITE, CAP_KILL, CAP_NET_BIND_SERVICE only.
  EXPECT_EQ(logs,
            "tmp-ok\ndevnull-ok\nCapEff:\t0000000020000420\nNoNewPrivs:\t1\nno-cgroupfs\n");
}

TEST_F(OciTest, NoGpuDevicesWithoutAGrant) {
  auto [exit, logs] = RunToEnd(Spec("nogpu", {"sh", "-c", "ls /dev | grep -c nvidia"}));
  EXPECT_EQ(logs, "0\n");
}

TEST_F(OciTest, OnlyTheGrantedGpusDeviceNodes) {
  ContainerSpec spec = Spec("gpu", {"sh", "-c", "ls /dev | grep nvidia; stat -c %t:%T /dev/nvidia3"});
  gpu::Allocation a;
  a.user = "alice";
  a.gpus = {{1, "GPU-a", 1 << 30, true}, {3, "GPU-b", 1 << 30, true}};
  spec.allocation = a;
  auto [exit, logs] = RunToEnd(spec);
  EXPECT_TRUE(exit.ok()) << exit.ToString() << " " << logs;
  // The nodes runc made from the config; major 195 is c3 in hex.
  std::string expected = "nvidia1\nnvidia3\n";
  const bool ctl = access("/dev/nvidiactl", F_OK) == 0, uvm = access("/dev/nvidia-uvm", F_OK) == 0;
  if (uvm) expected += "nvidia-uvm\n";
  if (ctl) expected += "nvidiactl\n";
  EXPECT_EQ(logs, expected + "c3:3\n");

  json config = Config(spec);
  std::vector<std::string> paths;
  for (const json& d : config["linux"]["devices"]) {
    paths.push_back(d["path"]);
    if (d["path"] == "/dev/nvidia1" || d["path"] == "/dev/nvidia3") {
      EXPECT_EQ(d["type"], "c");
      EXPECT_EQ(d["major"], 195);
      EXPECT_EQ(d["minor"], d["path"] == "/dev/nvidia1" ? 1 : 3);
    }
  }
  std::vector<std::string> want = {"/dev/nvidia1", "/dev/nvidia3"};
  if (ctl) want.push_back("/dev/nvidiactl");
  if (uvm) want.push_back("/dev/nvidia-uvm");
  EXPECT_EQ(paths, want);
  // Deny everything first, then allow the default char devices and exactly
  // the granted GPUs among major 195.
  const json& rules = config["linux"]["resources"]["devices"];
  ASSERT_GE(rules.size(), 3u);
  EXPECT_EQ(rules[0], json({{"allow", false}, {"access", "rwm"}}));
  std::vector<int> gpu_minors;
  for (const json& r : rules) {
    if (r.value("major", -1) == 195) {
      EXPECT_TRUE(r["allow"].get<bool>());
      gpu_minors.push_back(r["minor"]);
    }
  }
  std::vector<int> want_minors = {1, 3};
  if (ctl) want_minors.push_back(255);
  EXPECT_EQ(gpu_minors, want_minors);
  EXPECT_THAT(rules.dump(), HasSubstr(R"({"access":"rwm","allow":true,"major":1,"minor":3,"type":"c"})"));
}

TEST_F(OciTest, BundleCarriesLimitsNamespacesAndLabels) {
  ContainerSpec spec = Spec("cfg", {"true"});
  spec.memory = 64 << 20;
  spec.cpus = 0.5;
  spec.pids_limit = 50;
  spec.labels["team"] = "vision";
  spec.mounts = {{dir_, "/data", true}};
  ASSERT_THAT(Start(spec), IsOk());
  json config = Config(spec);
  const json& lx = config["linux"];
  EXPECT_EQ(lx["resources"]["memory"], json({{"limit", 64 << 20}, {"swap", 64 << 20}}));
  EXPECT_EQ(lx["resources"]["cpu"], json({{"period", 100000}, {"quota", 50000}}));
  EXPECT_EQ(lx["resources"]["pids"], json({{"limit", 50}}));
  EXPECT_EQ(lx["cgroupsPath"], options_.cgroup_parent + "/" + Context(spec).run_name);
  EXPECT_EQ(lx["namespaces"].dump(),
            R"([{"type":"pid"},{"type":"mount"},{"type":"uts"},{"type":"ipc"},{"type":"network"}])");
  EXPECT_THAT(lx["maskedPaths"].dump(), HasSubstr("/proc/kcore"));
  EXPECT_THAT(lx["readonlyPaths"].dump(), HasSubstr("/proc/sys"));
  EXPECT_EQ(config["annotations"],
            json({{"deepnex.launcher", options_.id}, {"deepnex.name", "cfg"}, {"team", "vision"}}));
  EXPECT_TRUE(config["root"]["readonly"].get<bool>());
  EXPECT_TRUE(config["process"]["noNewPrivileges"].get<bool>());
  EXPECT_EQ(config["process"]["args"], json({"/dev/init", "--", "true"}));
  struct rlimit nofile;
  getrlimit(RLIMIT_NOFILE, &nofile);
  for (const json& r : config["process"]["rlimits"]) {
    EXPECT_LE(r["hard"].get<uint64_t>(), nofile.rlim_max) << r.dump();
  }
  std::vector<std::string> targets;
  for (const json& m : config["mounts"]) {
    targets.push_back(m["destination"]);
    if (m["destination"] == "/dev/init") {
      EXPECT_EQ(m, json({{"destination", "/dev/init"},
                         {"type", "bind"},
                         {"source", "/usr/bin/tini-static"},
                         {"options", {"rbind", "nosuid", "nodev", "ro"}}}));
    }
  }
  EXPECT_THAT(targets, Not(testing::Contains("/sys/fs/cgroup")));
  EXPECT_THAT(targets, testing::Contains("/dev/init"));
  // The source (dir_) as opened when the run started, bound in the run's
  // own directory for runc, and gone from there once runc has made its own.
  const std::string staged = Context(spec).dir + "/mount-0";
  EXPECT_EQ(config["mounts"].back(),
            json({{"destination", "/data"},
                  {"type", "bind"},
                  {"source", staged},
                  {"options", {"rbind", "nosuid", "nodev", "ro"}}}));
  EXPECT_FALSE(std::filesystem::exists(staged));
}

TEST_F(OciTest, NetworkNoneLeavesOnlyLoopback) {
  ContainerSpec spec = Spec("net", {"ls", "/sys/class/net"});
  spec.network_none = true;
  auto [exit, logs] = RunToEnd(spec);
  EXPECT_EQ(logs, "lo\n");
}

TEST_F(OciTest, MemoryPastTheLimitIsOomKilled) {
  ContainerSpec spec = Spec(
      "hog", {"python3", "-c", "b = []\nwhile True: b.append(bytearray(1 << 20))"});
  spec.memory = 32 << 20;
  auto [exit, logs] = RunToEnd(spec);
  EXPECT_EQ(exit.reason, ExitReason::kOomKilled) << exit.ToString() << " " << logs;
  EXPECT_EQ(exit.signal, SIGKILL);
  ASSERT_OK_AND_ASSIGN(Usage usage, runs_.back()->Usage());
  EXPECT_GE(usage.memory_peak, 30u << 20);
  EXPECT_LE(usage.memory_peak, 32u << 20);
}

TEST_F(OciTest, StopEndsTheWholeTreeWithTerm) {
  ASSERT_OK_AND_ASSIGN(launch::Run * run, Start(Spec("tree", {"sh", "-c", "sleep 1000 & sleep 1000 & wait"})));
  ASSERT_OK_AND_ASSIGN(std::optional<ExitStatus> early, run->Wait(milliseconds(200)));
  EXPECT_FALSE(early.has_value());
  ASSERT_OK_AND_ASSIGN(auto cg, Cgroup::Open(options_.cgroup_parent + "/" + run->id()));
  // 200 ms in, sh may not have forked both sleeps yet on a loaded machine.
  EXPECT_TRUE(WaitFor([&] { return cg->Processes().size() == 4; }, seconds(60),
                      "the init, sh and its two sleeps in the cgroup"));
  ASSERT_OK_AND_ASSIGN(Usage usage, run->Usage());
  EXPECT_EQ(usage.pids, 4);  // the init, sh, two sleeps
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_THAT(run->Stop(seconds(20)), IsOk());
  ASSERT_OK_AND_ASSIGN(std::optional<ExitStatus> end, run->Wait(seconds(10)));
  ASSERT_TRUE(end.has_value());
  // The init passed the TERM to sh, which dies of it; the sleeps go with
  // the container, no KILL needed; the init reports sh's end as 128 + 15.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, seconds(10));
  EXPECT_EQ(end->ToString(), "signaled(SIGTERM)");
  EXPECT_THAT(cg->Processes(), ElementsAre());
}

TEST_F(OciTest, StopKillsATreeThatIgnoresTerm) {
  ASSERT_OK_AND_ASSIGN(launch::Run * run, Start(Spec("stubborn", {"sh", "-c",
                                                         "trap \"\" TERM; sleep 1000 & "
                                                         "sleep 1000 & wait"})));
  ASSERT_OK_AND_ASSIGN(auto cg, Cgroup::Open(options_.cgroup_parent + "/" + run->id()));
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_THAT(run->Stop(milliseconds(300)), IsOk());
  ASSERT_THAT(run->Stop(milliseconds(300)), IsOk());  // idempotent
  ASSERT_OK_AND_ASSIGN(std::optional<ExitStatus> end, run->Wait(seconds(10)));
  ASSERT_TRUE(end.has_value());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(300));
  EXPECT_EQ(end->ToString(), "signaled(SIGKILL)");
  EXPECT_THAT(cg->Processes(), ElementsAre());
  EXPECT_THAT(run->Remove(), IsOk());
  // Cleanup waits for the deletes Remove queued; then nothing is left.
  ASSERT_OK_AND_ASSIGN(int swept, backend_->Cleanup(options_.id));
  EXPECT_EQ(swept, 0);
  EXPECT_THAT(Cgroup::Open(options_.cgroup_parent + "/" + run->id()),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(RuncIds(options_.state_dir + "/runc"), ElementsAre());
}

TEST_F(OciTest, CleanupSweepsWhatACrashedLauncherLeft) {
  // A launcher process that starts two containers and dies without a word.
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto backend = MakeOciBackend(options_);
    if (!backend.ok()) _exit(2);
    for (const char* name : {"a", "b"}) {
      ContainerSpec spec = Spec(name, {"sleep", "1000"});
      auto run = (*backend)->Start(spec, Context(spec));
      if (!run.ok()) _exit(3);
      run->release();
    }
    kill(getpid(), SIGKILL);
  }
  int status;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "the child launcher failed: " << status;
  EXPECT_EQ(RuncIds(options_.state_dir + "/runc").size(), 2u);
  EXPECT_EQ(OurCgroups().size(), 2u);
  ASSERT_OK_AND_ASSIGN(int others, backend_->Cleanup("someone-else"));
  EXPECT_EQ(others, 0);
  ASSERT_OK_AND_ASSIGN(int swept, backend_->Cleanup(options_.id));
  EXPECT_EQ(swept, 2);
  EXPECT_THAT(RuncIds(options_.state_dir + "/runc"), ElementsAre());
  EXPECT_THAT(OurCgroups(), ElementsAre());
  // The bundles went too.
  EXPECT_FALSE(fs::exists(options_.state_dir + "/runs/" + RunName(options_.id, "a", 0)));
}

// Cleanup(id) finds the cgroups of containers that runc no longer has by
// the run names' "<id>-" prefix, which also begins the run names of a
// launcher whose id extends this one's ("a" and "a-b"): that one's running
// container stays, whether runc keeps it in this launcher's root or in its
// own, and is swept by its own id.
TEST_F(OciTest, CleanupLeavesTheContainersOfALauncherWhoseIdExtendsThisOnes) {
  for (bool same_root : {false, true}) {
    SCOPED_TRACE(same_root ? "one runc root" : "a runc root each");
    LauncherOptions other = options_;
    other.id = options_.id + "-b";
    other.state_dir = dir_ + (same_root ? "/other-in-this-root" : "/other");
    if (same_root) other.oci.root = options_.state_dir + "/runc";
    fs::create_directories(other.state_dir);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> backend, MakeOciBackend(other));
    const ContainerSpec spec = Spec("w0", {"sleep", "1000"});
    RunContext context;
    context.launcher_id = other.id;
    context.run_name = RunName(other.id, spec.name, 0);
    context.dir = absl::StrCat(other.state_dir, "/runs/", context.run_name);
    fs::create_directories(context.dir);
    context.labels = {{"deepnex.launcher", other.id}, {"deepnex.name", spec.name}};
    ASSERT_OK(backend->Check(spec));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<launch::Run> run, backend->Start(spec, context));
    ASSERT_OK_AND_ASSIGN(int swept, backend_->Cleanup(options_.id));
    EXPECT_EQ(swept, 0);
    ASSERT_OK_AND_ASSIGN(std::optional<ExitStatus> ended, run->Wait(milliseconds(0)));
    EXPECT_FALSE(ended.has_value()) << ended->ToString();
    ASSERT_OK_AND_ASSIGN(swept, backend_->Cleanup(other.id));
    EXPECT_EQ(swept, 1);
    ASSERT_OK_AND_ASSIGN(ended, run->Wait(seconds(10)));
    EXPECT_TRUE(ended.has_value());
    EXPECT_THAT(run->Remove(), IsOk());
    EXPECT_THAT(backend->Cleanup(other.id), IsOk());
    EXPECT_THAT(Cgroup::Open(options_.cgroup_parent + "/" + context.run_name),
                StatusIs(absl::StatusCode::kNotFound));
  }
}

TEST_F(OciTest, BadImagesAndCommands) {
  ContainerSpec spec = Spec("bad", {"true"});
  spec.image = dir_ + "/no-such-image";
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(dir_ + "/no-such-image")));
  spec.image = "busybox:latest";
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("busybox:latest")));
  spec.image = "host";
  spec.command = {"no-such-command-xyz"};
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no-such-command-xyz")));
  // Started, then dead at once: tini could not fork the command (probe).
  spec.command = {"true"};
  spec.pids_limit = 1;
  EXPECT_THAT(backend_->Check(spec), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("spec.pids_limit: 1: the oci backend")));
  spec.pids_limit = 0;
  // On the host, not in the host image: /root is not bound in.
  const std::string script = dir_ + "/tool.sh";
  ASSERT_EQ(Bash("printf \"#!/bin/sh\\necho tool\\n\" > " + script + "; chmod +x " + script), 0);
  spec.command = {script};
  EXPECT_THAT(backend_->Check(spec), StatusIs(absl::StatusCode::kNotFound, HasSubstr(script)));
  // ...unless a mount brings it in.
  spec.mounts = {{dir_, "/work", true}};
  spec.command = {"/work/tool.sh"};
  EXPECT_THAT(backend_->Check(spec), IsOk());
  auto [exit, logs] = RunToEnd(spec);
  EXPECT_EQ(logs, "tool\n");
}

// The issue's cases on the host image of this merged-/usr machine: /bin is
// a symlink to usr/bin in the image, /usr/bin/sh and /usr/bin/python3 are
// symlinks (python3 -> python3.11) inside the host's /usr that is bound in.
TEST_F(OciTest, CommandLookupFollowsTheImagesSymlinks) {
  ContainerSpec spec = Spec("sh", {"/bin/sh", "-c", "echo from-sh"});
  ASSERT_THAT(backend_->Check(spec), IsOk());
  EXPECT_EQ(RunToEnd(spec).second, "from-sh\n");
  spec = Spec("py", {"/usr/bin/python3", "-c", "print('from-python')"});
  ASSERT_THAT(backend_->Check(spec), IsOk());
  EXPECT_EQ(RunToEnd(spec).second, "from-python\n");
  spec.command = {"/bin/deepnex-no-such-command"};
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("command \"/bin/deepnex-no-such-command\" is not an executable "
                                 "file in image host (/usr/bin/deepnex-no-such-command: No "
                                 "such file or directory)")));
  // The host's /etc shows only what programs need, ld.so.cache among it.
  spec.command = {"/etc/ld.so.cache/x"};
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("/etc/ld.so.cache: Not a directory")));
  // A directory or a file without x bits is not a command.
  spec.command = {"/bin"};
  EXPECT_THAT(backend_->Check(spec), StatusIs(absl::StatusCode::kNotFound));
  spec.command = {"/etc/ld.so.cache"};
  struct stat st;
  ASSERT_EQ(stat("/etc/ld.so.cache", &st), 0);
  ASSERT_EQ(st.st_mode & 0111, 0u);
  EXPECT_THAT(backend_->Check(spec), StatusIs(absl::StatusCode::kNotFound));
  // The runtime's /tmp is an empty tmpfs whatever the host's holds.
  const std::string script = dir_ + "/t.sh";
  ASSERT_EQ(Bash("printf \"#!/bin/sh\\necho t\\n\" > " + script + "; chmod +x " + script), 0);
  spec.command = {script};
  EXPECT_THAT(backend_->Check(spec), StatusIs(absl::StatusCode::kNotFound, HasSubstr(script)));
}

// Symlinks inside a mount: relative ones, ".." and absolute ones resolve in
// the container, not on the host, where these lead elsewhere or nowhere.
TEST_F(OciTest, LinksInAMountResolveInTheContainer) {
  ASSERT_EQ(Bash("cd " + dir_ +
                 " && mkdir -p m/sub && printf \"#!/bin/sh\\necho tool\\n\" > m/tool.sh && "
                 "chmod +x m/tool.sh && ln -s ../../data/tool.sh m/sub/up && "
                 "ln -s /data/sub/up m/abs && ln -s abs m/chain"),
            0);
  ContainerSpec spec = Spec("links", {"/data/chain"});
  spec.mounts = {{dir_ + "/m", "/data", true}};
  ASSERT_THAT(backend_->Check(spec), IsOk());
  EXPECT_EQ(RunToEnd(spec).second, "tool\n");
  // Relative to the working directory, through a link to a directory.
  spec = Spec("rel", {"./up"});
  spec.mounts = {{dir_ + "/m", "/data", true}};
  spec.working_dir = "/data/sub";
  ASSERT_THAT(backend_->Check(spec), IsOk());
  EXPECT_EQ(RunToEnd(spec).second, "tool\n");
  spec.working_dir = "/lib";  // a symlink to usr/lib in the host image
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("command \"./up\"")));
  spec.working_dir = "/data/nowhere";
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("spec.working_dir: \"/data/nowhere\" is not a directory in image "
                                 "host (/data/nowhere: No such file or directory)")));
  spec.working_dir = "/data/tool.sh";
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("spec.working_dir: \"/data/tool.sh\" is not a directory")));
  // The host's cwd is not the container's: not there without a mount.
  spec.working_dir = dir_;
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("spec.working_dir: \"" + dir_)));
}

// Resolve checks a mount's source by its path; a user who can write a
// directory on that path could swap it for a symlink before runc bound it,
// and a race did bind the host's / writable. The backend opens the checked
// path following no symlink, and binds what it opened: the swap is seen.
TEST_F(OciTest, AMountSourceSwappedForALinkAfterItsCheckIsRefused) {
  ASSERT_EQ(Bash("mkdir -p " + dir_ + "/user && ln -s / " + dir_ + "/user/d && ln -s / " + dir_ +
                 "/user/up"),
            0);
  for (const std::string& source : {dir_ + "/user/d", dir_ + "/user/up/etc"}) {
    ContainerSpec spec = Spec("swap", {"ls", "/m"});
    spec.mounts = {{source, "/m", false}};
    EXPECT_THAT(Start(spec),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         "spec.mounts[0].source: \"" + source +
                             "\" changed since it was checked (Too many levels of symbolic "
                             "links)"));
  }
}

// runc makes the directories on the way to a mount point, also in its
// own empty /tmp; nothing else appears there.
TEST_F(OciTest, TheWayToAMountPointExists) {
  ASSERT_EQ(Bash("mkdir -p " + dir_ + "/m && touch " + dir_ + "/m/f"), 0);
  ContainerSpec spec = Spec("way", {"sh", "-c", "pwd; ls; ls data"});
  spec.mounts = {{dir_ + "/m", "/tmp/deep/data", true}};
  spec.working_dir = "/tmp/deep";
  ASSERT_THAT(backend_->Check(spec), IsOk());
  EXPECT_EQ(RunToEnd(spec).second, "/tmp/deep\ndata\nf\n");
  spec.working_dir = "/tmp/deep/other";
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("(/tmp/deep/other: No such file or directory)")));
}

TEST_F(OciTest, StopEndsACommandThatHandlesTermAtOnce) {
  // PID 1 of the container is the init: the command gets the TERM, which
  // a PID 1 without a handler would ignore until the KILL.
  ASSERT_OK_AND_ASSIGN(launch::Run * trap,
                       Start(Spec("trap", {"sh", "-c", "trap \"exit 0\" TERM; echo up; "
                                                       "while :; do sleep 0.1; done"})));
  ASSERT_OK_AND_ASSIGN(launch::Run * py,
                       Start(Spec("py", {"python3", "-c",
                                         "import signal, sys, time\n"
                                         "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                                         "print('up', flush=True)\n"
                                         "time.sleep(1000)"})));
  ASSERT_OK_AND_ASSIGN(launch::Run * plain,
                       Start(Spec("plain", {"python3", "-c",
                                            "import time; print('up', flush=True); "
                                            "time.sleep(1000)"})));
  for (launch::Run* run : {trap, py, plain}) {
    // Up: the handler is installed.
    const auto deadline = std::chrono::steady_clock::now() + seconds(30);
    while (run->Logs().value_or("") != "up\n") {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << run->id() << " did not start";
      ASSERT_OK_AND_ASSIGN(std::optional<ExitStatus> early, run->Wait(milliseconds(20)));
      ASSERT_FALSE(early.has_value()) << run->id() << ": " << early->ToString();
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (launch::Run* run : {trap, py, plain}) ASSERT_THAT(run->Stop(seconds(20)), IsOk());
  std::vector<std::string> ends;
  for (launch::Run* run : {trap, py, plain}) {
    ASSERT_OK_AND_ASSIGN(std::optional<ExitStatus> end, run->Wait(seconds(15)));
    ASSERT_TRUE(end.has_value()) << run->id();
    ends.push_back(end->ToString());
  }
  EXPECT_THAT(ends, ElementsAre("exited(0)", "exited(0)", "signaled(SIGTERM)"));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, seconds(5));
}

TEST_F(OciTest, TheInitIsPid1AndCanBeLeftOut) {
  auto [exit, logs] = RunToEnd(Spec("pid1", {"sh", "-c", "tr \"\\0\" \" \" </proc/1/cmdline"}));
  EXPECT_EQ(logs, "/dev/init -- sh -c tr \"\\0\" \" \" </proc/1/cmdline ");

  LauncherOptions options = options_;
  options.oci.init = "deepnex-no-such-init";
  EXPECT_THAT(MakeOciBackend(options),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("oci.init: \"deepnex-no-such-init\" is not usable")));
  options.oci.init = "none";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> bare, MakeOciBackend(options));
  backend_.swap(bare);
  auto [bare_exit, bare_logs] = RunToEnd(Spec("bare", {"sh", "-c", "echo $$"}));
  backend_.swap(bare);
  EXPECT_EQ(bare_logs, "1\n");
}

// runc init leaves a SIGURG pending for the init, which passes it on as the
// command starts; that must not show in the output (with tini's -g it was
// lost and logged in about one run in five).
TEST_F(OciTest, TheInitAddsNothingToTheOutput) {
  for (int i = 0; i < 20; ++i) {
    auto [exit, logs] = RunToEnd(Spec(absl::StrCat("quiet", i), {"sh", "-c", "echo hi"}));
    ASSERT_EQ(logs, "hi\n") << "run " << i;
    ASSERT_TRUE(exit.ok()) << exit.ToString();
  }
}

// Through a Launcher: a relative state dir is made absolute at Create (a
// bundle's relative rootfs would be taken from the bundle by runc).
TEST_F(OciTest, ALauncherWithARelativeStateDir) {
  char cwd[PATH_MAX];
  ASSERT_NE(getcwd(cwd, sizeof cwd), nullptr);
  ASSERT_EQ(chdir(dir_.c_str()), 0);
  LauncherOptions options = options_;
  options.state_dir = "relative-state";
  absl::StatusOr<std::unique_ptr<Launcher>> launcher = Launcher::Create(options);
  ASSERT_EQ(chdir(cwd), 0);
  ASSERT_THAT(launcher, IsOk());
  ContainerSpec spec = Spec("rel", {"sh", "-c", "echo hi"});
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Handle> h, (*launcher)->Start(spec));
  ASSERT_OK_AND_ASSIGN(ExitStatus e, h->Wait(seconds(30)));
  EXPECT_EQ(e.ToString(), "exited(0)");
  ASSERT_OK_AND_ASSIGN(std::string logs, h->Logs());
  EXPECT_EQ(logs, "hi\n");
  EXPECT_TRUE(fs::exists(dir_ + "/relative-state/containers/rel"));
}

// A one-binary rootfs: busybox-static and links for the applets the tests use.
absl::Status MakeBusyboxRootfs(const std::string& dir) {
  if (access("/bin/busybox", X_OK) != 0) {
    return absl::FailedPreconditionError("/bin/busybox (busybox-static) is not installed");
  }
  if (Bash("mkdir -p " + dir + "/bin && cp /bin/busybox " + dir +
           "/bin/ && for a in sh ls cat; do ln -s busybox " + dir + "/bin/$a; done") != 0) {
    return absl::InternalError("cannot make " + dir);
  }
  return absl::OkStatus();
}

TEST_F(OciTest, RootfsDirectoryImage) {
  const std::string rootfs = dir_ + "/rootfs";
  absl::Status made = MakeBusyboxRootfs(rootfs);
  if (absl::IsFailedPrecondition(made)) GTEST_SKIP() << made.message();
  ASSERT_THAT(made, IsOk());
  ContainerSpec spec = Spec("bb", {"sh", "-c", "echo in-busybox; test -e /usr/bin/python3 || echo no-python"});
  spec.image = rootfs;
  spec.env["PATH"] = "/bin";
  auto [exit, logs] = RunToEnd(spec);
  EXPECT_EQ(logs, "in-busybox\nno-python\n");
  spec.command = {"python3"};
  EXPECT_THAT(backend_->Check(spec), StatusIs(absl::StatusCode::kNotFound, HasSubstr("PATH=/bin")));
}

// runc gives the tmpfs on /tmp its mount point's mode: the host image's was
// 0755, and a user's notebook could not mktemp there (probe). The tmpfs is
// the user's, whatever the image's /tmp, or what its link names, is.
TEST_F(OciTest, AUserCanWriteTmp) {
  const RunAs alice{4242, 4343, "alice", "/home/alice"};
  ContainerSpec spec = Spec("tmp-host", {"sh", "-c", "touch /tmp/y && stat -L -c %u:%g /tmp"});
  EXPECT_EQ(OutputAs(spec, alice), "4242:4343\n");
  const std::string rootfs = dir_ + "/tmp-rootfs";
  absl::Status made = MakeBusyboxRootfs(rootfs);
  if (absl::IsFailedPrecondition(made)) GTEST_SKIP() << made.message();
  ASSERT_THAT(made, IsOk());
  spec.image = rootfs;
  spec.env["PATH"] = "/bin";
  fs::create_directories(rootfs + "/tmp");
  ASSERT_EQ(chmod((rootfs + "/tmp").c_str(), 0755), 0);
  spec.name = "tmp-dir";
  EXPECT_EQ(OutputAs(spec, alice), "4242:4343\n");
  fs::remove(rootfs + "/tmp");
  fs::create_directories(rootfs + "/var/tmp");
  ASSERT_EQ(chmod((rootfs + "/var/tmp").c_str(), 0755), 0);
  fs::create_symlink("var/tmp", rootfs + "/tmp");
  spec.name = "tmp-link";
  EXPECT_EQ(OutputAs(spec, alice), "4242:4343\n");
}

// A run writes over its image in an overlay layer of its own: the image's
// files, which every run of it shares, never change.
TEST_F(OciTest, WritesGoToTheRunsOwnLayer) {
  const std::string rootfs = dir_ + "/rootfs";
  absl::Status made = MakeBusyboxRootfs(rootfs);
  if (absl::IsFailedPrecondition(made)) GTEST_SKIP() << made.message();
  ASSERT_THAT(made, IsOk());
  ASSERT_EQ(Bash("echo old > " + rootfs + "/old"), 0);
  ContainerSpec spec =
      Spec("w1", {"sh", "-c", "echo new > /new && busybox rm /old && cat /new; ls /"});
  spec.image = rootfs;
  spec.env["PATH"] = "/bin";
  EXPECT_EQ(RunToEnd(spec).second, "new\nbin\ndev\netc\nnew\nproc\nsys\ntmp\n");
  EXPECT_EQ(Config(spec)["root"], json({{"path", Context(spec).dir + "/rootfs"},
                                        {"readonly", false}}));
  spec.name = "w2";
  spec.command = {"sh", "-c", "cat /old; test -e /new || echo no-new"};
  EXPECT_EQ(RunToEnd(spec).second, "old\nno-new\n");
  EXPECT_EQ(ReadFile(rootfs + "/old"), "old\n");
  EXPECT_FALSE(std::filesystem::exists(rootfs + "/new"));
}

// Remove is a run's only clean-up: a runc delete that fails (here a runc
// that refuses it) still leaves no writable layer mounted, which would
// outlive the bundle directory and keep it busy.
TEST_F(OciTest, AFailedRuncDeleteStillUnmountsTheLayer) {
  const std::string rootfs = dir_ + "/rootfs";
  absl::Status made = MakeBusyboxRootfs(rootfs);
  if (absl::IsFailedPrecondition(made)) GTEST_SKIP() << made.message();
  ASSERT_THAT(made, IsOk());
  const std::string refuse = dir_ + "/refuse-delete";
  options_.oci.runc = dir_ + "/runc-refusing-delete";
  {
    std::ofstream script(options_.oci.runc);
    // runc's arguments here: --root DIR COMMAND ...
    script << "#!/bin/sh\nif [ \"$3\" = delete ] && [ -e " << refuse
           << " ]; then echo 'delete refused' >&2; exit 1; fi\nexec runc \"$@\"\n";
  }
  fs::permissions(options_.oci.runc, fs::perms::owner_all);
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeOciBackend(options_);
  ASSERT_THAT(backend, IsOk());
  backend_ = std::move(*backend);
  std::ofstream(refuse).close();
  ContainerSpec spec = Spec("layer", {"sh", "-c", "true"});
  spec.image = rootfs;
  spec.env["PATH"] = "/bin";
  EXPECT_TRUE(RunToEnd(spec).first.ok());
  const std::string layer = Context(spec).dir + "/rootfs";
  auto mounted = [&] {
    return absl::StrContains(ReadFile("/proc/self/mountinfo"), " " + layer + " ");
  };
  ASSERT_TRUE(mounted());
  std::unique_ptr<launch::Run> run = std::move(runs_.back());
  runs_.pop_back();
  EXPECT_THAT(run->Remove(), StatusIs(absl::StatusCode::kInternal, HasSubstr("delete refused")));
  EXPECT_FALSE(mounted());
  fs::remove(refuse);  // TearDown's Cleanup deletes the container
}

// A commit adds a layer to its image's: neither the host image (the host's
// own files) nor a rootfs directory has layers. A forwarded port is dialled
// in the container's own network namespace.
TEST_F(OciTest, CommitNeedsARegistryImageAndTheNetworkIsTheContainers) {
  const std::string rootfs = dir_ + "/rootfs";
  absl::Status made = MakeBusyboxRootfs(rootfs);
  if (absl::IsFailedPrecondition(made)) GTEST_SKIP() << made.message();
  ASSERT_THAT(made, IsOk());
  const std::string target = "docker://127.0.0.1:1/alice/mine:v1";
  absl::StatusOr<launch::Run*> host = Start(Spec("c1", {"sleep", "30"}));
  ASSERT_THAT(host, IsOk());
  EXPECT_THAT((*host)->Commit(target),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("runs the host image")));
  absl::StatusOr<std::string> netns = (*host)->NetworkNamespace();
  ASSERT_THAT(netns, IsOk());
  struct stat ours, its;
  ASSERT_EQ(stat("/proc/self/ns/net", &ours), 0);
  ASSERT_EQ(stat(netns->c_str(), &its), 0) << *netns;
  EXPECT_NE(ours.st_ino, its.st_ino);

  ContainerSpec spec = Spec("c2", {"busybox", "sleep", "30"});
  spec.image = rootfs;
  spec.env["PATH"] = "/bin";
  absl::StatusOr<launch::Run*> dir = Start(spec);
  ASSERT_THAT(dir, IsOk());
  EXPECT_THAT((*dir)->Commit(target), StatusIs(absl::StatusCode::kFailedPrecondition,
                                               HasSubstr("not from an image registry")));
}

// chroot's rules: ".." stops at the image's root and an absolute link
// starts there, whatever the host has at those paths; at most 40 links per
// lookup, as the kernel allows (checked against it with cat).
TEST_F(OciTest, ImageSymlinksStayInsideTheRoot) {
  const std::string rootfs = dir_ + "/rootfs";
  absl::Status made = MakeBusyboxRootfs(rootfs);
  if (absl::IsFailedPrecondition(made)) GTEST_SKIP() << made.message();
  ASSERT_THAT(made, IsOk());
  // ../ enough times to leave the rootfs on the host.
  std::string up;
  for (int i = 0; i < 12; ++i) up += "../";
  std::string links = absl::StrCat(
      "cd ", rootfs, "/bin && ln -s ", up, "bin/busybox echo && ln -s ", up,
      "usr/bin/python3 py-escape && ln -s /usr/bin/env abs-env && ln -s loop2 loop1 && "
      "ln -s loop1 loop2 && ln -s busybox c0");
  for (int i = 1; i <= 40; ++i) absl::StrAppend(&links, " && ln -s c", i - 1, " c", i);
  ASSERT_EQ(Bash(links), 0);
  ContainerSpec spec = Spec("echo", {"echo", "inside"});
  spec.image = rootfs;
  spec.env["PATH"] = "/bin";
  ASSERT_THAT(backend_->Check(spec), IsOk());
  EXPECT_EQ(RunToEnd(spec).second, "inside\n");
  for (const char* escape : {"/bin/py-escape", "/bin/abs-env"}) {
    spec.command = {escape};
    EXPECT_THAT(backend_->Check(spec), StatusIs(absl::StatusCode::kNotFound,
                                                HasSubstr("No such file or directory")))
        << escape;
  }
  spec.command = {"loop1"};
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("on PATH=/bin")));
  spec.command = {"/bin/loop1"};
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("more than 40 symlinks: Too many levels of symbolic links")));
  spec.command = {"/bin/c39"};  // 40 links
  EXPECT_THAT(backend_->Check(spec), IsOk());
  spec.command = {"/bin/c40"};  // 41
  EXPECT_THAT(backend_->Check(spec),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("Too many levels")));
  spec = Spec("kernel", {"sh", "-c", "cat /bin/c39 >/dev/null && echo c39-ok; "
                                     "cat /bin/c40 >/dev/null 2>&1 || echo c40-eloop"});
  spec.image = rootfs;
  spec.env["PATH"] = "/bin";
  EXPECT_EQ(RunToEnd(spec).second, "c39-ok\nc40-eloop\n");
}

TEST_F(OciTest, OciImageLayoutWithWhiteouts) {
  const std::string base = dir_ + "/layer1", top = dir_ + "/layer2", layout = dir_ + "/layout";
  absl::Status made = MakeBusyboxRootfs(base);
  if (absl::IsFailedPrecondition(made)) GTEST_SKIP() << made.message();
  ASSERT_THAT(made, IsOk());
  // Layer 1: busybox, /etc/old, /var/cache/x; layer 2 (gzipped): /etc/new,
  // deletes /etc/old, makes /var/cache opaque.
  const std::string script = absl::StrCat(
      "B=", base, "; T=", top, "; L=", layout, "\n",
      R"(mkdir -p $B/etc $B/var/cache $T/etc $T/var/cache $L/blobs/sha256
echo old > $B/etc/old; echo x > $B/var/cache/x
echo new > $T/etc/new; : > $T/etc/.wh.old; : > $T/var/cache/.wh..wh..opq; echo y > $T/var/cache/y
blob() { d=$(sha256sum "$1" | cut -d" " -f1); mv "$1" $L/blobs/sha256/$d; echo $d; }
tar -C $B -cf $L/l1 .; l1=$(blob $L/l1); s1=$(stat -c %s $L/blobs/sha256/$l1)
tar -C $T -czf $L/l2 .; l2=$(blob $L/l2); s2=$(stat -c %s $L/blobs/sha256/$l2)
echo "{}" > $L/c; c=$(blob $L/c)
printf "{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"config\":{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:%s\",\"size\":3},\"layers\":[{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar\",\"digest\":\"sha256:%s\",\"size\":%s},{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+gzip\",\"digest\":\"sha256:%s\",\"size\":%s}]}" $c $l1 $s1 $l2 $s2 > $L/m
m=$(blob $L/m)
printf "{\"schemaVersion\":2,\"manifests\":[{\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"digest\":\"sha256:%s\",\"size\":1}]}" $m > $L/index.json
echo "{\"imageLayoutVersion\":\"1.0.0\"}" > $L/oci-layout)");
  ASSERT_EQ(Bash(script), 0);
  ContainerSpec spec = Spec("layout", {"sh", "-c", "ls /etc /var/cache; cat /etc/new"});
  spec.image = layout;
  spec.env["PATH"] = "/bin";
  auto [exit, logs] = RunToEnd(spec);
  EXPECT_TRUE(exit.ok()) << exit.ToString() << " " << logs;
  // The image's /etc under the generated files.
  EXPECT_EQ(logs,
            "/etc:\ngroup\nhostname\nhosts\nnew\nnsswitch.conf\npasswd\nresolv.conf\n\n"
            "/var/cache:\ny\nnew\n");
  // Unpacked once, under the state dir, keyed by the manifest digest.
  int unpacked = 0;
  for (const auto& e : fs::directory_iterator(options_.state_dir + "/oci/images")) {
    EXPECT_TRUE(absl::StartsWith(e.path().filename().string(), "sha256-")) << e.path();
    ++unpacked;
  }
  EXPECT_EQ(unpacked, 1);
  spec.command = {"python3"};
  EXPECT_THAT(backend_->Check(spec), StatusIs(absl::StatusCode::kNotFound));
}

// --- The bundle as a pure function: no root, no runc.

ContainerSpec ConfigSpec() {
  ContainerSpec spec;
  spec.name = "alice.w0";
  spec.command = {"true"};
  spec.run_as = RunAs{4242, 4343, "alice", "/home/alice"};
  return spec;
}

Bundle ConfigBundle() {
  Bundle b;
  b.cgroup_path = "deepnex/r0";
  b.etc_dir = "/state/run-0/etc";
  b.uid = 4242;
  b.gid = 4343;
  return b;
}

RunContext ConfigContext() {
  RunContext c;
  c.run_name = "r0";
  c.labels = {{"deepnex.name", "alice.w0"}};
  return c;
}

// "source>destination" of each bind in `mounts`.
std::vector<std::string> Binds(const json& mounts) {
  std::vector<std::string> binds;
  for (const json& m : mounts) {
    if (m["type"] == "bind") {
      binds.push_back(m["source"].get<std::string>() + ">" + m["destination"].get<std::string>());
    }
  }
  return binds;
}

TEST(OciConfig, TheUserWithoutCapabilitiesPrivateNetworkAndDefaultPidsLimit) {
  const Image image{"/images/base", false, {}};
  const json config = MakeConfig(image, ConfigSpec(), ConfigContext(), ConfigBundle());
  EXPECT_EQ(config["process"]["user"], json({{"uid", 4242}, {"gid", 4343}}));
  EXPECT_EQ(config["process"]["capabilities"],
            json({{"bounding", json::array()},
                  {"effective", json::array()},
                  {"permitted", json::array()}}));
  EXPECT_TRUE(config["process"]["noNewPrivileges"].get<bool>());
  EXPECT_EQ(config["process"]["env"],
            json({"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                  "HOME=/home/alice", "HOSTNAME=alice.w0"}));
  EXPECT_EQ(config["linux"]["namespaces"].dump(),
            R"([{"type":"pid"},{"type":"mount"},{"type":"uts"},{"type":"ipc"},{"type":"network"}])");
  EXPECT_EQ(config["linux"]["resources"]["pids"], json({{"limit", 4096}}));
  EXPECT_EQ(config["root"], json({{"path", "/images/base"}, {"readonly", true}}));
  // The generated files, read-only, over the image's /etc.
  EXPECT_EQ(Binds(config["mounts"]),
            (std::vector<std::string>{"/state/run-0/etc/passwd>/etc/passwd",
                                      "/state/run-0/etc/group>/etc/group",
                                      "/state/run-0/etc/hosts>/etc/hosts",
                                      "/state/run-0/etc/hostname>/etc/hostname",
                                      "/state/run-0/etc/resolv.conf>/etc/resolv.conf",
                                      "/state/run-0/etc/nsswitch.conf>/etc/nsswitch.conf"}));
  EXPECT_EQ(config["mounts"].back()["options"], json({"rbind", "nosuid", "nodev", "ro"}));

  ContainerSpec spec = ConfigSpec();
  spec.host_network = true;
  spec.pids_limit = 10;
  const json shared = MakeConfig(image, spec, ConfigContext(), ConfigBundle());
  EXPECT_EQ(shared["linux"]["namespaces"].dump(),
            R"([{"type":"pid"},{"type":"mount"},{"type":"uts"},{"type":"ipc"}])");
  EXPECT_EQ(shared["linux"]["resources"]["pids"], json({{"limit", 10}}));
}

TEST(OciConfig, RootKeepsRuncsDefaultCapabilities) {
  ContainerSpec spec = ConfigSpec();
  spec.run_as.reset();
  Bundle bundle = ConfigBundle();
  bundle.uid = bundle.gid = 0;
  const json config = MakeConfig(Image{"/images/base", false, {}}, spec, ConfigContext(), bundle);
  const json caps = {"CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"};
  EXPECT_EQ(config["process"]["capabilities"],
            json({{"bounding", caps}, {"effective", caps}, {"permitted", caps}}));
  EXPECT_EQ(config["process"]["user"], json({{"uid", 0}, {"gid", 0}}));
}

// The host image shows the host's /usr and /opt, and of its /etc only its
// EtcEntries; while a spec is only checked there are no generated files.
TEST(OciConfig, HostImageShowsOnlyItsEtcEntries) {
  const Image image{"/state/oci/host", true, {{"ssl", "/etc/ssl"}}};
  Bundle bundle = ConfigBundle();
  bundle.etc_dir.clear();
  std::vector<std::string> want;
  for (const char* dir : {"/usr", "/opt"}) {
    if (fs::is_directory(dir)) want.push_back(std::string(dir) + ">" + dir);
  }
  want.push_back("/etc/ssl>/etc/ssl");
  EXPECT_EQ(Binds(Mounts(image, ConfigSpec(), bundle)), want);
}

TEST(OciConfig, GeneratedEtcNamesTheUserAndTheHost) {
  ContainerSpec spec = ConfigSpec();
  std::map<std::string, std::string> files =
      EtcFiles(spec, ConfigBundle(), "nameserver 10.0.0.1\n");
  EXPECT_EQ(files, (std::map<std::string, std::string>{
                       {"passwd",
                        "root:x:0:0:root:/root:/bin/sh\n"
                        "alice:x:4242:4343:alice:/home/alice:/bin/sh\n"
                        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"},
                       {"group", "root:x:0:\nalice:x:4343:\nnogroup:x:65534:\n"},
                       {"hosts",
                        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                        "127.0.1.1\talice.w0\n"},
                       {"hostname", "alice.w0\n"},
                       {"resolv.conf", ""},
                       {"nsswitch.conf",
                        "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n"}}));
  // With the host network, the host's DNS servers are reachable.
  spec.host_network = true;
  EXPECT_EQ(EtcFiles(spec, ConfigBundle(), "nameserver 10.0.0.1\n")["resolv.conf"],
            "nameserver 10.0.0.1\n");
  // Without a name: "user"; mapped to nobody, the user takes nobody's line.
  spec.run_as->user.clear();
  EXPECT_THAT(EtcFiles(spec, ConfigBundle(), "")["passwd"],
              HasSubstr("\nuser:x:4242:4343:user:/home/alice:/bin/sh\n"));
  Bundle nobody = ConfigBundle();
  nobody.uid = nobody.gid = 65534;
  spec.run_as->user = "alice";
  files = EtcFiles(spec, nobody, "");
  EXPECT_EQ(files["passwd"],
            "root:x:0:0:root:/root:/bin/sh\nalice:x:65534:65534:alice:/home/alice:/bin/sh\n");
  EXPECT_EQ(files["group"], "root:x:0:\nalice:x:65534:\n");
}

// --- What a container's process can reach (root and runc).

TEST_F(OciTest, RunsAsTheGivenUserWithNoCapabilities) {
  ContainerSpec spec = Spec(
      "as", {"sh", "-c",
             "id -u; id -g; id -un; echo $HOME; grep -E '^Cap(Prm|Eff|Bnd)' /proc/self/status; "
             "python3 -c \"import socket; socket.socket().bind(('127.0.0.1', 999))\" "
             "2>/dev/null || echo no-port-999"});
  EXPECT_EQ(OutputAs(spec, RunAs{4242, 4242, "alice", "/home/alice"}),
            "4242\n4242\nalice\n/home/alice\nCapPrm:\t0000000000000000\n"
            "CapEff:\t0000000000000000\nCapBnd:\t0000000000000000\nno-port-999\n");
}

// The host image's /etc is generated: no host users, no shadow, yet the
// host's programs run.
TEST_F(OciTest, NoHostEtc) {
  ContainerSpec spec = Spec(
      "etc", {"sh", "-c",
              "cat /etc/shadow 2>/dev/null || echo no-shadow; "
              "ls /etc/gshadow /etc/sudoers /etc/ssh 2>/dev/null | wc -l; cat /etc/passwd; "
              "python3 -c \"print('python-runs')\""});
  EXPECT_EQ(OutputAs(spec, RunAs{4242, 4242, "alice", ""}),
            "no-shadow\n0\nroot:x:0:0:root:/root:/bin/sh\nalice:x:4242:4242:alice:/:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\npython-runs\n");
}

// A private network by default: its own loopback works, a port on the
// host's loopback is out of reach; the host network reaches it.
TEST_F(OciTest, PrivateNetworkReachesNoHostPort) {
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  struct sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(listener, 16), 0);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string script = absl::StrCat(
      "import socket\n"
      "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
      "socket.create_connection(s.getsockname(), timeout=5).close(); print('own-loopback')\n"
      "try:\n"
      "    socket.create_connection(('127.0.0.1', ", ntohs(addr.sin_port), "), timeout=5)\n"
      "    print('host-port')\n"
      "except OSError:\n"
      "    print('no-host-port')\n");
  for (bool host : {false, true}) {
    ContainerSpec spec = Spec(host ? "shared" : "private", {"python3", "-c", script});
    spec.run_as = RunAs{4242, 4242, "", ""};
    spec.host_network = host;
    EXPECT_EQ(RunToEnd(spec).second, host ? "own-loopback\nhost-port\n"
                                          : "own-loopback\nno-host-port\n");
  }
  close(listener);
}

// Only an oci container has a layer of changes; a launcher on another
// backend says which it is (no runc or root needed).
TEST(LauncherCommit, AProcessContainerHasNoLayerToCommit) {
  LauncherOptions options;
  options.backend = "process";
  absl::StatusOr<std::unique_ptr<Launcher>> launcher = Launcher::Create(options);
  ASSERT_THAT(launcher, IsOk());
  ContainerSpec spec;
  spec.name = "p";
  spec.command = {"sleep", "30"};
  absl::StatusOr<std::shared_ptr<Handle>> h = (*launcher)->Start(spec);
  ASSERT_THAT(h, IsOk());
  EXPECT_THAT((*h)->Commit("docker://127.0.0.1:1/alice/p:v1"),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ((*h)->Commit("docker://127.0.0.1:1/alice/p:v1").status().message(),
            "container \"p\" runs on the process backend: only oci containers have a layer of "
            "changes to commit");
  EXPECT_THAT((*h)->NetworkNamespace(), IsOk());
  EXPECT_EQ(*(*h)->NetworkNamespace(), "");  // the host's
  EXPECT_THAT((*h)->Stop(std::chrono::milliseconds(0)), IsOk());
}

}  // namespace
}  // namespace deepnex::launch
