// deepnex-ps: one parameter server of a job, as a daemon.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "deepnex/ps/server.h"
#include "deepnex/units.h"
#include "tools/daemon.h"

namespace {

constexpr char kUsage[] = R"(usage: deepnex-ps [flags]

Runs one parameter server of a deepnex job. Prints
"deepnex-ps listening on HOST:PORT" once it serves; stops on SIGINT/SIGTERM.

flags:
  --listen HOST:PORT      address to listen on; port 0 picks a free one
                          (default 127.0.0.1:0)
  --advertise HOST        the host peers dial, printed in "listening on"
                          (default: the --listen host; for 0.0.0.0 or [::],
                          this host's primary address)
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
  --lr X                  learning rate (default 0.01; adam and adamw 0.001)
  --momentum X            SGD momentum (default 0)
  --nesterov              SGD: Nesterov momentum
  --weight-decay X        weight decay (default 0)
  --beta1 X --beta2 X     Adam/AdamW moment decay (default 0.9, 0.999)
  --eps X                 Adam/AdamW/Adagrad epsilon (default 1e-8; adagrad 1e-10)
  --accept-nonfinite      apply gradients holding NaN/Inf instead of refusing them
  --max-message SIZE      largest request accepted, e.g. 256MiB (default 256MiB)
  --max-pull-reply SIZE   largest pull reply; a pull of more is refused
                          (default --max-message)
  --max-pending-replies SIZE  pull reply bytes one client connection may have
                          held on the server, waiting or unread (default 1GiB)
  --max-deferred-pushes SIZE  push bytes one worker may have the server keep
                          for later (out of order, or ssp rounds ahead)
                          (default 256MiB)
  --max-shm SIZE          largest shared-memory segment for a client on this
                          host, which then skips TCP; 0: TCP only (default 1GiB)
  --no-bulk-tcp           move every other client's pushes and pulls over gRPC,
                          not a plain TCP connection on a second port
  --token T               bearer token every call must carry (default
                          $DEEPNEX_TOKEN, which unlike a flag other users
                          cannot read in /proc)
  --token-file F          file with the token, or lines "TOKEN NAME ROLE [JOB]"
  --job ID                the job this server belongs to: tokens scoped to
                          other jobs are refused (default $DEEPNEX_JOB_ID, set
                          by deepnex's launchers; with neither, every
                          job-scoped token is refused)
  --tls-cert F --tls-key F   serve TLS with this PEM certificate and key
  --name NAME             this server's name; its checkpoint is DIR/NAME.ckpt
                          (default ps)
  --checkpoint-dir DIR    where periodic checkpoints go, and the only place a
                          client's checkpoint call may write (DIR/NAME; an
                          admin or the job's token; refused without it)
  --checkpoint-every N    checkpoint at the first round boundary after every N
                          rounds (async: N x workers pushes)
  --checkpoint-interval SECS  checkpoint every SECS seconds
  --restore-if-present    with --restore: start empty when DIR/NAME.ckpt is not
                          there yet (a server restarted by a policy)
  --restore DIR           start from DIR/NAME.ckpt (values, optimizer state,
                          rounds, push sequences)
  --metrics-port P        serve Prometheus text at http://HOST:P/metrics, HOST
                          that of --listen (0 picks a port); with tokens, to a
                          request with one ("Authorization: Bearer TOKEN")
  --help                  show this text
)";

}  // namespace

int main(int argc, char** argv) {
  using deepnex::ps::ServerOptions;
  ServerOptions options;
  bool lr_given = false, eps_given = false;
  int metrics_port = -1;
  bool restore_if_present = false;
  deepnex::tools::Flags flags("deepnex-ps", kUsage, argc, argv);
  // A cap of 0 would refuse everything: named as the flag, not the field.
  auto positive_bytes = [&flags] {
    const std::string flag = flags.flag();
    uint64_t v = flags.Bytes();
    if (v == 0) flags.Die(flag + ": 0 bytes would refuse everything (must be more than 0)");
    return v;
  };
  while (flags.Next()) {
    if (flags.Is("--listen")) options.address = flags.Value();
    else if (flags.Is("--advertise")) options.advertise = flags.Value();
    else if (flags.Is("--mode")) options.mode = flags.OrDie(deepnex::ps::ParseMode(flags.Value()));
    else if (flags.Is("--workers")) options.num_workers = flags.Int();
    else if (flags.Is("--reduction"))
      options.reduction = flags.OrDie(deepnex::ps::ParseReduction(flags.Value()));
    else if (flags.Is("--optimizer"))
      options.optimizer.kind = flags.OrDie(deepnex::ps::ParseOptimizerKind(flags.Value()));
    else if (flags.Is("--lr")) {
      options.optimizer.lr = flags.Number();
      lr_given = true;
    } else if (flags.Is("--momentum")) options.optimizer.momentum = flags.Number();
    else if (flags.Is("--nesterov")) options.optimizer.nesterov = true;
    else if (flags.Is("--weight-decay")) options.optimizer.weight_decay = flags.Number();
    else if (flags.Is("--beta1")) options.optimizer.beta1 = flags.Number();
    else if (flags.Is("--beta2")) options.optimizer.beta2 = flags.Number();
    else if (flags.Is("--eps")) {
      options.optimizer.eps = flags.Number();
      eps_given = true;
    } else if (flags.Is("--accept-nonfinite")) options.reject_nonfinite = false;
    else if (flags.Is("--max-message")) options.max_message_bytes = flags.Bytes();
    else if (flags.Is("--max-pull-reply")) options.max_pull_reply_bytes = flags.Bytes();
    else if (flags.Is("--max-pending-replies"))
      options.max_pending_reply_bytes = positive_bytes();
    else if (flags.Is("--max-deferred-pushes"))
      options.max_deferred_push_bytes = positive_bytes();
    else if (flags.Is("--max-shm")) options.max_shm_bytes = flags.Bytes();
    else if (flags.Is("--no-bulk-tcp")) options.bulk_tcp = false;
    else if (flags.Is("--token")) options.token = flags.Value();
    else if (flags.Is("--token-file")) options.token_file = flags.Value();
    else if (flags.Is("--job")) options.job_id = flags.Value();
    else if (flags.Is("--tls-cert")) options.tls_cert_file = flags.Value();
    else if (flags.Is("--tls-key")) options.tls_key_file = flags.Value();
    else if (flags.Is("--staleness")) options.staleness = flags.Int();
    else if (flags.Is("--lease-timeout")) options.lease_timeout = flags.Seconds();
    else if (flags.Is("--heartbeat-interval")) options.heartbeat_interval = flags.Seconds();
    else if (flags.Is("--lease-policy"))
      options.lease_policy = flags.OrDie(deepnex::ps::ParseLeasePolicy(flags.Value()));
    else if (flags.Is("--drop-dead-contributions")) options.keep_dead_contributions = false;
    else if (flags.Is("--name")) options.name = flags.Value();
    else if (flags.Is("--checkpoint-dir")) options.checkpoint_dir = flags.Value();
    else if (flags.Is("--checkpoint-every")) {
      int n = flags.Int();
      if (n < 0) flags.Die("--checkpoint-every: must be >= 0");
      options.checkpoint_every_rounds = n;
    } else if (flags.Is("--checkpoint-interval")) options.checkpoint_interval = flags.Seconds();
    else if (flags.Is("--restore")) options.restore_dir = flags.Value();
    else if (flags.Is("--restore-if-present")) restore_if_present = true;
    else if (flags.Is("--metrics-port")) {
      metrics_port = flags.Int();
      // -1 was taken as "no metrics", 70000 named no flag.
      if (metrics_port < 0 || metrics_port > 65535) {
        flags.Die("--metrics-port " + std::to_string(metrics_port) + ": not a port (0-65535)");
      }
    }
    else flags.Unknown();
  }
  deepnex::tools::TokenFromEnvironment(&options.token, options.token_file);
  // A server that a launcher started with the job environment belongs to
  // that job, so a job-scoped token of another job is refused there too.
  if (options.job_id.empty()) {
    const char* job = getenv("DEEPNEX_JOB_ID");
    if (job != nullptr) options.job_id = job;
  }
  if (!lr_given) options.optimizer.lr = deepnex::ps::DefaultLr(options.optimizer.kind);
  if (options.optimizer.kind == deepnex::ps::OptimizerKind::kAdagrad && !eps_given) {
    options.optimizer.eps = 1e-10;
  }
  if (restore_if_present && !options.restore_dir.empty() &&
      access((options.restore_dir + "/" + options.name + ".ckpt").c_str(), F_OK) != 0) {
    options.restore_dir.clear();
  }
  const std::string host = options.address.substr(0, options.address.rfind(':'));
  if (metrics_port >= 0) options.metrics_address = host + ":" + std::to_string(metrics_port);
  if (absl::Status s = options.Validate(); !s.ok()) flags.Die(std::string(s.message()));

  deepnex::tools::SignalStop signals;
  auto server = deepnex::ps::Server::Create(options);
  if (!server.ok()) {
    std::cerr << "deepnex-ps: " << server.status().message() << "\n";
    return 1;
  }
  std::printf("deepnex-ps listening on %s (mode %s, %d worker%s, %s)\n",
              (*server)->address().c_str(), deepnex::ps::ModeName(options.mode),
              options.num_workers, options.num_workers == 1 ? "" : "s",
              options.optimizer.ToString().c_str());
  if ((*server)->metrics_port() > 0) {
    std::printf("deepnex-ps metrics on http://%s:%d/metrics\n", host.c_str(),
                (*server)->metrics_port());
  }
  std::fflush(stdout);
  signals.Serve(**server);
  return 0;
}
