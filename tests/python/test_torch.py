"""deepnex.torch: DistributedOptimizer through a parameter server,
DistributedDataParallel's bucketed allreduce and broadcast_parameters, with
2 workers as threads and integer-valued data, so results are exact."""

import os
import time

import pytest

torch = pytest.importorskip("torch")

import deepnex  # noqa: E402
import deepnex.torch as dtorch  # noqa: E402
from _wait import run_threads  # noqa: E402
from deepnex import collective  # noqa: E402

_counter = [0]


def run_workers(n, body):
    """body(rank) on n threads; re-raises the first failure."""
    run_threads(n, body, timeout=60, what="a worker")


def communicators(store, n, timeout=20.0):
    """rank -> that rank's member of a new communicator of n ranks."""
    _counter[0] += 1
    prefix = f"torch{os.getpid()}-{_counter[0]}"
    return lambda rank: collective.Communicator(rank, n, store=store.address, timeout=timeout,
                                                prefix=prefix)


def model(rank):
    """Two layers whose initial values differ by rank (integers)."""
    m = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=True), torch.nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape)
                    + 10 * rank + i)
    return m


def test_distributed_optimizer_averages_gradients_on_the_server():
    n = 2
    with deepnex.ps.Server(mode="sync", num_workers=n,
                           optimizer=deepnex.ps.SGD(lr=0.5)) as server:
        finals = [None] * n

        def worker(rank):
            m = torch.nn.Linear(4, 1, bias=False)
            with torch.no_grad():
                m.weight.copy_(torch.full((1, 4), float(rank + 1)))
            client = deepnex.ps.Client([server.address], worker_id=rank)
            opt = dtorch.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=99.0),
                                              named_parameters=m.named_parameters(),
                                              client=client)
            # Every worker starts from rank 0's parameters.
            assert m.weight.tolist() == [[1.0, 1.0, 1.0, 1.0]]
            for step in range(3):
                opt.zero_grad()
                x = torch.tensor([[1.0, 2.0, 3.0, 4.0]]) * (rank + 1 + step)
                m(x).sum().backward()          # grad = x
                opt.step()
            finals[rank] = m.weight.detach().clone()
            assert set(client.describe(["weight"])) == {"weight"}
            client.close()

        run_workers(n, worker)
    # Round s: mean grad = [1,2,3,4] * (1.5 + s); w -= 0.5 * that.
    expected = torch.tensor([[1.0, 1.0, 1.0, 1.0]]) - 0.5 * torch.tensor(
        [[1.0, 2.0, 3.0, 4.0]]) * (1.5 + 2.5 + 3.5)
    assert torch.equal(finals[0], expected) and torch.equal(finals[1], expected)


def test_distributed_optimizer_takes_non_contiguous_parameters_and_names_sparse_gradients():
    """A probe's channels_last and transposed parameters were refused on
    rank 0 ("not C-contiguous ... pass x.contiguous()", which a model's
    parameter cannot take) while rank 1 waited 60 s; a sparse gradient
    failed inside backward with torch's "can't convert Sparse layout"."""
    with deepnex.ps.Server(mode="sync", num_workers=1,
                           optimizer=deepnex.ps.SGD(lr=0.5)) as server:
        w = torch.nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]).t())
        assert not w.is_contiguous()
        client = deepnex.ps.Client([server.address], worker_id=0)
        opt = dtorch.DistributedOptimizer(torch.optim.SGD([w], lr=99.0),
                                          named_parameters=[("w", w)], client=client)
        (w * torch.tensor([[2.0, 4.0], [6.0, 8.0]])).sum().backward()
        opt.step()
        assert w.tolist() == [[0.0, 1.0], [-1.0, 0.0]]
        assert client.pull(["w"])["w"].tolist() == [[0.0, 1.0], [-1.0, 0.0]]
        client.close()
    with deepnex.ps.Server(mode="sync", num_workers=1,
                           optimizer=deepnex.ps.SGD(lr=0.5)) as server:
        emb = torch.nn.Embedding(4, 2, sparse=True)
        client = deepnex.ps.Client([server.address], worker_id=0)
        opt = dtorch.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=99.0),
                                          named_parameters=emb.named_parameters(),
                                          client=client)
        with pytest.raises(deepnex.InvalidArgumentError) as e:
            emb(torch.tensor([1])).sum().backward()
        assert str(e.value) == (
            "DistributedOptimizer: parameter 'weight' got a sparse gradient "
            "(nn.Embedding(sparse=True)?), which the parameter servers do not take: "
            "make it dense (sparse=False)")
        client.close()


def _ps_optimizer(server_address, rank, **kwargs):
    """model(rank), its client and its DistributedOptimizer."""
    m = model(rank)
    client = deepnex.ps.Client([server_address], worker_id=rank)
    opt = dtorch.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=99.0),
                                      named_parameters=m.named_parameters(),
                                      client=client, **kwargs)
    return m, client, opt


def _ps_train(server_address, rank, overlap, steps=3):
    """model(rank) trained `steps` steps through the server with 4-byte
    buckets (a bucket per parameter); returns the parameters."""
    m, client, opt = _ps_optimizer(server_address, rank, bucket_size=4, overlap=overlap)
    for step in range(steps):
        opt.zero_grad()
        x = torch.tensor([[1.0, 2.0, 3.0]]) * (rank + 1 + step)
        m(x).sum().backward()
        opt.step()
    client.close()
    return [p.detach().clone() for p in m.parameters()]


def test_distributed_optimizer_buckets_give_the_same_parameters_as_one_push():
    # The same training with buckets pushed during backward and with
    # everything pushed at step(): identical parameters on both workers.
    finals = {}
    for overlap in (True, False):
        with deepnex.ps.Server(mode="sync", num_workers=2,
                               optimizer=deepnex.ps.SGD(lr=0.5)) as server:
            got = [None, None]

            def worker(rank):
                got[rank] = _ps_train(server.address, rank, overlap)

            run_workers(2, worker)
        assert all(torch.equal(a, b) for a, b in zip(got[0], got[1]))
        finals[overlap] = got[0]
    assert all(torch.equal(a, b) for a, b in zip(finals[True], finals[False]))
    # Not the initial values: the steps did move them.
    assert not torch.equal(finals[True][0], model(0)[0].weight)


def test_distributed_optimizer_pushes_buckets_during_backward():
    with deepnex.ps.Server(mode="sync", num_workers=1,
                           optimizer=deepnex.ps.SGD(lr=0.5)) as server:
        m, client, opt = _ps_optimizer(server.address, 0, bucket_size=4)
        before = [p.detach().clone() for p in m.parameters()]
        m(torch.tensor([[1.0, 2.0, 3.0]])).sum().backward()
        # Three parameters, a bucket each: all three pushed before step().
        deadline = time.monotonic() + 20
        while client.stats()[0]["pushes"] < 3:
            assert time.monotonic() < deadline, client.stats()[0]["pushes"]
            time.sleep(0.01)
        assert client.stats()[0]["pushes"] == 3
        # Loaded only at step(): backward still saw the parameters it used.
        assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
        grads = [p.grad.clone() for p in m.parameters()]
        opt.step()
        for p, b, g in zip(m.parameters(), before, grads):
            assert torch.equal(p.detach(), b - 0.5 * g)
        client.close()


def _assert_overlap_off_applies_the_gradients(x, change):
    """With overlap=False, after a backward on `x` and `change(m)` (another
    backward, a clip), step() applies exactly the gradients then (SGD at lr
    1 on the server)."""
    with deepnex.ps.Server(mode="sync", num_workers=1,
                           optimizer=deepnex.ps.SGD(lr=1.0)) as server:
        m, client, opt = _ps_optimizer(server.address, 0, overlap=False)
        before = [p.detach().clone() for p in m.parameters()]
        m(x).sum().backward()
        change(m)
        grads = [p.grad.clone() for p in m.parameters()]
        opt.step()
        for p, b, g in zip(m.parameters(), before, grads):
            assert torch.equal(p.detach(), b - g)
        client.close()


def test_distributed_optimizer_second_backward_needs_overlap_off():
    with deepnex.ps.Server(mode="sync", num_workers=1,
                           optimizer=deepnex.ps.SGD(lr=1.0)) as server:
        x = torch.tensor([[1.0, 2.0, 3.0]])
        m, client, opt = _ps_optimizer(server.address, 0)
        m(x).sum().backward()
        with pytest.raises(deepnex.InvalidArgumentError,
                           match="a second backward before step\\(\\) .*overlap=False"):
            m(x).sum().backward()
        # The first backward's gradients went; the second one's, added to
        # '1.weight' before its hook refused it, did not.
        before = [p.detach().clone() for p in m.parameters()]
        with pytest.raises(deepnex.InvalidArgumentError,
                           match="the gradient of '1.weight' changed after backward pushed it"):
            opt.step()
        assert not any(torch.equal(p.detach(), b) for p, b in zip(m.parameters(), before))
        client.close()
    # Accumulated into p.grad.
    _assert_overlap_off_applies_the_gradients(x, lambda m: m(2 * x).sum().backward())


def test_distributed_optimizer_refuses_gradients_changed_after_they_were_pushed():
    """A probe's clip_grad_norm_ between backward() and step() had no effect
    with overlap (the default): the servers applied the unclipped gradient
    and nothing said so. overlap=False clips as torch's optimizer would."""
    x = torch.tensor([[1.0, 2.0, 3.0]])

    def halve(m):
        for p in m.parameters():
            p.grad.mul_(0.5)
    with deepnex.ps.Server(mode="sync", num_workers=1,
                           optimizer=deepnex.ps.SGD(lr=1.0)) as server:
        m, client, opt = _ps_optimizer(server.address, 0)
        m(x).sum().backward()
        halve(m)
        with pytest.raises(deepnex.InvalidArgumentError,
                           match="the gradient of '0.weight', '0.bias', '1.weight' changed "
                                 "after backward pushed it .*pass overlap=False"):
            opt.step()
        client.close()
    _assert_overlap_off_applies_the_gradients(x, halve)


def test_distributed_optimizer_refuses_a_parameter_the_servers_cannot_hold_on_every_rank():
    """A frozen int64 parameter: root_rank's init refused it at once while
    the other ranks waited the whole timeout and then said "no tensor"."""
    m = torch.nn.Linear(2, 1)
    m.idx = torch.nn.Parameter(torch.tensor([1, 5]), requires_grad=False)
    opt = torch.optim.SGD([m.weight, m.bias, m.idx], lr=0.1)
    for rank in (0, 1):
        with pytest.raises(deepnex.InvalidArgumentError,
                           match="parameter 'idx' is torch.int64; the parameter servers hold "
                                 "float32, float64, float16 and bfloat16"):
            dtorch.DistributedOptimizer(opt, named_parameters=m.named_parameters(),
                                        client=object(), root_rank=rank)


def test_distributed_optimizer_leaves_frozen_parameters_and_takes_bfloat16():
    # A frozen layer is never pushed, so the servers' weight decay leaves it
    # as torch's optimizer would; the trainable layer moves exactly as
    # SGD with weight decay says (integers and halves: exact in float32).
    with deepnex.ps.Server(mode="sync", num_workers=1,
                           optimizer=deepnex.ps.SGD(lr=0.5, weight_decay=0.5)) as server:
        m = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False),
                                torch.nn.Linear(2, 1, bias=False))
        with torch.no_grad():
            m[0].weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
            m[1].weight.copy_(torch.tensor([[2.0, 4.0]]))
        m[0].weight.requires_grad_(False)
        client = deepnex.ps.Client([server.address], worker_id=0)
        opt = dtorch.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.5),
                                          named_parameters=m.named_parameters(),
                                          client=client, bucket_size=4)
        opt.zero_grad()
        m(torch.tensor([[1.0, 0.0]])).sum().backward()   # grad of m[1]: [[1, 3]]
        opt.step()
        assert m[0].weight.tolist() == [[1.0, 2.0], [3.0, 4.0]]
        # w -= 0.5 * (g + 0.5 * w): [2, 4] - 0.5 * ([1, 3] + [1, 2])
        assert m[1].weight.tolist() == [[1.0, 1.5]]
        client.close()

        # bfloat16 parameters travel as they are (their bits).
        b = torch.nn.Linear(2, 1, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            b.weight.copy_(torch.tensor([[2.0, 4.0]]))
        client = deepnex.ps.Client([server.address], worker_id=0)
        opt = dtorch.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.5),
                                          named_parameters=[("bf16." + n, p) for n, p
                                                            in b.named_parameters()],
                                          client=client)
        opt.zero_grad()
        b(torch.tensor([[1.0, 3.0]], dtype=torch.bfloat16)).sum().backward()
        opt.step()
        assert b.weight.dtype == torch.bfloat16
        assert b.weight.tolist() == [[1.0, 1.5]]
        client.close()


def test_distributed_optimizer_rejects_unnamed_parameters():
    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not among them"):
        dtorch.DistributedOptimizer(opt, named_parameters=[("weight", m.weight)],
                                    client=object())


@pytest.mark.parametrize("bucket_size", [16, "25MiB"])
def test_ddp_averages_gradients_exactly(store, bucket_size):
    n = 2
    inputs = [torch.tensor([[1.0, 2.0, 3.0], [0.0, 1.0, 1.0]]) * (r + 1) for r in range(n)]
    # Reference: rank 0's parameters (the broadcast), the mean of the ranks' grads.
    ref = []
    for r in range(n):
        m = model(0)
        m(inputs[r]).sum().backward()
        ref.append([p.grad.clone() for p in m.parameters()])
    expected = [(a + b) / 2 for a, b in zip(*ref)]
    got = [None] * n
    communicator = communicators(store, n)

    def worker(rank):
        m = model(rank)
        ddp = dtorch.DistributedDataParallel(m, communicator=communicator(rank),
                                             bucket_size=bucket_size)
        for step in range(2):
            # Both zero_grad styles: grads set to None, and zeroed in place.
            for p in m.parameters():
                if step == 0:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            ddp(inputs[rank]).sum().backward()
            got[rank] = [p.grad.clone() for p in m.parameters()]
            for a, b in zip(got[rank], expected):
                assert torch.equal(a, b), (step, a, b)
        assert [p.tolist() for p in m.parameters()] == [p.tolist() for p in model(0).parameters()]

    run_workers(n, worker)


def test_ddp_unused_parameter_contributes_zeros(store):
    n = 2

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(2, 1, bias=False)
            self.b = torch.nn.Linear(2, 1, bias=False)

        def forward(self, x, use_b):
            return self.b(x) if use_b else self.a(x)

    grads = [None] * n
    communicator = communicators(store, n)

    def worker(rank):
        m = TwoHeads()
        ddp = dtorch.DistributedDataParallel(m, communicator=communicator(rank))
        ddp(torch.tensor([[2.0, 4.0]]), use_b=rank == 1).sum().backward()
        grads[rank] = (m.a.weight.grad.tolist(), m.b.weight.grad.tolist())

    run_workers(n, worker)
    assert grads[0] == grads[1] == ([[1.0, 2.0]], [[1.0, 2.0]])


def test_broadcast_parameters_state_dict_and_lists(store):
    n = 2
    got = [None] * n
    communicator = communicators(store, n)

    def worker(rank):
        comm = communicator(rank)
        m = torch.nn.BatchNorm1d(3)
        with torch.no_grad():
            m.weight.fill_(rank + 1)
            m.running_mean.fill_(rank + 5)
            m.num_batches_tracked.fill_(rank + 7)
        dtorch.broadcast_parameters(m.state_dict(), root_rank=1, communicator=comm)
        t = torch.arange(6.0).reshape(2, 3).t() * (rank + 1)   # not contiguous
        dtorch.broadcast_parameters([t], root_rank=0, communicator=comm)
        got[rank] = (m.weight.tolist(), m.running_mean.tolist(),
                     int(m.num_batches_tracked), t.tolist())

    run_workers(n, worker)
    assert got[0] == got[1] == ([2.0] * 3, [6.0] * 3, 8, [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]])


@pytest.mark.parametrize("other, differ", [
    ({"w": torch.zeros(2, dtype=torch.float64)}, ", in different names, shapes or dtypes"),
    ({"v": torch.zeros(2)}, ", in different names, shapes or dtypes"),
    ({"w": torch.zeros(3)}, ""),
    ({}, ""),
])
def test_broadcast_parameters_of_different_tensors_is_refused_on_each_rank(store, other, differ):
    """Rank 1's float64 tensor took rank 0's float32 bytes as half of its
    values (probe); other names, shapes or counts are refused too, before
    any tensor is overwritten."""
    n = 2
    communicator = communicators(store, n)
    mine = {"w": torch.zeros(2)}

    def worker(rank):
        tensors = mine if rank == 0 else other
        count, elements = len(tensors), sum(t.numel() for t in tensors.values())
        with pytest.raises(deepnex.InvalidArgumentError) as e:
            dtorch.broadcast_parameters(tensors, root_rank=0, communicator=communicator(rank))
        low, high = sorted([1, len(other)]), sorted([2, sum(t.numel() for t in other.values())])
        assert str(e.value) == (
            f"broadcast_parameters: the ranks pass different tensors: this rank has {count} "
            f"tensors ({elements} elements), the ranks {low[0]}-{low[1]} "
            f"({high[0]}-{high[1]} elements){differ}; every rank must pass the same names, "
            f"shapes and dtypes")

    run_workers(n, worker)


def test_ddp_takes_channels_last_and_transposed_parameters_and_any_buffer(store):
    # Its gradient buffers are contiguous whatever the parameters' layout,
    # and buffers of dtypes the collectives do not reduce (bool masks, uint8
    # tables) are broadcast as their bytes.
    n = 2
    got = [None] * n
    communicator = communicators(store, n)

    class Net(torch.nn.Module):
        def __init__(self, rank):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 1, 1, bias=False).to(memory_format=torch.channels_last)
            self.t = torch.nn.Parameter(torch.arange(6.0).reshape(3, 2).t() + rank)
            self.register_buffer("mask", torch.tensor([True, rank == 0, False]))
            self.register_buffer("table", torch.tensor([1, 2, 255], dtype=torch.uint8) - rank)
            with torch.no_grad():
                self.conv.weight.fill_(rank + 1)

        def forward(self, x):
            return (self.conv(x).sum() * self.t * self.mask).sum()

    def worker(rank):
        m = Net(rank)
        ddp = dtorch.DistributedDataParallel(m, communicator=communicator(rank))
        ddp(torch.ones(1, 1, 2, 2) * (rank + 1)).backward()
        got[rank] = (m.mask.tolist(), m.table.tolist(), m.conv.weight.grad.flatten().tolist(),
                     m.t.grad.tolist())

    run_workers(n, worker)
    # Rank 0's parameters and buffers. conv's gradient: sum(t * mask) = 6
    # times sum(x) (4 and 8 on the two ranks), averaged: 36; t's: conv(x)'s
    # sum (4 and 8) where the mask is set, averaged: 6.
    assert got[0] == got[1] == ([True, True, False], [1, 2, 255], [36.0],
                                [[6.0, 6.0, 0.0], [6.0, 6.0, 0.0]])


def _two_layers():
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) + i)
    return m


def _mean_grads(inputs):
    """The mean over the inputs of _two_layers()'s gradients (exact: integers)."""
    grads = []
    for x in inputs:
        m = _two_layers()
        m(x).sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    return [sum(g) / len(grads) for g in zip(*grads)]


def test_ddp_after_a_failed_allreduce_every_step_raises(store):
    """A probe's rank stalled past the timeout once: both ranks caught the
    error and went on, and later backwards returned each rank's own
    gradients with no error (the failed round was never closed)."""
    import threading
    n = 2
    inputs = [torch.tensor([[1.0, 2.0, 3.0]]) * (r + 1) for r in range(n)]
    expected = _mean_grads(inputs)
    failed = threading.Event()
    outcomes = [[] for _ in range(n)]
    communicator = communicators(store, n, timeout=2.0)

    def worker(rank):
        comm = communicator(rank)
        m = _two_layers()
        ddp = dtorch.DistributedDataParallel(m, communicator=comm)
        for step in range(3):
            m.zero_grad()
            if step == 0 and rank == 1:
                assert failed.wait(60), "rank 0's first step did not fail"
            try:
                ddp(inputs[rank]).sum().backward()
            except deepnex.DeepnexError as e:
                if rank == 0:
                    failed.set()
                outcomes[rank].append(type(e).__name__)
                continue
            assert all(torch.equal(p.grad, e) for p, e in zip(m.parameters(), expected)), (
                f"rank {rank} step {step}: a backward that returned gave gradients that are "
                f"not the ranks' mean")
            outcomes[rank].append("ok")

    run_workers(n, worker)
    # Rank 1's first allreduce may still meet rank 0's, sent before its
    # timeout; from then on the communicator is broken on both.
    assert outcomes[0][0] == "DeadlineExceededError", outcomes
    assert "ok" not in outcomes[0] + outcomes[1][1:], outcomes


def test_ddp_after_a_backward_that_raised_part_way_says_so_until_rebound(store):
    """A backward that raised after some buckets went out left every later
    backward failing with 'mark_ready(3): already marked this round'."""
    n = 2
    inputs = [torch.tensor([[1.0, 2.0, 3.0]]) * (r + 1) for r in range(n)]
    expected = _mean_grads(inputs)
    communicator = communicators(store, n)
    again = communicators(store, n)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    def worker(rank):
        m = _two_layers()
        ddp = dtorch.DistributedDataParallel(m, communicator=communicator(rank),
                                             bucket_size=4)
        # The last layer's gradients (and allreduces) come before the boom.
        with pytest.raises(RuntimeError, match="boom"):
            m[1](Boom.apply(m[0](inputs[rank]))).sum().backward()
        for call in (lambda: ddp(inputs[rank]),
                     lambda: m(inputs[rank]).sum().backward()):
            with pytest.raises(deepnex.FailedPreconditionError,
                               match="the previous backward did not finish .* out of step "
                                     ".*set_communicator"):
                call()
        ddp.set_communicator(again(rank))
        m.zero_grad()
        ddp(inputs[rank]).sum().backward()
        assert all(torch.equal(p.grad, e) for p, e in zip(m.parameters(), expected))

    run_workers(n, worker)


def test_ddp_ranks_wrapping_different_parameters_are_refused_on_each(store):
    """Without sync_parameters (as TorchState wraps it) nothing compared the
    ranks' models: a probe's rank 0 averaged its gradients with rank 1's of
    other parameters and returned, while rank 1 timed out."""
    n = 2
    for extra in [torch.nn.Linear(1, 1),   # one more parameter
                  None]:                   # the same count, other shapes
        communicator = communicators(store, n)

        def worker(rank):
            m = _two_layers()
            if rank == 1:
                if extra is not None:
                    m.append(extra)
                else:
                    m[1].weight = torch.nn.Parameter(torch.zeros(2, 1))  # (1, 2) on rank 0
            with pytest.raises(deepnex.InvalidArgumentError,
                               match="the ranks wrap different parameters: this rank has "
                                     f"{len(list(m.parameters()))} that require a gradient"):
                dtorch.DistributedDataParallel(m, communicator=communicator(rank),
                                               sync_parameters=False)

        run_workers(n, worker)


def test_ddp_refuses_sparse_gradients_by_name():
    comm = collective.Communicator(0, 1)
    m = torch.nn.Sequential(torch.nn.Embedding(4, 2, sparse=True), torch.nn.Linear(2, 1))
    with pytest.raises(deepnex.InvalidArgumentError,
                       match="'0' has sparse=True: sparse gradients are not supported"):
        dtorch.DistributedDataParallel(m, communicator=comm)


def test_ddp_bucket_size_is_named():
    comm = collective.Communicator(0, 1)
    for bad, why in [(0, "bucket_size: 0 must be at least 1 byte"),
                     ("12XB", 'bucket_size: "12XB" is not a byte size'),
                     (2**63, "bucket_size: 9223372036854775808 is not below 2\\^63 bytes"),
                     (2**70, "bucket_size=1180591620717411303424: more bytes than 64 bits")]:
        with pytest.raises(deepnex.InvalidArgumentError, match=why):
            dtorch.DistributedDataParallel(torch.nn.Linear(2, 1), communicator=comm,
                                           bucket_size=bad)


# --- benchmarks/train_compare ------------------------------------------------

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TRAIN_COMPARE = os.path.join(_ROOT, "benchmarks", "train_compare")


def _train_compare():
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.SourceFileLoader("train_compare", _TRAIN_COMPARE)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_train_compare_runs_each_sizes_repeats_back_to_back():
    tc = _train_compare()
    assert tc.schedule([(64, 1), (512, 2)], ["compute", "ps-sync"], 2) == [
        ((64, 1), "compute", 0), ((64, 1), "ps-sync", 0),
        ((64, 1), "compute", 1), ((64, 1), "ps-sync", 1),
        ((512, 2), "compute", 0), ((512, 2), "ps-sync", 0),
        ((512, 2), "compute", 1), ((512, 2), "ps-sync", 1)]


def test_train_compare_fractions_pair_each_repeat_with_its_own_baseline():
    tc = _train_compare()
    # The host's load came and went between runs: the ratio of the medians
    # would pair the method's loaded 310 with compute-only's quiet 600 (0.52);
    # each repeat's own ratios are 0.75, 0.75 and 0.52, their median 0.75.
    assert tc.paired([600, 300, 310], [800, 400, 600]) == 0.75
    assert tc.paired([10], [4]) == 2.5


def test_train_compare_phases_table():
    import subprocess
    import sys
    out = subprocess.run(
        [sys.executable, _TRAIN_COMPARE, "--sizes", "8x1", "--steps", "3", "--warmup", "1",
         "--repeat", "1", "--methods", "compute,ps-sync", "--phases"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("rank 0's ms per step")))
    assert lines[head + 1].split() == ["parameters", "method", "forward", "backward", "step",
                                       "cpu"]
    rows = [line.split("  ") for line in lines[head + 3:]]
    names = [[c for c in row if c][1].strip() for row in rows]
    assert names == ["compute-only", "deepnex PS sync"]
    for row in rows:
        values = [float(c) for c in [c for c in row if c][2:]]
        assert len(values) == 4 and all(v >= 0 for v in values)


# --- ResumableLoader --------------------------------------------------------


def _loader(sharder, num_workers, batch_size=4, drop_last=False):
    """A DataLoader over the indices themselves: each batch is the indices drawn."""
    return torch.utils.data.DataLoader(list(range(sharder._dataset[0])), batch_size=batch_size,
                                       sampler=sharder, num_workers=num_workers,
                                       drop_last=drop_last)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_checkpoint_taken_mid_epoch_resumes_at_the_first_batch_the_loop_did_not_take(
        num_workers):
    """A DataLoader's workers draw prefetch_factor * num_workers batches
    ahead of the loop: the sharder's own state_dict() counts them as handed
    out, and a resume from it skipped them. The ResumableLoader's
    state_dict() is that of the batches taken: what the loop saw before the
    checkpoint and what it sees after the resume are the epoch, each once,
    in the same world or in another."""
    from deepnex.data import Sharder
    for world in (2, 3):   # resumed in the same world, and in another
        sharder = Sharder(100, 2, 0, seed=4)
        loader = dtorch.ResumableLoader(_loader(sharder, num_workers))
        assert len(loader) == 13
        seen, it = [], iter(loader)
        for _ in range(3):
            seen += next(it).tolist()
        state = loader.state_dict()
        assert state["position"] == 12 and len(loader) == 10
        # The symptom: with workers the sharder has drawn more (prefetch_factor
        # 2 * 2 workers: 4 batches).
        drawn = sharder.state()
        assert drawn == (0, 12) if num_workers == 0 else drawn > (0, 12)
        # Rank 1 of the same world took the same 3 steps.
        seen += Sharder(100, 2, 1, seed=4).indices(0).tolist()[:12]
        del it   # its workers
        # Every rank of the resumed world takes a step, and a checkpoint of
        # that (a re-sharded epoch's in the other world) is resumed by 2.
        loaders = [dtorch.ResumableLoader(_loader(Sharder(100, world, k, seed=4, state=state),
                                                  num_workers)) for k in range(world)]
        steps = [iter(loader) for loader in loaders]
        for step in steps:
            seen += next(step).tolist()
        state = loaders[0].state_dict()
        del steps
        for k in range(2):
            s = Sharder(100, 2, k, seed=4, state=state)
            for batch in dtorch.ResumableLoader(_loader(s, num_workers)):
                seen += batch.tolist()
            assert s.state() == (1, 0)
        assert sorted(seen) == list(range(100))


def test_every_rank_of_a_resharded_epoch_takes_as_many_batches():
    """DDP steps every rank together: in a re-sharded epoch a shard one item
    shorter than the others took a batch fewer through a DataLoader (8
    items left over 3 ranks were 3, 3 and 2: batches of 2 were 2, 2 and 1),
    and the other ranks' last allreduce waited for it for ever. Now the
    shorter shard ends with a repeat of the rest's first item."""
    from deepnex.data import Sharder
    two = [Sharder(10, 2, k, seed=1) for k in range(2)]
    seen = [int(i) for s in two for i in s._s.next(1)]
    loaders = [dtorch.ResumableLoader(_loader(Sharder(10, 3, k, seed=1,
                                                      state=two[0].state_dict()), 0,
                                              batch_size=2)) for k in range(3)]
    assert [len(loader) for loader in loaders] == [2, 2, 2]
    batches = [[b.tolist() for b in loader] for loader in loaders]
    assert [len(b) for b in batches] == [2, 2, 2]
    got = seen + [i for b in batches for batch in b for i in batch]
    assert len(got) == 11 and sorted(set(got)) == list(range(10))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pass_left_early_goes_on_at_its_first_batch_not_taken(num_workers):
    """Leaving a loop over a DataLoader with workers (break) and starting
    another skipped the batches the workers had drawn."""
    from deepnex.data import Sharder
    sharder = Sharder(40, 1, 0, seed=2)
    loader = dtorch.ResumableLoader(_loader(sharder, num_workers, batch_size=3,
                                            drop_last=True))
    seen = []
    for batch in loader:
        seen += batch.tolist()
        if len(seen) == 9:
            break
    assert len(loader) == 10   # 13 batches of 3 in 40 items, 3 taken
    for batch in loader:
        seen += batch.tolist()
    # drop_last: the last item, a short batch, is left out, as a DataLoader does.
    assert seen == sharder.indices(0).tolist()[:39]
    assert sharder.state() == (1, 0) and loader.state_dict()["epoch"] == 1


def test_a_resumable_loader_stands_in_for_its_sharder_in_an_elastic_state(job_env):
    """State(sharder=loader) saves what the loop took; restore() goes back there."""
    from deepnex import elastic
    from deepnex.data import Sharder
    sharder = Sharder(30, 1, 0, seed=5)
    loader = dtorch.ResumableLoader(_loader(sharder, 2, batch_size=5))
    state = elastic.State(sharder=loader, step=0)
    it = iter(loader)
    next(it)
    state.commit()
    next(it)
    state.restore()
    assert sharder.state() == (0, 5)
    assert [b.tolist() for b in loader] == [sharder.indices(0).tolist()[i:i + 5]
                                            for i in range(5, 30, 5)]
    with pytest.raises(deepnex.InvalidArgumentError, match="^loader.sampler: a "
                       "SequentialSampler, not a deepnex.data.Sharder"):
        dtorch.ResumableLoader(torch.utils.data.DataLoader(list(range(4))))
