"""One rank of the torch.distributed gloo allreduce peer of allreduce_bench.

Times float32 allreduces exactly as allreduce_bench_worker does (warm-up,
barrier before each timed run, median) and prints "SIZE_BYTES MEDIAN_SECONDS"
from rank 0.
"""
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    sizes = [int(s) for s in sys.argv[4].split(",")]
    min_time = float(sys.argv[5]) if len(sys.argv) > 5 else 0.3
    # MASTER_ADDR: rank 0's host when the ranks are on different hosts.
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=world)
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        for _ in range(2):
            dist.all_reduce(x)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        one = time.perf_counter() - t0
        iters = torch.tensor([max(5, min(200, int(min_time / max(one, 1e-6))))])
        dist.broadcast(iters, 0)
        times = []
        for _ in range(int(iters)):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        x.copy_(torch.arange(nbytes // 4, dtype=torch.float32) % 1000 + rank)
        dist.all_reduce(x)
        want = world * (torch.arange(nbytes // 4, dtype=torch.float32) % 1000) + world * (world - 1) / 2
        assert torch.equal(x, want), "gloo gave a wrong result"
        times.sort()
        if rank == 0:
            print(nbytes, f"{times[len(times) // 2]:.9f}", "gloo", flush=True)
    # Barrier latency: median of 7 rounds of 500 back-to-back barriers.
    rounds = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(500):
            dist.barrier()
        rounds.append((time.perf_counter() - t0) / 500)
    rounds.sort()
    if rank == 0:
        print("barrier", f"{rounds[3]:.9f}", "gloo", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
