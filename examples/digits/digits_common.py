"""What the digits examples share: arguments, data, the job they run in,
progress lines and the tune hook. See mlp_numpy.py and mlp_torch.py."""

import argparse
import os
import sys
import time

import numpy as np

import deepnex
import deepnex.elastic
import deepnex.tune


def parse_args(description, lr):
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--mode", default=None,
                    help="sync, ssp:S, async (parameter server) or allreduce. Under deepnex "
                         "run the default follows the job: the parameter servers (whose mode "
                         "is deepnex run's --mode) when it has any, else allreduce; started "
                         "by hand: sync")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--momentum", type=float, default=None,
                    help="SGD momentum (default 0.9; 0.7 in the async and ssp modes, where "
                         "stale gradients with high momentum can diverge)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-accuracy", type=float, default=0.0,
                    help="exit 1 when the final test accuracy is below this")
    ap.add_argument("--workers", type=int, default=2,
                    help="workers to start when no launcher started this script")
    ap.add_argument("--ps", type=int, default=1,
                    help="parameter servers to start when no launcher started this script")
    return ap.parse_args()


def load_data():
    """sklearn's bundled 8x8 digits (1797 images): 80% train, 20% test,
    the same split on every worker. Pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(1234).permutation(len(y))
    x = (x[order] / 16.0).astype(np.float32)
    y = y[order].astype(np.int64)
    cut = int(0.8 * len(y))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def _default_momentum(args):
    if args.momentum is None:
        args.momentum = 0.7 if args.mode.split(":")[0] in ("async", "ssp") else 0.9


def job_context(args, script):
    """This worker's deepnex.Context. Without a launcher's environment the
    script starts its own job on this machine (a store, args.ps parameter
    servers, args.workers copies of itself) and exits with its status.

    torchrun-style variables alone (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) work in allreduce mode: rank 0 serves the deepnex store at
    MASTER_PORT + 1, next to torchrun's own store on MASTER_PORT.
    """
    env = os.environ
    if "DEEPNEX_JOB_ID" in env:
        ctx = deepnex.init()
        if args.mode is None:
            args.mode = "ps" if ctx.ps_addrs else "allreduce"
        _default_momentum(args)
        # The servers apply the launcher's optimizer: a new user's --lr here
        # changed nothing, without a word.
        given = [a.split("=")[0] for a in sys.argv[1:]
                 if a.split("=")[0] in ("--lr", "--momentum")]
        if ctx.ps_addrs and given and ctx.rank == 0:
            verb = "is" if len(given) == 1 else "are"
            print(f"{os.path.basename(script)}: {' and '.join(given)} here {verb} not used: the "
                  f"parameter servers apply deepnex run's --optimizer, --lr and --momentum",
                  file=sys.stderr)
        return ctx
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        args.mode = args.mode or "allreduce"
        _default_momentum(args)
        if args.mode != "allreduce":
            sys.exit(f"{script}: with only torchrun's variables, use --mode allreduce "
                     f"(the parameter-server modes need deepnex run)")
        store_addr = f"{env['MASTER_ADDR']}:{int(env.get('MASTER_PORT', '29500')) + 1}"
        if env["RANK"] == "0":
            # Kept alive for the process's lifetime.
            job_context.store = deepnex.collective.Store(store_addr)
        return deepnex.init({
            "DEEPNEX_JOB_ID": "torchrun", "DEEPNEX_ROLE": "worker",
            "DEEPNEX_RANK": env["RANK"], "DEEPNEX_WORLD_SIZE": env["WORLD_SIZE"],
            "DEEPNEX_LOCAL_RANK": env.get("LOCAL_RANK", "0"),
            "DEEPNEX_STORE_ADDR": store_addr})
    from deepnex._local import run_local
    args.mode = args.mode or "sync"
    _default_momentum(args)
    print(f"{os.path.basename(script)}: no job environment; starting {args.workers} "
          f"workers, mode {args.mode}, on this machine", flush=True)
    codes = run_local([sys.executable, os.path.abspath(script)] + sys.argv[1:],
                      workers=args.workers, ps=args.ps, mode=args.mode,
                      optimizer=deepnex.ps.SGD(lr=args.lr, momentum=args.momentum))
    sys.exit(max(codes, key=abs))


class Progress:
    """Per-epoch lines and the summary (rank 0), and the hyperparameter
    search's hook: report() returns True when deepnex.tune stops the trial."""

    def __init__(self, name, args, ctx, train_size):
        self.name, self.args, self.ctx = name, args, ctx
        self.train_size = train_size
        self.start = time.monotonic()
        self.accuracy = 0.0
        self.epochs = 0

    def report(self, epoch, loss, accuracy):
        self.accuracy, self.epochs = accuracy, epoch
        if self.ctx.rank == 0:
            print(f"epoch {epoch:3d}  loss {loss:.4f}  test accuracy {accuracy:.4f}  "
                  f"({time.monotonic() - self.start:.1f} s)", flush=True)
        metrics = {"loss": loss, "accuracy": accuracy} if self.ctx.rank == 0 else {}
        return deepnex.tune.report(step=epoch, **metrics)

    def finish(self):
        seconds = time.monotonic() - self.start
        if self.ctx.rank == 0:
            samples = self.train_size * self.epochs
            print(f"summary: {self.name} mode={self.args.mode} workers={self.ctx.world_size} "
                  f"epochs={self.epochs} test_accuracy={self.accuracy:.4f} "
                  f"time={seconds:.1f}s samples_per_s={samples / seconds:.0f}", flush=True)
        return 0 if self.accuracy >= self.args.min_accuracy or self.ctx.rank != 0 else 1


def train_elastic(state, args, progress, step, accuracy):
    """The examples' loop under an elastic job (DEEPNEX_ELASTIC): epochs of
    state.sharder's batches, step(batch) -> loss for each, state.commit()
    after each, and a progress
    line with accuracy() at each epoch's end. state holds the counters
    loss and batches. A resize continues from rank 0's last commit."""

    @deepnex.elastic.run
    def train(state):
        while state.sharder.epoch < args.epochs:
            epoch = state.sharder.epoch
            for batch in state.sharder.batches(args.batch_size):
                state.loss, state.batches = state.loss + step(batch), state.batches + 1
                state.commit()
            stop = progress.report(epoch + 1, state.loss / max(state.batches, 1), accuracy())
            state.loss, state.batches = 0.0, 0
            if stop:
                return

    train(state)
