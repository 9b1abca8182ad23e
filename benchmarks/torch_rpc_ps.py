#!/usr/bin/env python3
"""The torch.distributed.rpc parameter server: ps_bench's PS peer.

Built as PyTorch's tutorial "Implementing a Parameter Server Using
Distributed RPC Framework" builds it: rank 0 ("ps") owns a ParameterServer
object created on first use under a global lock; each trainer holds an RRef
to it (rpc.remote) and calls its methods with rpc_sync through the RRef's
owner. The model is --mb MiB of float32 cut into --partitions tensors (16 x
4 MiB by default, like deepnex's partitions). One step of a trainer is one
rpc_sync carrying the list of gradient tensors (the push); the server applies
SGD (p -= lr * g) under a lock and returns a copy of the parameters taken
under the same lock (the pull; copying keeps a concurrent push from tearing
the reply).

Timing, as in ps_bench_worker and tcp_ceiling: each trainer does --warmup
steps, all trainers meet at one barrier (an RPC to the server), then each runs
--rounds timed steps on its own. Round k takes the longest of the trainers'
k-th step times; the figure is the median of those, and
  goodput = (push + pull bytes over all trainers) / median round time,
in GB/s of 1e9 bytes.

Processes: server + --workers trainers, spawned with torch.multiprocessing on
127.0.0.1 and a port the OS picked. TensorPipe backend with its default
transports and channels (what the tutorial gets) unless --tcp-only, which
restricts it to the uv (TCP) transport and basic channel. --malloc-tuned
gives the processes the glibc settings deepnex's programs make with mallopt
(MALLOC_MMAP_THRESHOLD_=32 MiB, MALLOC_TRIM_THRESHOLD_=1 GiB): without them
glibc maps and unmaps every multi-MiB tensor, and on these VMs the page
faults cost the stock peer much of its time and most of its noise. An overall
--timeout kills every process. Output: one JSON line on stdout; progress on
stderr. Run it with /usr/bin/python3 (Debian's, which has torch).
"""

import argparse
import json
import os
import queue
import socket
import statistics
import sys
import threading
import time
import traceback

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

PS_NAME = "ps"

# --- server side, as in the tutorial ---------------------------------------

param_server = None
global_lock = threading.Lock()
start_barrier = None


class ParameterServer:
    def __init__(self, numel_per_partition, partitions, lr):
        self.lr = lr
        self.lock = threading.Lock()
        self.params = [torch.zeros(numel_per_partition, dtype=torch.float32)
                       for _ in range(partitions)]

    def push_pull(self, grads):
        with self.lock, torch.no_grad():
            for p, g in zip(self.params, grads):
                p.sub_(g, alpha=self.lr)
            return [p.clone() for p in self.params]


def get_parameter_server(numel_per_partition, partitions, lr):
    global param_server
    with global_lock:
        if param_server is None:
            param_server = ParameterServer(numel_per_partition, partitions, lr)
        return param_server


def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method, rref, *args, **kwargs):
    return rpc.rpc_sync(rref.owner(), call_method,
                        args=[method, rref] + list(args), kwargs=kwargs)


def wait_at_start_barrier():
    start_barrier.wait(timeout=600)


# --- processes ---------------------------------------------------------------

def rpc_options(args, port):
    kw = dict(num_worker_threads=max(16, 4 * args.workers),
              rpc_timeout=args.timeout,
              init_method=f"tcp://127.0.0.1:{port}")
    if args.tcp_only:
        kw.update(_transports=["uv"], _channels=["basic"])
    return rpc.TensorPipeRpcBackendOptions(**kw)


def run(rank, args, port, results):
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        world = args.workers + 1
        numel = (args.mb << 20) // 4 // args.partitions
        if rank == 0:
            global start_barrier
            start_barrier = threading.Barrier(args.workers)
            rpc.init_rpc(PS_NAME, rank=0, world_size=world,
                         rpc_backend_options=rpc_options(args, port))
            rpc.shutdown()  # waits for every trainer
            return
        name = f"trainer{rank - 1}"
        rpc.init_rpc(name, rank=rank, world_size=world,
                     rpc_backend_options=rpc_options(args, port))
        ps_rref = rpc.remote(PS_NAME, get_parameter_server,
                             args=(numel, args.partitions, args.lr))
        grads = [torch.zeros(numel, dtype=torch.float32)
                 for _ in range(args.partitions)]
        times = []
        for step in range(args.warmup + args.rounds):
            if step == args.warmup:
                rpc.rpc_sync(PS_NAME, wait_at_start_barrier)
            t0 = time.perf_counter()
            params = remote_method(ParameterServer.push_pull, ps_rref, grads)
            dt = time.perf_counter() - t0
            assert len(params) == args.partitions
            if step >= args.warmup:
                times.append(dt)
            if rank == 1:
                print(f"torch_rpc_ps: step {step + 1}/"
                      f"{args.warmup + args.rounds} {dt * 1e3:.1f} ms",
                      file=sys.stderr, flush=True)
        del params
        results.put((rank, times, None))
        rpc.shutdown()
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
        raise


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--mb", type=int, default=64, help="model size in MiB")
    ap.add_argument("--partitions", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.0)
    ap.add_argument("--tcp-only", action="store_true",
                    help="TensorPipe uv transport and basic channel only")
    ap.add_argument("--malloc-tuned", action="store_true",
                    help="glibc mmap/trim thresholds as deepnex sets them")
    ap.add_argument("--timeout", type=float, default=300,
                    help="seconds for the whole run")
    args = ap.parse_args()
    if (args.mb << 20) % (4 * args.partitions):
        ap.error("--mb MiB of float32 must split evenly into --partitions")

    # TensorPipe's agent logs through glog at INFO; keep stderr to progress.
    os.environ.setdefault("GLOG_minloglevel", "2")
    if args.malloc_tuned:  # read by glibc when each spawned process starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(32 << 20)
        os.environ["MALLOC_TRIM_THRESHOLD_"] = str(1 << 30)
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, args, port, results),
                         daemon=True)
             for r in range(args.workers + 1)]
    deadline = time.monotonic() + args.timeout
    times = {}
    error = None
    try:
        for p in procs:
            p.start()
        while len(times) < args.workers and error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                error = f"timed out after {args.timeout:.0f} s"
                break
            try:
                rank, t, err = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    error = (f"process {procs.index(dead[0])} exited with "
                             f"{dead[0].exitcode}")
                continue
            if err:
                error = f"rank {rank} failed:\n{err}"
            else:
                times[rank] = t
        for p in procs:
            p.join(timeout=max(1.0, min(30.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if error:
        print(f"torch_rpc_ps: {error}", file=sys.stderr)
        return 1

    round_s = [max(times[r][k] for r in times) for k in range(args.rounds)]
    median_s = statistics.median(round_s)
    bytes_per_worker = args.mb << 20
    moved = 2 * bytes_per_worker * args.workers
    print(json.dumps({
        "bench": "torch_rpc_ps",
        "workers": args.workers,
        "bytes_per_worker": bytes_per_worker,
        "partitions": args.partitions,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "transport": "uv/basic" if args.tcp_only else "default",
        "malloc_tuned": args.malloc_tuned,
        "torch": torch.__version__,
        "median_s": round(median_s, 6),
        "min_s": round(min(round_s), 6),
        "max_s": round(max(round_s), 6),
        "goodput_gbps": round(moved / median_s / 1e9, 4),
        "round_s": [round(s, 6) for s in round_s],
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
