// ExecProcess and SpawnExec: a process started beside a container's (exec),
// on a new pseudo-terminal or on pipes, as the container's user.
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "launch/backend.h"
#include "launch/cgroup.h"

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

namespace deepnex::launch {
namespace {

// A window's side as a pty takes it: clamped to 0..65535, where a cast
// wrapped (-1 rows gave 65535; 70000 gave 4464; probe).
unsigned short WindowSide(int n) {
  return static_cast<unsigned short>(std::clamp(n, 0, 65535));
}


absl::Status ErrnoError(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", strerror(errno)));
}

void CloseFd(int fd) {
  if (fd >= 0) close(fd);
}

}  // namespace

ExecProcess::ExecProcess(pid_t pid, int input, int output, int error, bool tty)
    : pid_(pid), input_(input), output_(output), error_(error), tty_(tty) {}

ExecProcess::~ExecProcess() {
  if (!reaped_) {
    Kill();
    Wait().IgnoreError();
  }
  if (input_ != output_) CloseFd(input_);
  CloseFd(output_);
  CloseFd(error_);
}

absl::Status ExecProcess::WriteInput(const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(input_, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError("writing the process's stdin");
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

void ExecProcess::CloseInput() {
  if (tty_) {
    // The master is also the output: the line discipline's EOF instead.
    struct termios t;
    if (tcgetattr(input_, &t) == 0) WriteInput(std::string(1, t.c_cc[VEOF])).IgnoreError();
    return;
  }
  CloseFd(input_);
  input_ = -1;
}

absl::Status ExecProcess::Resize(int rows, int cols) {
  if (!tty_) return absl::OkStatus();
  struct winsize w = {};
  w.ws_row = WindowSide(rows);
  w.ws_col = WindowSide(cols);
  if (ioctl(output_, TIOCSWINSZ, &w) != 0) return ErrnoError("TIOCSWINSZ");
  return absl::OkStatus();
}

void ExecProcess::Kill() {
  std::lock_guard<std::mutex> lock(mu_);
  if (reaped_) return;
  // The child leads a session and group of its own (setsid).
  kill(-pid_, SIGKILL);
  kill(pid_, SIGKILL);
}

absl::StatusOr<int> ExecProcess::Wait() {
  // Waits without reaping, so that Kill never signals a reused pid.
  siginfo_t info;
  int r;
  do {
    r = waitid(P_PID, pid_, &info, WEXITED | WNOWAIT);
  } while (r < 0 && errno == EINTR);
  if (r != 0) return ErrnoError("waitid");
  std::lock_guard<std::mutex> lock(mu_);
  int status = 0;
  if (waitpid(pid_, &status, 0) != pid_) return ErrnoError("waitpid");
  reaped_ = true;
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

absl::StatusOr<std::unique_ptr<ExecProcess>> SpawnExec(const ExecPlan& plan,
                                                       const ExecOptions& options) {
  if (plan.argv.empty()) return absl::InvalidArgumentError("command is empty");
  // argv/envp before fork, so that the child allocates nothing.
  std::vector<std::string> argv_s = plan.argv, env_s = plan.env;
  std::vector<char*> argv, envp;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);

  int master = -1, slave_in = -1, slave_out = -1, slave_err = -1;
  int in_w = -1, out_r = -1, err_r = -1;
  if (options.tty) {
    master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (master < 0 || grantpt(master) != 0 || unlockpt(master) != 0) {
      CloseFd(master);
      return ErrnoError("posix_openpt");
    }
    const char* name = ptsname(master);
    int slave = name == nullptr ? -1 : open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (slave < 0) {
      CloseFd(master);
      return ErrnoError("opening the pty's slave");
    }
    if (options.rows > 0 && options.cols > 0) {
      struct winsize w = {};
      w.ws_row = WindowSide(options.rows);
      w.ws_col = WindowSide(options.cols);
      ioctl(master, TIOCSWINSZ, &w);
    }
    slave_in = slave_out = slave_err = slave;
  } else {
    int in[2], out[2], err[2];
    if (pipe2(in, O_CLOEXEC) != 0) return ErrnoError("pipe2");
    if (pipe2(out, O_CLOEXEC) != 0) {
      CloseFd(in[0]), CloseFd(in[1]);
      return ErrnoError("pipe2");
    }
    if (pipe2(err, O_CLOEXEC) != 0) {
      CloseFd(in[0]), CloseFd(in[1]), CloseFd(out[0]), CloseFd(out[1]);
      return ErrnoError("pipe2");
    }
    slave_in = in[0], in_w = in[1];
    out_r = out[0], slave_out = out[1];
    err_r = err[0], slave_err = err[1];
  }
  auto close_child_ends = [&] {
    CloseFd(slave_in);
    if (slave_out != slave_in) CloseFd(slave_out);
    if (slave_err != slave_in) CloseFd(slave_err);
  };
  int go[2];
  if (pipe2(go, O_CLOEXEC) != 0) {
    close_child_ends();
    CloseFd(master), CloseFd(in_w), CloseFd(out_r), CloseFd(err_r);
    return ErrnoError("pipe2");
  }
  const bool become = plan.run_as.has_value();
  const uid_t uid = become ? plan.run_as->uid : 0;
  const gid_t gid = become ? plan.run_as->gid : 0;
  const bool set_groups = become && geteuid() == 0;
  const char* workdir = plan.working_dir.empty() ? nullptr : plan.working_dir.c_str();
  const bool or_root = plan.or_root;
  const bool tty = options.tty;
  std::vector<const char*> join_files;
  for (const std::string& f : plan.join_files) join_files.push_back(f.c_str());
  sigset_t no_signals;
  sigemptyset(&no_signals);

  pid_t pid = fork();
  if (pid < 0) {
    absl::Status failed = ErrnoError("fork");
    close_child_ends();
    CloseFd(master), CloseFd(in_w), CloseFd(out_r), CloseFd(err_r), CloseFd(go[0]), CloseFd(go[1]);
    return failed;
  }
  if (pid == 0) {
    // Async-signal-safe calls only: other threads may have held locks.
    sigprocmask(SIG_SETMASK, &no_signals, nullptr);
    for (int s = 1; s < NSIG; ++s) signal(s, SIG_DFL);
    setsid();
    char c;
    if (read(go[0], &c, 1) != 1) _exit(127);
    if (!JoinCgroupSelf(join_files)) _exit(126);
    if (tty && ioctl(slave_in, TIOCSCTTY, 0) != 0) _exit(127);
    dup2(slave_in, 0);
    dup2(slave_out, 1);
    dup2(slave_err, 2);
    if (become) {
      if ((set_groups && setgroups(1, &gid) != 0) || setgid(gid) != 0 || setuid(uid) != 0 ||
          prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 ||
          prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
        _exit(126);
      }
    }
    if (workdir != nullptr && chdir(workdir) != 0 && (!or_root || chdir("/") != 0)) {
      // Said on its stderr: a bare 126 left the caller guessing (probe).
      static const char kNoDir[] = "deepnex exec: cannot enter the working directory ";
      [[maybe_unused]] ssize_t n = write(2, kNoDir, sizeof(kNoDir) - 1);
      n = write(2, workdir, strlen(workdir));
      n = write(2, "\n", 1);
      _exit(126);
    }
    syscall(SYS_close_range, 3, ~0U, CLOSE_RANGE_CLOEXEC);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  close_child_ends();
  CloseFd(go[0]);
  absl::Status joined = plan.join ? plan.join(pid) : absl::OkStatus();
  if (!joined.ok()) {
    kill(pid, SIGKILL);
    CloseFd(go[1]);
    waitpid(pid, nullptr, 0);
    CloseFd(master), CloseFd(in_w), CloseFd(out_r), CloseFd(err_r);
    return joined;
  }
  (void)!write(go[1], "g", 1);
  CloseFd(go[1]);
  if (tty) return std::make_unique<ExecProcess>(pid, master, master, -1, true);
  return std::make_unique<ExecProcess>(pid, in_w, out_r, err_r, false);
}

}  // namespace deepnex::launch
