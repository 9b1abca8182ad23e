"""Trains a softmax classifier with 2 workers through a deepnex parameter
server: first in sync mode (a barrier every step), then in async mode.

    python3 examples/ps_demo.py [--workers 2] [--steps 60]

Each worker is a process with its own shard of a synthetic 10-class data set;
worker 0 prints the loss as it falls.
"""

import argparse
import subprocess
import sys
import time

import numpy as np

import deepnex

FEATURES, CLASSES, SAMPLES = 20, 10, 4000


def dataset(seed=0):
    """Gaussian clusters, one per class: learnable, but not in one step."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 0.6, (CLASSES, FEATURES))
    labels = rng.integers(0, CLASSES, SAMPLES)
    x = centers[labels] + rng.normal(0, 1.0, (SAMPLES, FEATURES))
    return x.astype(np.float32), labels


def loss_and_grads(w, b, x, y):
    logits = x @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.log(p[np.arange(len(y)), y] + 1e-12).mean()
    p[np.arange(len(y)), y] -= 1
    p /= len(y)
    acc = float((logits.argmax(axis=1) == y).mean())
    return loss, acc, (x.T @ p).astype(np.float32), p.sum(axis=0).astype(np.float32)


def worker(address, rank, workers, steps, mode):
    x, y = dataset()
    shard = slice(rank * len(y) // workers, (rank + 1) * len(y) // workers)
    x, y = x[shard], y[shard]
    with deepnex.ps.Client([address], worker_id=rank) as client:
        client.init({"w": np.zeros((FEATURES, CLASSES), np.float32),
                     "b": np.zeros(CLASSES, np.float32)})
        params = client.pull(["w", "b"])
        rng = np.random.default_rng(rank)
        for step in range(1, steps + 1):
            batch = rng.integers(0, len(y), 128)
            loss, acc, gw, gb = loss_and_grads(params["w"], params["b"], x[batch], y[batch])
            params = client.push_pull({"w": gw, "b": gb})
            if rank == 0 and (step == 1 or step % 10 == 0):
                print(f"  [{mode}] step {step:3d}  loss {loss:.4f}  batch accuracy {acc:.2f}",
                      flush=True)
        full_loss, full_acc, _, _ = loss_and_grads(params["w"], params["b"], *dataset())
        if rank == 0:
            print(f"  [{mode}] final: loss {full_loss:.4f}, accuracy {full_acc:.3f} "
                  f"on all {SAMPLES} samples", flush=True)


def train(mode, workers, steps):
    print(f"== {mode} mode: parameter server + {workers} worker processes", flush=True)
    start = time.monotonic()
    with deepnex.ps.Server(mode=mode, num_workers=workers,
                           optimizer=deepnex.ps.SGD(lr=0.05, momentum=0.5)) as server:
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r),
                                   "--address", server.address, "--workers", str(workers),
                                   "--steps", str(steps), "--mode", mode])
                 for r in range(workers)]
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=300))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
    if any(codes):
        sys.exit(f"{mode}: a worker failed (exit codes {codes})")
    print(f"  [{mode}] {steps} steps in {time.monotonic() - start:.1f} s", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="sync", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args.address, args.worker, args.workers, args.steps, args.mode)
    for mode in ("sync", "async"):
        train(mode, args.workers, args.steps)


if __name__ == "__main__":
    main()
