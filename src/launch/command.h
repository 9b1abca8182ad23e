// Runs a short engine command (sbatch, squeue, runc ...) to its end with a
// timeout and collects its output. Private to src/launch.
#ifndef DEEPNEX_LAUNCH_COMMAND_H_
#define DEEPNEX_LAUNCH_COMMAND_H_

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "deepnex/status.h"

namespace deepnex::launch {

struct CommandResult {
  int wait_status = 0;
  std::string out;
  std::string err;
  bool ok() const { return WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0; }
};

// Starts `argv` (argv[0] a path) with stdin from /dev/null, stdout and
// stderr into `out` and `err`, and `envp` as its environment. The child
// starts with default signal dispositions and an empty mask whatever this
// process's threads use, in a process group of its own (a terminal's ^C for
// us is not for it).
inline absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, char* const* envp,
                                   int out, int err) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out, 1);
  posix_spawn_file_actions_adddup2(&actions, err, 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK |
                                      POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  int rc = posix_spawn(&pid, args[0], &actions, &attr, args.data(), envp);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) return absl::InternalError(absl::StrCat("cannot start ", argv[0], ": ", strerror(rc)));
  return pid;
}

// Runs `argv` (argv[0] a path) as Spawn does, with `env` ("K=V") as its
// whole environment, until it ends; SIGKILL after `timeout`, then
// DeadlineExceeded naming the command line.
inline absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv,
                                                const std::vector<std::string>& env,
                                                std::chrono::milliseconds timeout) {
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", strerror(errno)));
  }
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    close(out_pipe[0]);
    close(out_pipe[1]);
    return absl::InternalError(absl::StrCat("pipe2: ", strerror(errno)));
  }
  std::vector<char*> envp;
  for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  absl::StatusOr<pid_t> spawned = Spawn(argv, envp.data(), out_pipe[1], err_pipe[1]);
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (!spawned.ok()) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    return spawned.status();
  }
  const pid_t pid = *spawned;
  CommandResult result;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool killed = false;
  struct pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&result.out, &result.err};
  while (fds[0].fd >= 0 || fds[1].fd >= 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 && !killed) {
      kill(pid, SIGKILL);
      killed = true;
    }
    int n = poll(fds, 2, killed ? 1000 : static_cast<int>(left.count()) + 1);
    if (n < 0 && errno != EINTR) break;
    for (auto& fd : fds) {
      if (fd.fd < 0 || fd.revents == 0) continue;
      char buf[4096];
      ssize_t got = read(fd.fd, buf, sizeof buf);
      if (got > 0) {
        sinks[&fd - fds]->append(buf, got);
      } else if (got == 0 || errno != EINTR) {
        close(fd.fd);
        fd.fd = -1;
      }
    }
    if (killed && n == 0) break;  // a grandchild holds the pipes open
  }
  for (auto& fd : fds) {
    if (fd.fd >= 0) close(fd.fd);
  }
  while (waitpid(pid, &result.wait_status, 0) < 0 && errno == EINTR) {
  }
  if (killed) {
    return absl::DeadlineExceededError(absl::StrCat(
        absl::StrJoin(argv, " "), " did not finish within ", timeout.count(), " ms"));
  }
  return result;
}

// "<command line> failed (exit 1): <its stderr>".
inline std::string DescribeFailure(const std::vector<std::string>& argv,
                                   const CommandResult& r) {
  std::string how = WIFEXITED(r.wait_status)
                        ? absl::StrCat("exit ", WEXITSTATUS(r.wait_status))
                        : absl::StrCat("signal ", WTERMSIG(r.wait_status));
  return absl::StrCat(absl::StrJoin(argv, " "), " failed (", how,
                      "): ", absl::StripAsciiWhitespace(r.err));
}

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_COMMAND_H_
