"""Digits classification with a PyTorch MLP, data-parallel through deepnex:
deepnex.torch.DistributedOptimizer (parameter server: sync, ssp:S, async) or
deepnex.torch.DistributedDataParallel (allreduce).

    python3 examples/digits/mlp_torch.py --mode allreduce   # 2 workers here
    deepnex run --workers 2 --ps 1 --mode sync --lr 0.1 -- python3 examples/digits/mlp_torch.py
    torchrun --nproc_per_node 2 examples/digits/mlp_torch.py --mode allreduce
    deepnex run --workers 1:2 -- python3 examples/digits/mlp_torch.py   # elastic

Each worker trains on its deepnex.data.Sharder shard of the training set;
rank 0 prints the loss and test accuracy every epoch and a summary line.
Under an elastic job (DEEPNEX_ELASTIC set) the loop runs in
deepnex.elastic.run with a deepnex.torch.TorchState committed every step, so
that workers may join and leave between steps.
"""

import deepnex
import deepnex.elastic
import digits_common
from digits_common import Progress, job_context, load_data, parse_args


def main():
    args = parse_args(__doc__.split("\n\n")[0], lr=0.1)
    ctx = job_context(args, __file__)
    # Imported here: the process that only starts the workers does without.
    import torch

    import deepnex.torch
    torch.manual_seed(args.seed + ctx.rank)  # different on purpose: rank 0's win
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in load_data())
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = torch.nn.CrossEntropyLoss()
    data = (x_train, y_train, x_test, y_test)
    if deepnex.elastic.enabled():
        return train_elastic(args, ctx, model, opt, loss_fn, data)
    if args.mode == "allreduce":
        model = deepnex.torch.DistributedDataParallel(
            model, communicator=deepnex.collective.Communicator.from_context(ctx))
    else:
        # The servers apply SGD; opt is used for zero_grad.
        opt = deepnex.torch.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), root_rank=0)
    sharder = deepnex.data.Sharder.from_context(len(y_train), ctx, seed=args.seed)
    progress = Progress("digits mlp_torch", args, ctx, len(y_train))
    for epoch in range(1, args.epochs + 1):
        total, batches = 0.0, 0
        for batch in sharder.batches(args.batch_size):
            batch = torch.from_numpy(batch)
            opt.zero_grad()
            loss = loss_fn(model(x_train[batch]), y_train[batch])
            loss.backward()
            opt.step()
            total, batches = total + loss.item(), batches + 1
        with torch.no_grad():
            acc = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
        if progress.report(epoch, total / batches, acc):
            break
    if hasattr(opt, "close"):
        opt.close()
    return progress.finish()


def train_elastic(args, ctx, model, opt, loss_fn, data):
    """The same training, resumable at every step: a resize re-forms the
    workers (allreduce: a new communicator; PS: only the data follows) and
    continues from rank 0's last committed step."""
    import torch

    import deepnex.torch
    x_train, y_train, x_test, y_test = data
    if args.mode != "allreduce":
        client = deepnex.ps.Client(ctx.ps_addrs, worker_id=deepnex.elastic.ps_worker_id(),
                                   token=ctx.token or None)
        opt = deepnex.torch.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), client=client, root_rank=0)
    sharder = deepnex.data.Sharder(len(y_train), ctx.world_size, ctx.rank, seed=args.seed)
    state = deepnex.torch.TorchState(model, opt, sharder=sharder, loss=0.0, batches=0)

    def step(batch):
        opt.zero_grad()
        batch = torch.from_numpy(batch)
        loss = loss_fn(state.model(x_train[batch]), y_train[batch])
        loss.backward()
        opt.step()
        return loss.item()

    def accuracy():
        with torch.no_grad():
            return (state.model(x_test).argmax(dim=1) == y_test).float().mean().item()

    # rank and world_size follow the membership.
    progress = Progress("digits mlp_torch", args, state, len(y_train))
    digits_common.train_elastic(state, args, progress, step, accuracy)
    if hasattr(opt, "close"):
        opt.close()
    return progress.finish()


if __name__ == "__main__":
    raise SystemExit(main())
