// deepnex::launch sessions: a process started in a running container (exec,
// a shell), or a TCP connection to a port in it (port-forward), with its
// bytes streamed between the container and a user's client.
//
//   // On the container's machine (what deepnex-central and deepnex-agent do):
//   DEEPNEX_ASSIGN_OR_RETURN(auto p, handle->Exec({.command = {"ls", "/"}}));
//   // Through deepnex-central, as its user:
//   DEEPNEX_ASSIGN_OR_RETURN(auto s, client->OpenSession({.container = "w0",
//                                                         .command = {"bash"}, .tty = true}));
#ifndef DEEPNEX_LAUNCH_SESSION_H_
#define DEEPNEX_LAUNCH_SESSION_H_

#include <sys/types.h>

#include <mutex>
#include <string>
#include <vector>

#include "deepnex/status.h"

namespace deepnex::launch {

// What Handle::Exec runs.
struct ExecOptions {
  // argv; command[0] is looked up on the container's PATH.
  std::vector<std::string> command;
  // On a new pseudo-terminal (its controlling terminal; stdout and stderr
  // both come from it); otherwise on pipes.
  bool tty = false;
  // The terminal's first size; 0: the kernel's default.
  int rows = 0;
  int cols = 0;
};

// A process Handle::Exec started: its ends of the process's stdin, stdout
// and stderr, and its exit. One thread may write while others read; Wait
// from one thread. Destroying it kills the process if it still runs.
class ExecProcess {
 public:
  // `input`/`output`: the pty's master (the same fd) with a tty, else pipes;
  // `error`: -1 with a tty.
  ExecProcess(pid_t pid, int input, int output, int error, bool tty);
  ~ExecProcess();
  ExecProcess(const ExecProcess&) = delete;
  ExecProcess& operator=(const ExecProcess&) = delete;

  bool tty() const { return tty_; }
  int output_fd() const { return output_; }
  int error_fd() const { return error_; }
  // All of `data` to its stdin.
  absl::Status WriteInput(const std::string& data);
  // EOF on its stdin: the pipe closes; on a tty, the EOF character (^D).
  void CloseInput();
  // The terminal's new size (the process gets SIGWINCH); a no-op without tty.
  absl::Status Resize(int rows, int cols);
  // SIGKILL to the process and its process group, unless Wait reaped it.
  void Kill();
  // Waits for its end: its exit code, or 128 + N for signal N.
  absl::StatusOr<int> Wait();

 private:
  const pid_t pid_;
  int input_;
  const int output_;
  const int error_;
  const bool tty_;
  std::mutex mu_;
  bool reaped_ = false;  // guarded by mu_: its pid may be reused after
};

// What a client opens through deepnex-central (CentralClient::OpenSession).
struct SessionOptions {
  std::string container;  // as its user named it
  std::string user;       // admins: whose container ("": the caller's)
  // exec: argv, on a tty of rows x cols when `tty`.
  std::vector<std::string> command;
  bool tty = false;
  int rows = 0;
  int cols = 0;
  // port-forward (no command): a TCP port on the container's loopback.
  int port = 0;
};

// One piece of a session's output, or its end.
struct SessionEvent {
  enum class Kind { kStdout, kStderr, kExit };
  Kind kind = Kind::kStdout;
  std::string data;   // kStdout, kStderr
  int exit_code = 0;  // kExit: 128 + N for signal N
};

// The client's end of a session. Thread-safe: one thread reads while
// others write.
class Session {
 public:
  virtual ~Session() = default;
  virtual absl::Status Write(const std::string& data) = 0;
  virtual absl::Status CloseStdin() = 0;
  virtual absl::Status Resize(int rows, int cols) = 0;
  // The next piece of output; kExit is the last. After it, or when the
  // session failed, the session's status (NotFound for a container that is
  // not the caller's, Unavailable when its node's agent is gone).
  virtual absl::StatusOr<SessionEvent> Read() = 0;
  // Ends the session: the process is killed, the connection closed.
  virtual void Cancel() = 0;
};

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_SESSION_H_
