#include "job/sweeper.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "launch/backend.h"

namespace deepnex::job {
namespace {

constexpr char kDone[] = "done";

// The forked sweeper: a copy of the job's process with one thread, so it
// calls only what takes no lock another thread might have held at the fork
// (the backend's Cleanup reads /proc and cgroup files, kills and rmdirs),
// and leaves by _exit, running none of the copied process's exit handlers.
[[noreturn]] void SweepWhenOrphaned(int read_fd, launch::Backend& backend,
                                    const std::string& launcher_id) {
  // Ctrl-C, a terminal's hangup and a TERM are for the job's process, which
  // then stops the job and says "done"; the sweeper must outlive it.
  struct sigaction ignore = {};
  ignore.sa_handler = SIG_IGN;
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE}) sigaction(s, &ignore, nullptr);
  sigset_t none;
  sigemptyset(&none);
  pthread_sigmask(SIG_SETMASK, &none, nullptr);
  // It holds none of the job's files: a socket whose peer would never see it
  // closed, the write end of another job's sweeper (which would then never
  // see EOF), the read end of `deepnex run | tee` (which would wait for it).
  if (read_fd != 3) dup2(read_fd, 3);
  const int null = open("/dev/null", O_RDWR);
  for (int fd = 0; fd <= 2 && null >= 0; ++fd) dup2(null, fd);
  syscall(SYS_close_range, 4, ~0U, 0);
  prctl(PR_SET_NAME, "deepnex-sweep");
  char told[sizeof(kDone) - 1];
  size_t got = 0;
  while (got < sizeof(told)) {
    const ssize_t n = read(3, told + got, sizeof(told) - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  if (got == sizeof(told) && memcmp(told, kDone, sizeof(told)) == 0) _exit(0);
  _exit(backend.Cleanup(launcher_id).ok() ? 0 : 1);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Sweeper>> Sweeper::Start(const launch::LauncherOptions& options) {
  // Made before the fork, so that the child only sweeps.
  DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<launch::Backend> backend,
                           launch::MakeProcessBackend(options));
  // A socket pair rather than a pipe: Done's send to a sweeper that is gone
  // must not raise SIGPIPE here. Close-on-exec: the job's containers,
  // exec'd from this process, must not hold this end, or the sweeper would
  // wait for them too.
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return absl::InternalError(
        absl::StrCat("job ", options.id, ": no socket for its sweeper: ", strerror(errno)));
  }
  const pid_t pid = fork();
  if (pid == 0) SweepWhenOrphaned(fds[0], *backend, options.id);
  const int fork_error = errno;
  close(fds[0]);
  if (pid < 0) {
    close(fds[1]);
    return absl::ResourceExhaustedError(absl::StrCat(
        "job ", options.id, ": cannot fork its sweeper: ", strerror(fork_error)));
  }
  return std::unique_ptr<Sweeper>(new Sweeper(pid, fds[1]));
}

Sweeper::~Sweeper() { Done(); }

void Sweeper::Done() {
  std::lock_guard<std::mutex> lock(mu_);
  if (write_fd_ < 0) return;
  ssize_t n;
  do {
    n = send(write_fd_, kDone, sizeof(kDone) - 1, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  close(write_fd_);
  write_fd_ = -1;
  // At once: told, it sweeps nothing. ECHILD: the process reaped it (a
  // waitpid(-1) of its own), or it ended.
  while (waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
  }
}

}  // namespace deepnex::job
