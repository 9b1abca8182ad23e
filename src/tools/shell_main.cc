// deepnex-shell: `deepnex shell` without starting Python's deepnex (its
// compiled module, the CLI's modules): the `deepnex shell` command parses
// its flags and execs this with them, so that the time to a prompt is a
// C++ client's (issue #16's session_bench). Behaves as deepnex/_cli_session.py's
// _shell: allocates unless --alloc, starts a container that waits, runs a
// login shell in it on a pseudo-terminal attached to this terminal (raw
// mode, the window's size and its changes), exits with the shell's code,
// then stops the container and releases the allocation it made (--keep:
// neither). Unlike the Python client, SIGHUP (the terminal gone), SIGTERM
// or SIGINT while attached end the session with 128 + N and still clean up.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "deepnex/gpu/central.h"
#include "deepnex/launch/central.h"
#include "deepnex/launch/session.h"
#include "deepnex/units.h"

namespace {

namespace gpu = ::deepnex::gpu;
namespace launch = ::deepnex::launch;

constexpr char kUsage[] = R"(usage: deepnex-shell [flags]

`deepnex shell` in C++ (deepnex shell execs it).

flags:
  --central HOST:PORT     deepnex-central ($DEEPNEX_CENTRAL)
  --token T               bearer token ($DEEPNEX_TOKEN)
  --token-file F          file holding the bearer token
  --tls-ca-file F         PEM CA certificate to verify deepnex-central's TLS
  --call-timeout S        seconds per call (default 30)
  --alloc ID              an allocation of yours to run on (default: allocate one)
  --gpus N                GPUs to allocate (default 0)
  --gpu-mode M            exclusive (default) or shared
  --gpu-memory X          per GPU in shared mode, e.g. 8GiB
  --cpus C                CPU cores to allocate (default 1)
  --memory M              host memory to allocate (default 1GiB)
  --image NAME            a name from deepnex-central's images (default host)
  --name NAME             the container's name (default: shell-<random>)
  --keep                  leave the container running and the allocation held
)";

// A shell the container has: bash where there is one. A login shell, and
// interactive where its input is a terminal (as sh decides without -i), so
// that on pipes it runs what comes and ends at their EOF, as ssh's does.
const std::vector<std::string> kShell = {
    "/bin/sh", "-c", "command -v bash >/dev/null && exec bash -l || exec sh -l"};

constexpr size_t kChunk = 32 << 10;

// The write end of the pipe the signal handler wakes the input thread with:
// one byte per signal, its number.
int signal_fd = -1;

void OnSignal(int sig) {
  const int saved_errno = errno;  // the interrupted thread may be about to read it
  char c = static_cast<char>(sig);
  [[maybe_unused]] ssize_t n = write(signal_fd, &c, 1);
  errno = saved_errno;
}

// The signals Attach takes: the window's new size; and the end of the
// terminal or a request to stop, which end the session, so that the
// container still stops and the allocation is released.
constexpr int kSignals[] = {SIGWINCH, SIGHUP, SIGTERM, SIGINT};

// The signal that asked to stop before Attach took the signals (0: none):
// it ends the start, which then cleans up. Their default action had killed
// the client there, leaving the container and the allocation, or, while
// the grant was on its way, the allocation (probes).
volatile sig_atomic_t early_stop = 0;

void OnEarlySignal(int sig) { early_stop = sig; }

// Where a stop came early: Cancelled, naming the signal (main exits 128 + it).
absl::Status StoppedEarly() {
  if (early_stop == 0) return absl::OkStatus();
  return absl::CancelledError(absl::StrCat("stopped by signal ", early_stop, " while starting"));
}

// rows, cols of the terminal on `fd`; 0, 0 when it is none.
std::pair<int, int> Window(int fd) {
  winsize w{};
  if (ioctl(fd, TIOCGWINSZ, &w) != 0) return {0, 0};
  return {w.ws_row, w.ws_col};
}

bool WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// Forwards stdin to `session` until EOF (then closes its stdin), and the
// window's new size on each SIGWINCH, until `stop_fd` is readable. Another
// signal cancels the session and is stored in `*stopped_by`.
void ForwardInput(launch::Session* session, bool terminal, int signal_read, int stop_fd,
                  std::atomic<int>* stopped_by) {
  bool input_open = true;
  std::vector<char> buf(kChunk);
  while (true) {
    pollfd fds[3] = {{stop_fd, POLLIN, 0}, {signal_read, POLLIN, 0}, {0, POLLIN, 0}};
    int n = poll(fds, input_open ? 3 : 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 || fds[0].revents) return;
    if (fds[1].revents) {
      char sigs[64];
      ssize_t got = read(signal_read, sigs, sizeof(sigs));
      for (ssize_t i = 0; i < got; ++i) {
        if (sigs[i] != SIGWINCH) {
          stopped_by->store(sigs[i]);
          session->Cancel();
          return;
        }
      }
      auto [rows, cols] = Window(0);
      if (terminal) session->Resize(rows, cols).IgnoreError();  // it may have ended meanwhile
    }
    if (input_open && fds[2].revents) {
      ssize_t r = read(0, buf.data(), buf.size());
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        session->CloseStdin().IgnoreError();
        input_open = false;
        continue;
      }
      // A failed write: the session ended, nobody reads the rest.
      if (!session->Write(std::string(buf.data(), static_cast<size_t>(r))).ok()) return;
    }
  }
}

// Runs kShell in container `name` on this process's terminal; its exit code
// (128 + N when signal N ended it here).
absl::StatusOr<int> Attach(launch::CentralClient& client, const std::string& name) {
  const bool terminal = isatty(0);
  launch::SessionOptions o;
  o.container = name;
  o.command = kShell;
  // On a pseudo-terminal only when this is one, as ssh and kubectl do: a
  // pty's EOF is a ^D that a shell which has not set up its terminal yet
  // loses, and `deepnex shell < /dev/null` or `echo ls | deepnex shell`
  // then hung forever (probe). Pipes carry the EOF.
  o.tty = terminal;
  if (terminal) std::tie(o.rows, o.cols) = Window(0);
  DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<launch::Session> session, client.OpenSession(o));
  int signals[2], stop[2];
  if (pipe2(signals, O_CLOEXEC | O_NONBLOCK) != 0 || pipe2(stop, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
  }
  std::optional<termios> saved;
  if (terminal) {
    termios t{};
    if (tcgetattr(0, &t) == 0) {
      saved = t;
      cfmakeraw(&t);
      // TCSADRAIN, not TCSAFLUSH: that discarded what was typed while the
      // shell started (the allocation, the container); it goes to the shell.
      tcsetattr(0, TCSADRAIN, &t);
    }
  }
  signal_fd = signals[1];
  struct sigaction old[std::size(kSignals)];
  for (size_t i = 0; i < std::size(kSignals); ++i) {
    struct sigaction sa {};
    sa.sa_handler = OnSignal;
    sa.sa_flags = SA_RESTART;
    sigaction(kSignals[i], &sa, &old[i]);
  }
  if (early_stop != 0) OnSignal(early_stop);  // came while the session opened
  std::atomic<int> stopped_by{0};
  std::thread input(ForwardInput, session.get(), terminal, signals[0], stop[0], &stopped_by);
  absl::StatusOr<int> code = absl::UnknownError("no exit");
  while (true) {
    absl::StatusOr<launch::SessionEvent> e = session->Read();
    if (!e.ok()) {
      code = e.status();
      break;
    }
    if (e->kind == launch::SessionEvent::Kind::kExit) {
      code = e->exit_code;
      break;
    }
    WriteAll(e->kind == launch::SessionEvent::Kind::kStdout ? 1 : 2, e->data);
  }
  char c = 'x';
  [[maybe_unused]] ssize_t n = write(stop[1], &c, 1);
  input.join();
  for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &old[i], nullptr);
  if (saved) tcsetattr(0, TCSADRAIN, &*saved);
  for (int fd : {signals[0], signals[1], stop[0], stop[1]}) close(fd);
  if (stopped_by.load() != 0) return 128 + stopped_by.load();
  return code;
}

// Waits until container `name` runs; an error naming how it ended.
absl::Status WaitRunning(launch::CentralClient& client, const std::string& name) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (true) {
    DEEPNEX_ASSIGN_OR_RETURN(std::vector<launch::CentralContainer> all, client.ListContainers());
    std::string state = "gone", last_exit;
    for (const launch::CentralContainer& c : all) {
      if (c.name != name) continue;
      state = launch::StateName(c.state);
      last_exit = c.last_exit;
    }
    if (state == "running") return absl::OkStatus();
    DEEPNEX_RETURN_IF_ERROR(StoppedEarly());
    if (state == "stopped" || state == "exited" || state == "gone" ||
        std::chrono::steady_clock::now() > deadline) {
      std::string what = absl::StrCat("container ", name, " did not start: ", state);
      if (!last_exit.empty()) absl::StrAppend(&what, " ", last_exit);
      return absl::UnknownError(what);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string RandomName() {
  std::random_device rd;
  char hex[7];
  std::snprintf(hex, sizeof(hex), "%06x", rd() & 0xffffffu);
  return absl::StrCat("shell-", hex);
}

// What `deepnex shell`'s flags say (defaults as _cli_session's).
struct ShellFlags {
  gpu::CentralClientOptions options;
  std::optional<std::string> token;
  std::string alloc, image = "host", name;
  bool keep = false;
  gpu::Request request = [] {
    gpu::Request r;
    r.cpus = 1;
    return r;
  }();
  std::string gpu_memory = "0", memory = "1GiB";
};

// Reads argv as argparse reads flags spelled out in full ("--flag value",
// "--flag=value", a bare --keep) into `f`: "" when all of it was that,
// else why not ("--help" for -h or --help). argparse takes more (an
// abbreviation) and words its errors its own way: see ParseInPython.
std::string Parse(int argc, char** argv, ShellFlags* f) {
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i], value;
    if (flag == "-h" || flag == "--help") return "--help";
    const size_t eq = flag.find('=');
    const bool inline_value = flag.rfind("--", 0) == 0 && eq != std::string::npos;
    if (inline_value) {
      value = flag.substr(eq + 1);
      flag.resize(eq);
    }
    if (flag == "--keep") {
      if (inline_value) return "--keep takes no value";
      f->keep = true;
      continue;
    }
    if (!inline_value) {
      // argparse takes a word starting with "-" for a flag, not a value.
      if (i + 1 >= argc || argv[i + 1][0] == '-') return flag + " needs a value";
      value = argv[++i];
    }
    if (flag == "--central") {
      f->options.address = value;
    } else if (flag == "--token") {
      f->token = value;
    } else if (flag == "--token-file") {
      f->options.token_file = value;
    } else if (flag == "--tls-ca-file") {
      f->options.tls_ca_file = value;
    } else if (flag == "--call-timeout") {
      double seconds = 0;
      if (!absl::SimpleAtod(value, &seconds)) {
        return absl::StrCat("--call-timeout: \"", value, "\" is not positive seconds");
      }
      absl::StatusOr<std::chrono::milliseconds> timeout = deepnex::SecondsToMillis(seconds, flag);
      if (!timeout.ok()) return std::string(timeout.status().message());
      f->options.timeout = *timeout;
    } else if (flag == "--alloc") {
      f->alloc = value;
    } else if (flag == "--gpus" || flag == "--cpus") {
      int n = 0;
      if (!absl::SimpleAtoi(value, &n)) {
        // Digits too many for an int are no typo: say so.
        const size_t sign = absl::StartsWith(value, "-") ? 1 : 0;
        const bool digits = value.size() > sign &&
                            value.find_first_not_of("0123456789", sign) == std::string::npos;
        return digits ? absl::StrCat(flag, ": ", value, " is out of range")
                      : absl::StrCat(flag, ": \"", value, "\" is not an integer");
      }
      (flag == "--gpus" ? f->request.gpus : f->request.cpus) = n;
    } else if (flag == "--gpu-mode") {
      absl::StatusOr<gpu::Mode> mode = gpu::ParseMode(value, "--gpu-mode");
      if (!mode.ok()) return std::string(mode.status().message());
      f->request.mode = *mode;
    } else if (flag == "--gpu-memory") {
      f->gpu_memory = value;
    } else if (flag == "--memory") {
      f->memory = value;
    } else if (flag == "--image") {
      f->image = value;
    } else if (flag == "--name") {
      f->name = value;
    } else {
      return absl::StrCat("unknown flag \"", flag, "\"");
    }
  }
  return "";
}

// `deepnex shell` execs this before its argparse has read the flags (so
// that Python loads little), with $DEEPNEX_SHELL_PYTHON its interpreter.
// Where Parse did not take them, this runs `python -m deepnex shell` again
// with DEEPNEX_NATIVE_SHELL=late: argparse then reads them (help, an
// abbreviation, its own error) and execs this with them spelled out.
// Returns where there is no $DEEPNEX_SHELL_PYTHON, or it cannot run.
void ParseInPython(int argc, char** argv) {
  const char* python = std::getenv("DEEPNEX_SHELL_PYTHON");
  if (python == nullptr || *python == '\0') return;
  std::vector<std::string> args = {python, "-m", "deepnex", "shell"};
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  std::vector<char*> pointers;
  for (std::string& a : args) pointers.push_back(a.data());
  pointers.push_back(nullptr);
  unsetenv("DEEPNEX_SHELL_PYTHON");
  setenv("DEEPNEX_NATIVE_SHELL", "late", 1);
  execv(pointers[0], pointers.data());
}

int Fail(const absl::Status& s) {
  std::cerr << "deepnex: " << s.message() << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  ShellFlags f;
  std::string why = Parse(argc, argv, &f);
  if (!why.empty()) {
    ParseInPython(argc, argv);  // returns where `deepnex shell` did not start us
    if (why == "--help") {
      std::cout << kUsage;
      return 0;
    }
    std::cerr << "deepnex shell: " << why << " (see --help)\n";
    return 2;
  }
  // As deepnex's other commands (_cli_common): --central, else
  // $DEEPNEX_CENTRAL; --token, else $DEEPNEX_TOKEN unless --token-file.
  if (f.options.address.empty() && std::getenv("DEEPNEX_CENTRAL")) {
    f.options.address = std::getenv("DEEPNEX_CENTRAL");
  }
  if (f.options.address.empty()) {
    std::cerr << "deepnex: no central address (--central or $DEEPNEX_CENTRAL)\n";
    return 1;
  }
  if (f.token && !f.token->empty()) {
    f.options.token = *f.token;
  } else if (f.options.token_file.empty() && std::getenv("DEEPNEX_TOKEN")) {
    f.options.token = std::getenv("DEEPNEX_TOKEN");
  }
  if (f.name.empty()) f.name = RandomName();
  // Sizes are checked as the Python client does (deepnex.gpu), naming the field.
  absl::StatusOr<uint64_t> bytes = deepnex::ParseByteSize(f.gpu_memory, "gpu_memory");
  if (!bytes.ok()) return Fail(bytes.status());
  f.request.gpu_memory = *bytes;
  bytes = deepnex::ParseByteSize(f.memory, "memory");
  if (!bytes.ok()) return Fail(bytes.status());
  f.request.memory = *bytes;

  absl::StatusOr<std::unique_ptr<gpu::CentralClient>> allocator =
      gpu::CentralClient::Create(f.options);
  if (!allocator.ok()) return Fail(allocator.status());
  absl::StatusOr<std::unique_ptr<launch::CentralClient>> client =
      launch::CentralClient::Create(f.options);
  if (!client.ok()) return Fail(client.status());
  for (int sig : {SIGHUP, SIGTERM, SIGINT}) {
    struct sigaction sa {};
    sa.sa_handler = OnEarlySignal;
    sa.sa_flags = SA_RESTART;
    sigaction(sig, &sa, nullptr);
  }
  std::string made;  // the allocation made here, released at the end
  if (f.alloc.empty()) {
    // A stop while the request waits in the queue withdraws it (central
    // drops a queued request whose call is cancelled). Not at once: a grant
    // already on its way would be lost with the call, and held for good (a
    // re-probe's); one that comes within the grace is released below.
    auto granted = std::make_shared<std::promise<absl::StatusOr<std::vector<gpu::Allocation>>>>();
    std::future<absl::StatusOr<std::vector<gpu::Allocation>>> grant = granted->get_future();
    const uint64_t ticket = (*allocator)->AllocateGangAsync(
        f.request, gpu::AllocateOptions{},
        [granted](absl::StatusOr<std::vector<gpu::Allocation>> parts) {
          granted->set_value(std::move(parts));
        });
    constexpr auto kGrace = std::chrono::seconds(2);
    std::optional<std::chrono::steady_clock::time_point> stop_seen;
    bool withdrawn = false;
    while (grant.wait_for(std::chrono::milliseconds(20)) != std::future_status::ready) {
      if (early_stop == 0 || withdrawn) continue;
      const auto now = std::chrono::steady_clock::now();
      if (!stop_seen) stop_seen = now;
      if (now - *stop_seen >= kGrace) {
        (*allocator)->Withdraw(ticket);
        withdrawn = true;
      }
    }
    absl::StatusOr<std::vector<gpu::Allocation>> a = grant.get();
    if (!a.ok()) return early_stop != 0 ? 128 + early_stop : Fail(a.status());
    f.alloc = made = a->front().id;
  }

  bool started = false;
  absl::StatusOr<int> code = [&]() -> absl::StatusOr<int> {
    launch::ContainerSpec spec;
    spec.name = f.name;
    spec.image = f.image;
    spec.command = {"sleep", "infinity"};
    DEEPNEX_RETURN_IF_ERROR(StoppedEarly());
    DEEPNEX_ASSIGN_OR_RETURN(launch::CentralContainer c, (*client)->StartContainer(spec, f.alloc));
    started = true;
    // The process backend's runs already: no call more.
    if (c.state != launch::State::kRunning) DEEPNEX_RETURN_IF_ERROR(WaitRunning(**client, f.name));
    DEEPNEX_RETURN_IF_ERROR(StoppedEarly());
    return Attach(**client, f.name);
  }();
  if (early_stop != 0 && absl::IsCancelled(code.status())) {
    code = 128 + early_stop;  // said by the signal, as after Attach
  } else if (!code.ok()) {
    Fail(code.status());
  }

  if (f.keep) {
    std::cerr << "deepnex: kept container " << f.name << " on allocation " << f.alloc
              << " (deepnex exec " << f.name << " -it -- bash; deepnex stop " << f.name << ")\n";
  } else {
    absl::Status s = absl::OkStatus();
    if (started) s = (*client)->StopContainer(f.name, std::chrono::seconds(1)).status();
    if (s.ok() && !made.empty()) s = (*allocator)->Release(made);
    // NotFound: released with its last container.
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound) {
      std::cerr << "deepnex: cleaning up after " << f.name << ": " << s.message() << "\n";
    }
  }
  return code.ok() ? *code : 1;
}
