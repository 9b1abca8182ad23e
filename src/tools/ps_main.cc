// deepnex-ps: one parameter server of a job, as a daemon.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <thread>

#include "deepnex/ps/server.h"
#include "deepnex/units.h"

namespace {

constexpr char kUsage[] = R"(usage: deepnex-ps [flags]

Runs one parameter server of a deepnex job. Prints
"deepnex-ps listening on HOST:PORT" once it serves; stops on SIGINT/SIGTERM.

flags:
  --listen HOST:PORT      address to listen on; port 0 picks a free one
                          (default 127.0.0.1:0)
  --mode sync|ssp|async   sync: a round completes when every live worker pushed;
                          ssp: as sync, a worker may run --staleness rounds
                          ahead of the slowest; async: each push is applied at
                          once (default sync)
  --staleness S           ssp: rounds a worker may run ahead (default 0)
  --workers N             workers of the job, ids 0..N-1 (default 1)
  --lease-timeout SECS    a worker without a heartbeat this long is dead
                          (default 10)
  --heartbeat-interval SECS  how often clients renew their lease (default a
                          quarter of the lease timeout)
  --lease-policy shrink|abort
                          a dead worker's rounds complete without it (shrink)
                          or fail with Aborted naming it (abort) (default shrink)
  --drop-dead-contributions
                          shrink: drop what a dead worker pushed into open
                          rounds (default: keep it)
  --reduction mean|sum    sync: how a round combines gradients (default mean)
  --optimizer NAME        sgd, adam, adamw, adagrad, sum or assign (default sgd)
  --lr X                  learning rate (default 0.01)
  --momentum X            SGD momentum (default 0)
  --nesterov              SGD: Nesterov momentum
  --weight-decay X        weight decay (default 0)
  --beta1 X --beta2 X     Adam/AdamW moment decay (default 0.9, 0.999)
  --eps X                 Adam/AdamW/Adagrad epsilon (default 1e-8; adagrad 1e-10)
  --accept-nonfinite      apply gradients holding NaN/Inf instead of refusing them
  --max-message SIZE      largest request accepted, e.g. 256MiB (default 256MiB)
  --token T               bearer token every call must carry
  --token-file F          file with the token, or lines "TOKEN NAME ROLE [JOB]"
  --job ID                job id; tokens scoped to other jobs are refused
  --tls-cert F --tls-key F   serve TLS with this PEM certificate and key
  --name NAME             this server's name; its checkpoint is DIR/NAME.ckpt
                          (default ps)
  --checkpoint-dir DIR    where periodic checkpoints go
  --checkpoint-every N    checkpoint at the first round boundary after every N
                          rounds (async: N x workers pushes)
  --checkpoint-interval SECS  checkpoint every SECS seconds
  --restore DIR           start from DIR/NAME.ckpt (values, optimizer state,
                          rounds, push sequences)
  --metrics-port P        serve Prometheus text at http://HOST:P/metrics, HOST
                          that of --listen (0 picks a port)
  --help                  show this text
)";

[[noreturn]] void Die(const std::string& message) {
  std::cerr << "deepnex-ps: " << message << " (see --help)\n";
  std::exit(2);
}

double ParseNumber(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0') {
    Die(flag + ": \"" + text + "\" is not a number");
  }
  return v;
}

int ParseInt(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < INT32_MIN || v > INT32_MAX) {
    Die(flag + ": \"" + text + "\" is not an integer");
  }
  return static_cast<int>(v);
}

std::chrono::milliseconds Millis(const std::string& flag, const std::string& text) {
  double seconds = ParseNumber(flag, text);
  if (!(seconds > 0)) Die(flag + ": \"" + text + "\" must be positive seconds");
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

template <typename T>
T OrDie(absl::StatusOr<T> v) {
  if (!v.ok()) Die(std::string(v.status().message()));
  return *std::move(v);
}

}  // namespace

int main(int argc, char** argv) {
  using deepnex::ps::ServerOptions;
  ServerOptions options;
  bool eps_given = false;
  int metrics_port = -1;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      return 0;
    }
    std::string value;
    auto eq = flag.find('=');
    if (flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    }
    auto next = [&]() -> std::string {
      if (!value.empty()) return value;
      if (i + 1 >= argc) Die(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--listen") options.address = next();
    else if (flag == "--mode") options.mode = OrDie(deepnex::ps::ParseMode(next()));
    else if (flag == "--workers") options.num_workers = ParseInt(flag, next());
    else if (flag == "--reduction")
      options.reduction = OrDie(deepnex::ps::ParseReduction(next()));
    else if (flag == "--optimizer")
      options.optimizer.kind = OrDie(deepnex::ps::ParseOptimizerKind(next()));
    else if (flag == "--lr") options.optimizer.lr = ParseNumber(flag, next());
    else if (flag == "--momentum") options.optimizer.momentum = ParseNumber(flag, next());
    else if (flag == "--nesterov") options.optimizer.nesterov = true;
    else if (flag == "--weight-decay")
      options.optimizer.weight_decay = ParseNumber(flag, next());
    else if (flag == "--beta1") options.optimizer.beta1 = ParseNumber(flag, next());
    else if (flag == "--beta2") options.optimizer.beta2 = ParseNumber(flag, next());
    else if (flag == "--eps") {
      options.optimizer.eps = ParseNumber(flag, next());
      eps_given = true;
    } else if (flag == "--accept-nonfinite") options.reject_nonfinite = false;
    else if (flag == "--max-message")
      options.max_message_bytes = OrDie(deepnex::ParseByteSize(next(), "--max-message"));
    else if (flag == "--token") options.token = next();
    else if (flag == "--token-file") options.token_file = next();
    else if (flag == "--job") options.job_id = next();
    else if (flag == "--tls-cert") options.tls_cert_file = next();
    else if (flag == "--tls-key") options.tls_key_file = next();
    else if (flag == "--staleness") options.staleness = ParseInt(flag, next());
    else if (flag == "--lease-timeout") options.lease_timeout = Millis(flag, next());
    else if (flag == "--heartbeat-interval") options.heartbeat_interval = Millis(flag, next());
    else if (flag == "--lease-policy")
      options.lease_policy = OrDie(deepnex::ps::ParseLeasePolicy(next()));
    else if (flag == "--drop-dead-contributions") options.keep_dead_contributions = false;
    else if (flag == "--name") options.name = next();
    else if (flag == "--checkpoint-dir") options.checkpoint_dir = next();
    else if (flag == "--checkpoint-every") {
      int n = ParseInt(flag, next());
      if (n < 0) Die("--checkpoint-every: must be >= 0");
      options.checkpoint_every_rounds = n;
    } else if (flag == "--checkpoint-interval") options.checkpoint_interval = Millis(flag, next());
    else if (flag == "--restore") options.restore_dir = next();
    else if (flag == "--metrics-port") metrics_port = ParseInt(flag, next());
    else Die("unknown flag \"" + flag + "\"");
  }
  if (options.optimizer.kind == deepnex::ps::OptimizerKind::kAdagrad && !eps_given) {
    options.optimizer.eps = 1e-10;
  }
  if (metrics_port >= 0) {
    options.metrics_address =
        options.address.substr(0, options.address.rfind(':')) + ":" + std::to_string(metrics_port);
  }
  if (absl::Status s = options.Validate(); !s.ok()) Die(std::string(s.message()));

  // Signals are taken by a thread of ours, so the gRPC threads never see them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto server = deepnex::ps::Server::Create(options);
  if (!server.ok()) {
    std::cerr << "deepnex-ps: " << server.status().message() << "\n";
    return 1;
  }
  std::printf("deepnex-ps listening on %s (mode %s, %d workers, %s)\n",
              (*server)->address().c_str(), deepnex::ps::ModeName(options.mode),
              options.num_workers, options.optimizer.ToString().c_str());
  if ((*server)->metrics_port() > 0) {
    std::printf("deepnex-ps metrics on http://%s:%d/metrics\n",
                options.address.substr(0, options.address.rfind(':')).c_str(),
                (*server)->metrics_port());
  }
  std::fflush(stdout);
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    (*server)->Stop();
  });
  (*server)->Wait();
  waiter.join();
  return 0;
}
