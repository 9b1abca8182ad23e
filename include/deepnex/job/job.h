// deepnex::job: one call from allocation to a trained model. A Job allocates
// GPUs, CPU and memory for its workers (a local allocator over this machine,
// or deepnex-central), serves the job's rendezvous store, starts its
// parameter servers and workers through a launch backend with the job
// environment of ARCHITECTURE.md, streams their output with rank prefixes,
// supervises them under a restart policy, and releases everything at the end.
//
//   JobOptions o;
//   o.command = {"python3", "train.py"};
//   o.workers = 2; o.mode = "sync";
//   DEEPNEX_ASSIGN_OR_RETURN(JobResult r, RunJob(o));   // r.exit_code
#ifndef DEEPNEX_JOB_JOB_H_
#define DEEPNEX_JOB_JOB_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "deepnex/gpu/types.h"
#include "deepnex/launch/launcher.h"
#include "deepnex/status.h"

namespace deepnex::job {

struct JobOptions {
  // The job id (DEEPNEX_JOB_ID), [a-z0-9][a-z0-9-]*; empty: "job-<random>".
  std::string name;
  // Each worker's argv.
  std::vector<std::string> command;
  // Workers; with min_workers, the most the job grows to.
  int workers = 1;
  // An elastic job (`deepnex run --workers MIN:MAX`) when 1 <= min_workers <
  // workers: it starts once min_workers are granted, asks for the rest at
  // priority -1 (so that growth never holds up anyone's normal work) and
  // grows as they are granted; a worker that fails or is lost (with central:
  // a container reported lost, or its node NotReady for 10 s) is dropped
  // while min_workers remain, and capacity is asked for again. Each
  // membership is published to the job's store (elastic/members/<G>, then
  // elastic/generation) for the training side, and each resize is an event.
  // The restart policy applies below min_workers: a replacement (a new
  // worker id) instead of a restart in place. 0 or == workers: not elastic.
  int min_workers = 0;
  // Nodes the workers are spread over, as evenly as possible (as srun -N):
  // with W workers on N nodes, the first W % N nodes get one more. The
  // parameter servers go to the same nodes, server i to node i % N. 0: the
  // allocator packs the workers where they fit. More than 1 needs a launch
  // backend that places on other nodes (slurm).
  int nodes = 0;
  // The host (a name or an address) on which the job's processes reach
  // this process's rendezvous store and, for workers on other nodes, the
  // address MASTER_ADDR names. Empty: 127.0.0.1 when every process of the
  // job runs on this host; else this host's primary address (the source of
  // the route to deepnex-central, else the first non-loopback address).
  std::string advertise_address;
  // Parameter servers; -1: one for the PS modes, none for allreduce.
  int ps = -1;
  // "sync", "ssp:S" (S >= 0 rounds of staleness), "async" or "allreduce".
  std::string mode = "sync";
  // Per worker: GPUs (0: CPU only), their mode, and the GPU memory each
  // needs (shared mode only).
  int gpus_per_worker = 0;
  gpu::Mode gpu_mode = gpu::Mode::kExclusive;
  uint64_t gpu_memory = 0;
  // Per worker (and per parameter server): CPU cores (0: unlimited) and host
  // memory (0: with a local allocator an equal share of the machine's; with
  // deepnex-central, none, which starts no worker: give it there).
  double cpus = 1;
  uint64_t memory = 0;
  // The user the allocations are for. Empty: with `central`, the token's
  // user (deepnex-central decides; a user that is not the token's is
  // PermissionDenied there, naming both); else $USER, else "root".
  std::string user;
  // host:port of deepnex-central and its token, or a file holding it; empty
  // central: a local allocator over this machine (its discovered GPUs, cores
  // and memory).
  std::string central;
  std::string central_token;
  std::string central_token_file;
  // With `central`: URLs that central POSTs the job's events to (queued,
  // started, worker restarted, completed, failed, cancelled), besides its
  // user's defaults there.
  std::vector<std::string> notify;
  // With `central`: a job.progress event with rank 0's last
  // deepnex.report() every so often (0: never), and once when `notify_when`
  // ("accuracy>=0.9": METRIC >=, <=, >, < or == NUMBER) first holds.
  std::chrono::milliseconds notify_every{0};
  std::string notify_when;
  // Which backend starts the containers, and its options.
  launch::LauncherOptions launcher;
  // Applied to workers and parameter servers alike.
  launch::RestartPolicy restart;
  // Parameter servers checkpoint here after every round and restore from it
  // when they restart. Empty: no checkpoints.
  std::string checkpoint_dir;
  // The parameter servers' optimizer: sgd, adam, adamw or adagrad, and its
  // learning rate. Default: the optimizer's (ps::DefaultLr)
  std::string optimizer = "sgd";
  std::optional<double> lr;
  // SGD momentum (0: none).
  double momentum = 0;
  // The deepnex-ps program; empty: $DEEPNEX_PS_BIN, then the PATH.
  std::string ps_binary;
  // Where running jobs register for `deepnex top`: <registry_dir>/<name>/
  // holds job.json and, unless launcher.state_dir is set, the launcher's
  // state; removed when the job ends. Empty: $DEEPNEX_RUN_DIR, else
  // /tmp/deepnex-<uid>/jobs.
  std::string registry_dir;
  // The image the workers run in, as ContainerSpec::image takes it: "host"
  // (this host's files), a rootfs or OCI layout directory (oci), an image
  // reference (docker, kubernetes), or with deepnex-central a catalog name.
  // In "host" a worker gets this process's environment (less the job's own
  // variables) and working directory, as mpirun's ranks do; in any other,
  // only `env` and the job's variables, in `working_dir` or else the
  // image's: this host's PATH or LD_LIBRARY_PATH would hide the image's.
  // The parameter servers run deepnex-ps from this host's files whatever
  // the image, so the PS modes take another image only on backends that
  // also run "host" (oci, central's agents).
  std::string image = "host";
  // Extra environment for every worker, and the working directory of the
  // workers and parameter servers (empty: this process's, or for workers in
  // another image than "host", the image's).
  std::map<std::string, std::string> env;
  std::string working_dir;
  // Bind mounts for every container of the job, workers and parameter
  // servers: what a container backend's image lacks (the code, the data,
  // deepnex itself). The working directory must be in the image or under
  // one of them.
  std::vector<launch::Mount> mounts;
  // Receives every line the job's processes print, with who printed it
  // ("worker 0", "ps 1"). Default: written to stdout as "[worker 0] line".
  std::function<void(const std::string& who, const std::string& line)> output;
  // Receives what happens to the job's processes as it happens:
  // "worker 1 exited(1); restarting (1/2) in 1.0s". Default: written to
  // stderr.
  std::function<void(const std::string& message)> on_event;
};

struct JobResult {
  // 0 when every worker exited 0; else the first failing worker's code
  // (128 + signal for a signal, 137 for an OOM kill, 1 if lost or stopped).
  int exit_code = 0;
  std::vector<launch::ExitStatus> workers;
  double seconds = 0;
  // Stop ended it, not its workers: Stop came before Wait saw its end.
  bool stopped = false;
};

// One job. Thread-safe: Stop may come from a signal-handling thread while
// another starts or waits (a Start then stops waiting, in deepnex-central's
// queue say, and returns Cancelled).
class Job {
 public:
  // Validates the options: InvalidArgument naming the field and value.
  static absl::StatusOr<std::unique_ptr<Job>> Create(const JobOptions& options);
  virtual ~Job() = default;

  virtual const std::string& name() const = 0;
  // The launch backend that starts the job's containers: the options' one,
  // or "central" once Start placed them on agent nodes through
  // deepnex-central.
  virtual const std::string& backend() const = 0;
  // Allocates and starts everything; on an error releases what it took.
  // With deepnex-central, a job that waits in its queue says where and why
  // through on_event.
  virtual absl::Status Start() = 0;
  // Until every worker has ended for good, or Stop was called (the result
  // says which); then stops the parameter servers and releases the
  // allocations. DeadlineExceeded after `timeout` (the job keeps running).
  virtual absl::StatusOr<JobResult> Wait(std::chrono::milliseconds timeout) = 0;
  // Stops every container and releases every allocation, then the workers'
  // output read by then is shown (the rest is not: a stop is for now). Each
  // host's containers are stopped at once; one that has not ended after
  // about 6 s (its node unreachable) is left to its node, and the status
  // and on_event name it and its node.
  // `signal`: the one that stopped the job (SIGINT, SIGTERM), which its
  // record in deepnex-central says (cancelled, exit 128 + signal); 0: an
  // error stopped it (failed, exit 1). Idempotent.
  virtual absl::Status Stop(int signal) = 0;
  // The containers a Stop has not stopped (yet), as "worker 1 on node
  // \"h2\"": those it left to their nodes after its deadline, and those it
  // still stops. For a second Ctrl-C, which leaves without waiting, to say
  // what it leaves. Asks nothing of any server.
  virtual std::vector<std::string> Unstopped() = 0;
  // The job's containers (parameter servers first, then workers by rank).
  virtual std::vector<std::shared_ptr<launch::Handle>> Containers() = 0;
  // The workers' allocations by rank, then the parameter servers' (which
  // have their own only where the backend places on nodes).
  virtual std::vector<gpu::Allocation> Allocations() = 0;
};

// Create + Start + Wait (no timeout); stops the job on every path.
absl::StatusOr<JobResult> RunJob(const JobOptions& options);

}  // namespace deepnex::job

#endif  // DEEPNEX_JOB_JOB_H_
