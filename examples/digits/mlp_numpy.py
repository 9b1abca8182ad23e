"""Digits classification with a NumPy MLP, data-parallel through deepnex:
a parameter server (sync, ssp:S or async) or allreduce.

    python3 examples/digits/mlp_numpy.py --mode sync        # 2 workers + 1 server here
    deepnex run --workers 2 --ps 1 --mode async --lr 0.1 -- python3 examples/digits/mlp_numpy.py

Each worker trains on its deepnex.data.Sharder shard of the training set;
rank 0 prints the loss and test accuracy every epoch and a summary line.
In the parameter-server modes the servers apply SGD (the launcher's
--optimizer/--lr; --lr/--momentum here when the script starts its own job);
in allreduce mode each worker applies the same SGD to the averaged gradients.
Under an elastic job (DEEPNEX_ELASTIC set, `deepnex run --workers 1:2`) the
loop runs in deepnex.elastic.run, committing every step, so that workers may
join and leave between steps.
"""

import numpy as np

import deepnex
import deepnex.elastic
import digits_common
from digits_common import Progress, job_context, load_data, parse_args

KEYS = ("w1", "b1", "w2", "b2")


def init_params(hidden, seed):
    rng = np.random.default_rng(seed)
    return {"w1": (rng.standard_normal((64, hidden)) * np.sqrt(2 / 64)).astype(np.float32),
            "b1": np.zeros(hidden, np.float32),
            "w2": (rng.standard_normal((hidden, 10)) * np.sqrt(1 / hidden)).astype(np.float32),
            "b2": np.zeros(10, np.float32)}


def forward(p, x):
    h = np.maximum(x @ p["w1"] + p["b1"], 0)
    return h, h @ p["w2"] + p["b2"]


def loss_and_grads(p, x, y, out):
    """Softmax cross-entropy; writes the gradients into `out`."""
    h, logits = forward(p, x)
    logits = logits - logits.max(axis=1, keepdims=True)
    prob = np.exp(logits)
    prob /= prob.sum(axis=1, keepdims=True)
    loss = float(-np.log(prob[np.arange(len(y)), y] + 1e-12).mean())
    d = prob
    d[np.arange(len(y)), y] -= 1
    d /= len(y)
    out["w2"][...] = h.T @ d
    out["b2"][...] = d.sum(axis=0)
    dh = (d @ p["w2"].T) * (h > 0)
    out["w1"][...] = x.T @ dh
    out["b1"][...] = dh.sum(axis=0)
    return loss


def accuracy(p, x, y):
    return float((forward(p, x)[1].argmax(axis=1) == y).mean())


class AllreduceSGD:
    """Averages the gradients over the workers (one bucketed allreduce per
    step) and applies SGD with momentum locally, the same on every worker."""

    def __init__(self, comm, params, grads, lr, momentum, velocity=None):
        self.comm = comm
        for k in KEYS:
            self.comm.broadcast(params[k], root=0)
        self.params, self.grads = params, grads
        self.bucketer = deepnex.collective.GradientBucketer(
            self.comm, [grads[k] for k in KEYS], op="mean")
        self.velocity = velocity if velocity is not None else {
            k: np.zeros_like(v) for k, v in params.items()}
        self.lr, self.momentum = lr, momentum

    def step(self):
        self.bucketer.mark_all_ready()
        self.bucketer.wait()
        for k in KEYS:
            self.velocity[k] *= self.momentum
            self.velocity[k] += self.grads[k]
            self.params[k] -= self.lr * self.velocity[k]
        return self.params


class ParameterServerSGD:
    """Pushes the gradients and pulls the servers' new parameters, one round
    trip per step; the servers apply the optimizer."""

    def __init__(self, ctx, params, grads, worker_id=None):
        self.client = deepnex.ps.Client(ctx.ps_addrs,
                                        worker_id=ctx.rank if worker_id is None else worker_id,
                                        token=ctx.token or None)
        # Every worker draws the same initial values from the seed, so which
        # init wins (the first) does not matter.
        self.client.init(params)
        self.params = self.client.pull(list(KEYS))
        self.grads = grads

    def step(self):
        self.params = self.client.push_pull(self.grads)
        return self.params

    def close(self):
        self.client.close()


def main():
    args = parse_args(__doc__.split("\n\n")[0], lr=0.1)
    ctx = job_context(args, __file__)
    x_train, y_train, x_test, y_test = load_data()
    params = init_params(args.hidden, args.seed)
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    if deepnex.elastic.enabled():
        return train_elastic(args, ctx, (x_train, y_train, x_test, y_test), params, grads)
    if args.mode == "allreduce":
        opt = AllreduceSGD(deepnex.collective.Communicator.from_context(ctx), params, grads,
                           args.lr, args.momentum)
    else:
        opt = ParameterServerSGD(ctx, params, grads)
    params = opt.params
    sharder = deepnex.data.Sharder.from_context(len(y_train), ctx, seed=args.seed)
    progress = Progress("digits mlp_numpy", args, ctx, len(y_train))
    for epoch in range(1, args.epochs + 1):
        losses = []
        for batch in sharder.batches(args.batch_size):
            losses.append(loss_and_grads(params, x_train[batch], y_train[batch], grads))
            params = opt.step()
        if progress.report(epoch, float(np.mean(losses)), accuracy(params, x_test, y_test)):
            break
    if hasattr(opt, "close"):
        opt.close()
    return progress.finish()


def train_elastic(args, ctx, data, params, grads):
    """The same training under an elastic job (DEEPNEX_ELASTIC): a
    deepnex.elastic.State holds the parameters, the momentum and the data
    position, committed every step; after each resize the allreduce
    optimizer works on the new communicator and the synced arrays."""
    x_train, y_train, x_test, y_test = data
    sharder = deepnex.data.Sharder(len(y_train), ctx.world_size, ctx.rank, seed=args.seed)
    opt = {}
    if args.mode != "allreduce":
        opt["sgd"] = ParameterServerSGD(ctx, params, grads,
                                        worker_id=deepnex.elastic.ps_worker_id())
        params = opt["sgd"].params
    state = deepnex.elastic.State(sharder=sharder, params=params, loss=0.0, batches=0,
                                  velocity={k: np.zeros_like(v) for k, v in params.items()})

    def bind():
        if args.mode == "allreduce":
            opt["sgd"] = AllreduceSGD(state.communicator, state.params, grads, args.lr,
                                      args.momentum, state.velocity)

    def step(batch):
        loss = loss_and_grads(state.params, x_train[batch], y_train[batch], grads)
        state.params = opt["sgd"].step()
        return loss

    state.register_reset_callbacks([bind])
    # rank and world_size follow the membership.
    progress = Progress("digits mlp_numpy", args, state, len(y_train))
    digits_common.train_elastic(state, args, progress, step,
                                lambda: accuracy(state.params, x_test, y_test))
    if hasattr(opt["sgd"], "close"):
        opt["sgd"].close()
    return progress.finish()


if __name__ == "__main__":
    raise SystemExit(main())
