"""PyTorch integration: ``deepnex.torch``.

Parameter server (BytePS-style)::

    opt = torch.optim.SGD(model.parameters(), lr=0.1)      # used for zero_grad only
    opt = deepnex.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    loss.backward(); opt.step(); opt.zero_grad()

Backward pushes the gradients in buckets as it produces them (last layer
first), each bucket's pull going out with its push (push_pull), and
``step()`` waits for what is still in flight; the servers' optimizer (``deepnex run --optimizer sgd
--lr ...``, or deepnex.ps.Server(optimizer=...)) makes the update, so the
wrapped optimizer's own step and hyperparameters are not used: it is kept for
zero_grad(), param_groups and the code that expects an optimizer. The servers
start from rank 0's parameters, which every worker pulls on construction.

Allreduce (torch DDP-style)::

    model = deepnex.torch.DistributedDataParallel(model)   # broadcasts rank 0's parameters
    loss = loss_fn(model(x), y); loss.backward()           # grads averaged over workers
    opt.step()

Gradients are allreduced in buckets of ``bucket_size`` (25 MiB) as backward
produces them (last layer first), and backward() returns with the averaged
gradients in ``p.grad``, as with torch.nn.parallel.DistributedDataParallel.

``broadcast_parameters(model.state_dict(), root_rank=0)`` copies rank 0's
tensors to every worker, in place.

CPU tensors go through the parameter server and the cpu collectives without
copies; CUDA tensors are staged through host memory for the parameter server
and allreduced one tensor at a time by the nccl communicator (no buckets).
"""

import time
import zlib

import torch

import deepnex
from . import _convert
from . import collective as _collective
from . import data as _data
from . import ps as _ps
from .errors import FailedPreconditionError, InvalidArgumentError, NotFoundError

__all__ = ["DistributedOptimizer", "DistributedDataParallel", "broadcast_parameters",
           "default_communicator", "TorchState", "ResumableLoader"]

_default = {"comm": None}


def default_communicator():
    """The job's communicator of all workers (from deepnex.init()), made on
    first use and shared. In an elastic job: the current membership's
    (state.communicator), which deepnex.elastic.run forms; the world of
    deepnex.init() there is only the one a worker was started for, which
    its peers never meet in."""
    job = _elastic._current_job()
    if job is not None:
        if job.comm is None:
            raise FailedPreconditionError(
                "an elastic job's communicator is its current membership's, formed inside "
                "deepnex.elastic.run (state.communicator); it has none yet (or none at all: "
                "a parameter-server job)")
        return job.comm
    if _default["comm"] is None:
        _default["comm"] = _collective.Communicator.from_context()
    return _default["comm"]


def _named_tensors(params):
    """[(name, tensor)] from a state_dict, a dict, named_parameters() or a
    list of tensors (named by position)."""
    if isinstance(params, dict):
        return list(params.items())
    items = list(params)
    if items and isinstance(items[0], tuple):
        return items
    return [(str(i), t) for i, t in enumerate(items)]


def broadcast_parameters(params, root_rank=0, communicator=None):
    """Overwrites every tensor in `params` (a state_dict, named_parameters(),
    a dict or a list of tensors) with root_rank's, in place; every worker
    must pass the same names, shapes and dtypes in the same order."""
    comm = communicator or default_communicator()
    named = _named_tensors(params)
    for name, t in named:
        if not torch.is_tensor(t):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(t).__name__}, "
                            f"not a tensor")
    # A float32 tensor broadcast into a rank's float64 one took half its
    # bytes, or hung the ranks (probe).
    _check_same_layout([t for _, t in named], comm, [name for name, _ in named],
                       "broadcast_parameters: the ranks pass different tensors", "tensors",
                       "every rank must pass the same names, shapes and dtypes")
    for name, t in named:
        with torch.no_grad():
            data = t.data
            if data.dtype not in _COLLECTIVE_DTYPES:
                _broadcast_bytes(data, root_rank, comm)
            elif data.is_contiguous():
                comm.broadcast(data, root=root_rank)
            else:
                staged = data.contiguous()
                comm.broadcast(staged, root=root_rank)
                data.copy_(staged)


# What the parameter servers hold.
_PS_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# What a communicator moves as it is; other tensors (bool masks, uint8
# tables, complex) are broadcast as their bytes.
_COLLECTIVE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                      torch.int32, torch.int64)


def _broadcast_bytes(data, root_rank, comm):
    raw = data.contiguous().reshape(-1).view(torch.uint8)
    staged = torch.zeros((raw.numel() + 3) // 4 * 4, dtype=torch.uint8)
    staged[:raw.numel()] = raw
    comm.broadcast(staged.view(torch.int32), root=root_rank)
    data.copy_(staged[:raw.numel()].view(data.dtype).reshape(data.shape))


def _param_names(optimizer, named_parameters):
    if named_parameters is not None:
        named = list(named_parameters)
        names = {id(p): n for n, p in named}
        if len(names) != len(named):
            raise InvalidArgumentError("named_parameters: a parameter appears twice")
        if len(set(names.values())) != len(named):
            raise InvalidArgumentError("named_parameters: two parameters share a name")
    else:
        names = {}
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if named_parameters is not None and id(p) not in names:
                raise InvalidArgumentError(
                    f"named_parameters: the optimizer's parameter {i} of group {g} "
                    f"(shape {list(p.shape)}) is not among them")
            out.append((names.get(id(p), f"param_group{g}.{i}"), p))
    return out


class DistributedOptimizer:
    """Wraps `optimizer`: the gradients go to the parameter servers and the
    parameters they return are loaded at step(). See the module's
    documentation.

    named_parameters: model.named_parameters(), whose names become the
    servers' keys (default: "param_group<g>.<i>"). client: a
    deepnex.ps.Client (default: one for this worker from deepnex.init()).
    A parameter without a gradient in a step pushes zeros, so that sync
    rounds still complete. Parameters that do not require a gradient when
    the optimizer is made (a frozen backbone) take root_rank's values then
    and are never pushed: the servers' optimizer (its weight decay) leaves
    them as they are, as torch's does. timeout: seconds ranks other than
    root_rank wait for root_rank's initial parameters.

    overlap (default True): the gradients are pushed in buckets of about
    ``bucket_size`` bytes (default "4MiB") as backward produces them, last
    layer first (as DistributedDataParallel does), each bucket's pull going
    out with its push and served as soon as its round completes, so that
    step() waits only for what is still in flight, loading the first
    layers' buckets first (the next forward pass needs them first). One
    backward per step then, as with DistributedDataParallel: a second
    backward before step() raises, and so does a step() whose gradients
    were changed after backward pushed them (clip_grad_norm_ between
    backward() and step(): they reached the servers unchanged).
    overlap=False pushes everything at step(), for gradients accumulated
    over several backward passes or changed before step().
    """

    def __init__(self, optimizer, named_parameters=None, client=None, root_rank=0,
                 timeout=60.0, bucket_size="4MiB", overlap=True):
        self._optimizer = optimizer
        self._params = _param_names(optimizer, named_parameters)
        # On every rank before anything is sent: root_rank's init would
        # refuse it while the others waited for its parameters.
        for name, p in self._params:
            if p.dtype not in _PS_DTYPES:
                raise InvalidArgumentError(
                    f"DistributedOptimizer: parameter {name!r} is {p.dtype}; the parameter "
                    f"servers hold float32, float64, float16 and bfloat16 tensors (keep it out "
                    f"of the optimizer, or make it a buffer)")
        bucket_bytes = _convert.byte_size(bucket_size, "bucket_size")
        if client is None:
            ctx = deepnex.init()
            client = _ps.Client(ctx.ps_addrs, worker_id=ctx.rank, token=ctx.token or None)
            self._owns_client = True
        else:
            self._owns_client = False
        self.client = client
        # Host tensors the client reads and writes: the parameters themselves
        # on CPU, staging copies for CUDA ones.
        # (contiguous: a channels_last or transposed parameter was refused on
        # root_rank while the other ranks waited for it.)
        self._host = {n: p.data.contiguous() if p.device.type == "cpu" else p.detach().cpu()
                      for n, p in self._params}
        if client.worker_id == root_rank:
            client.init(self._host)
        # Pulls land here, made once: a step allocates no tensors.
        self._pulled = {n: torch.empty(tuple(p.shape), dtype=p.dtype) for n, p in self._params}
        self._buckets = self._make_buckets(bucket_bytes)
        self._bucket_of = {i: b for b, bucket in enumerate(self._buckets) for i in bucket}
        self._reset()
        self._pull_initial(timeout)
        self._load(range(len(self._params)))
        self._hooks = []
        if overlap:
            for i, (_, p) in enumerate(self._params):
                if not p.requires_grad:
                    continue
                # AccumulateGrad runs once p.grad holds the whole gradient.
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                acc.register_hook(self._make_hook(i))
                self._hooks.append(acc)  # keeps the node, and so the hook, alive

    def _make_buckets(self, bucket_bytes):
        """Indices of the parameters that require a gradient, in buckets of
        about bucket_bytes, last parameter first (the order backward
        produces them)."""
        buckets, current, size = [], [], 0
        for i in reversed(range(len(self._params))):
            p = self._params[i][1]
            if not p.requires_grad:
                continue
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(current)
        return buckets

    def _reset(self):
        self._grads = {}
        # name -> (p.grad, its version) as backward pushed it.
        self._pushed = {}
        self._missing = [len(b) for b in self._buckets]
        self._ops = [None] * len(self._buckets)

    def _pull_initial(self, timeout):
        """root_rank's initial parameters, once its init has written them
        all: a tensor is described as soon as root_rank claims it, and its
        parts are there only once they are written, so the pull itself is
        what is retried."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client.pull_into(self._pulled)
                return
            except NotFoundError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _load(self, indices):
        with torch.no_grad():
            for i in indices:
                name, p = self._params[i]
                p.data.copy_(self._pulled[name])

    def _take_grad(self, i):
        name, p = self._params[i]
        if p.grad is not None and p.grad.is_sparse:
            raise InvalidArgumentError(
                f"DistributedOptimizer: parameter {name!r} got a sparse gradient "
                f"(nn.Embedding(sparse=True)?), which the parameter servers do not take: "
                f"make it dense (sparse=False)")
        if p.grad is None:
            g = torch.zeros(tuple(p.shape), dtype=p.dtype)
        elif p.grad.device.type == "cpu":
            g = p.grad.detach().contiguous()
        else:
            g = p.grad.detach().cpu()
        # Kept until the bucket's op is done: the client reads it in place.
        self._grads[name] = g

    def _send(self, b):
        names = [self._params[i][0] for i in self._buckets[b]]
        self._ops[b] = self.client.push_pull_into_async(
            {n: self._grads[n] for n in names}, {n: self._pulled[n] for n in names})

    def _make_hook(self, i):
        def hook(*unused):
            b = self._bucket_of[i]
            if self._params[i][0] in self._grads:
                raise InvalidArgumentError(
                    f"DistributedOptimizer: a second backward before step() "
                    f"({self._params[i][0]!r} got its gradient twice); its first "
                    f"gradient is already pushed. Pass overlap=False to accumulate "
                    f"gradients over several backward passes")
            self._take_grad(i)
            grad = self._params[i][1].grad
            if grad is not None:
                self._pushed[self._params[i][0]] = (grad, grad._version)
            self._missing[b] -= 1
            if self._missing[b] == 0:
                self._send(b)
        return hook

    def step(self, closure=None):
        """Pushes the gradients not yet pushed, waits for the servers' new
        parameters and loads them; returns the closure's loss if one is
        given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            for b, bucket in enumerate(self._buckets):
                if self._ops[b] is None:
                    for i in bucket:
                        if self._params[i][0] not in self._grads:
                            self._take_grad(i)
                    self._send(b)
            # The first layers' buckets were pushed last: load them first.
            for b in reversed(range(len(self._buckets))):
                self._ops[b].wait()
                self._load(self._buckets[b])
            # After the step, which the other workers' rounds wait for.
            changed = [name for name, p in self._params if name in self._pushed and (
                p.grad is not self._pushed[name][0] or p.grad._version != self._pushed[name][1])]
            if changed:
                raise InvalidArgumentError(
                    f"DistributedOptimizer: the gradient of "
                    f"{', '.join(repr(n) for n in changed[:8])}{', ...' if changed[8:] else ''} "
                    f"changed after backward pushed it (clip_grad_norm_ or another change "
                    f"between backward() and step()), so the servers applied it unchanged; pass "
                    f"overlap=False to change gradients before step()")
        finally:
            for op in self._ops:
                if op is not None and not op.done():
                    try:
                        op.wait()
                    except Exception:  # the first error is the one raised
                        pass
            self._reset()
        return loss

    def synchronize(self):
        """Nothing to wait for: step() returns with the new parameters. (To
        change gradients before they are pushed, as Horovod's
        synchronize() allows, pass overlap=False.)"""

    def zero_grad(self, *args, **kwargs):
        self._optimizer.zero_grad(*args, **kwargs)

    def close(self):
        """Leaves the job (the servers stop waiting for this worker)."""
        if self._owns_client:
            self.client.close()

    @property
    def param_groups(self):
        return self._optimizer.param_groups

    def state_dict(self):
        return self._optimizer.state_dict()

    def load_state_dict(self, state):
        self._optimizer.load_state_dict(state)


class DistributedDataParallel(torch.nn.Module):
    """Wraps `module` so that backward() averages its gradients over the
    job's workers, allreducing them in buckets as they are produced.

    communicator: a deepnex.collective.Communicator (default: the job's,
    default_communicator(); in an elastic job made before its first
    membership, none until TorchState binds it to each). bucket_size: bytes
    or "25MiB".
    sync_parameters: first copy rank 0's parameters and buffers to every
    worker (as torch's DDP does). One backward per optimizer step: gradient accumulation over
    several backward passes would allreduce each of them.

    Every rank must wrap the same parameters (checked when it is made). A
    failed allreduce raises from backward(), and so does every later one
    (the communicator is broken). A backward that raised part-way (after
    some buckets went out) leaves this rank out of step with the others:
    the next forward or backward raises FailedPreconditionError, as torch's
    DDP does, until set_communicator() binds a new communicator.
    Sparse gradients (nn.Embedding(sparse=True)) are not supported.
    """

    def __init__(self, module, communicator=None, bucket_size="25MiB",
                 sync_parameters=True):
        super().__init__()
        # Before any collective: a bad argument fails every rank alike.
        self._bucketer_bytes = _convert.byte_size(bucket_size, "bucket_size")
        if self._bucketer_bytes < 1:
            raise InvalidArgumentError(f"bucket_size: {bucket_size!r} must be at least 1 byte")
        if self._bucketer_bytes >= 2**63:
            raise InvalidArgumentError(f"bucket_size: {bucket_size!r} is not below 2^63 bytes")
        self.module = module
        # An elastic job's, made before its first membership (a script
        # written for a fixed world): TorchState binds it to each one.
        job = _elastic._current_job()
        unbound = communicator is None and job is not None and job.comm is None
        self.communicator = None if unbound else communicator or default_communicator()
        self._params = [p for p in module.parameters() if p.requires_grad]
        if not self._params:
            raise InvalidArgumentError("DistributedDataParallel: the module has no "
                                       "parameter that requires a gradient")
        for name, m in module.named_modules():
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
                raise InvalidArgumentError(
                    f"DistributedDataParallel: {name or type(m).__name__!r} has sparse=True: "
                    f"sparse gradients are not supported (make it sparse=False)")
        if not unbound:
            _check_same_parameters(self._params, self.communicator)
            if sync_parameters:
                broadcast_parameters(module.state_dict(), 0, self.communicator)
        self._cuda = self._params[0].device.type == "cuda"
        if any((p.device.type == "cuda") != self._cuda for p in self._params):
            raise InvalidArgumentError("DistributedDataParallel: parameters on CPU and CUDA mixed")
        # The bucketer works on fixed tensors: each parameter's gradient
        # lives in a buffer of ours, which p.grad is made to be.
        # Contiguous whatever p's layout (channels_last, a transposed view):
        # the bucketer reads them as flat arrays.
        self._grads = [torch.zeros_like(p, memory_format=torch.contiguous_format)
                       for p in self._params]
        self._bucketer = None if self._cuda or unbound else _collective.GradientBucketer(
            self.communicator, self._grads, bucket_bytes=self._bucketer_bytes, op="mean")
        self._works = []
        self._ready = [False] * len(self._params)
        self._pending = False
        # Why this rank cannot go on (None: it can).
        self._broken = None if not unbound else (
            "DistributedDataParallel: no communicator yet: in an elastic job it is bound to "
            "each membership inside deepnex.elastic.run (give it to TorchState)")
        self._hooks = []
        for i, p in enumerate(self._params):
            # AccumulateGrad runs after the gradient has been added to p.grad.
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(self._make_hook(i))
            self._hooks.append(acc)  # keeps the node, and so the hook, alive

    def forward(self, *args, **kwargs):
        if self._pending:
            self._break(_UNFINISHED)
        self._check()
        return self.module(*args, **kwargs)

    def _break(self, why):
        self._broken = (f"DistributedDataParallel: {why}, so this rank is out of step with the "
                        f"others; bind a new communicator with set_communicator() (as "
                        f"deepnex.elastic does at a resize)")
        self._check()

    def _check(self):
        if self._broken is not None:
            raise FailedPreconditionError(self._broken)

    def set_communicator(self, communicator):
        """Allreduces through `communicator` from now on (an elastic job's
        new membership); a step broken by the old one is dropped. A
        collective: every rank of the new communicator calls it (or makes
        its DistributedDataParallel), which checks they wrap the same
        parameters."""
        _check_same_parameters(self._params, communicator)
        self.communicator = communicator
        if not self._cuda:
            self._bucketer = _collective.GradientBucketer(
                communicator, self._grads, bucket_bytes=self._bucketer_bytes, op="mean")
        self._works = []
        self._ready = [False] * len(self._params)
        self._pending = False
        self._broken = None

    def _adopt(self, i):
        p, buf = self._params[i], self._grads[i]
        if p.grad is not None and p.grad.is_sparse:
            self._break(f"parameter {i} got a sparse gradient, which is not supported")
        if p.grad is None:
            buf.zero_()
        elif p.grad is not buf:
            buf.copy_(p.grad)
        p.grad = buf

    def _make_hook(self, i):
        def hook(*unused):
            self._check()
            if self._ready[i]:
                # Its backward did not reach synchronize (the module was
                # called directly, not through forward()).
                self._break(_UNFINISHED)
            if not self._pending:
                self._pending = True
                torch.autograd.Variable._execution_engine.queue_callback(self.synchronize)
            self._adopt(i)
            self._ready[i] = True
            if self._cuda:
                self._works.append(self.communicator.allreduce_async(self._grads[i], op="mean"))
            else:
                self._bucketer.mark_ready(i)
        return hook

    def synchronize(self):
        """Waits for this step's allreduces (backward() calls it at its end);
        parameters that got no gradient contribute zeros."""
        if not self._pending:
            return
        try:
            for i, ready in enumerate(self._ready):
                if not ready:
                    self._adopt(i)
                    if self._cuda:
                        self._works.append(
                            self.communicator.allreduce_async(self._grads[i], op="mean"))
            if self._cuda:
                for w in self._works:
                    w.wait()
            else:
                self._bucketer.mark_all_ready()
                self._bucketer.wait()
        finally:
            # Failed or not, the round is over (the bucketer's too): a broken
            # communicator fails the next one as well, rather than leaving
            # it unwaited with the local gradients in place.
            self._works = []
            self._ready = [False] * len(self._params)
            self._pending = False


_UNFINISHED = ("the previous backward did not finish (it raised after some gradients' "
               "allreduces had started)")


def _check_same_parameters(params, communicator):
    """Every rank must wrap the same parameters, in the same order: bucket
    i of one rank is reduced with bucket i of the others whatever it holds
    (torch's DDP checks this when it is made, too)."""
    _check_same_layout(params, communicator, (),
                       "DistributedDataParallel: the ranks wrap different parameters",
                       "that require a gradient", "every rank must wrap the same model")


def _check_same_layout(tensors, communicator, names, what, counted, must):
    """InvalidArgumentError on every rank where the ranks' `tensors` (and
    `names`) differ in count, elements, shapes or dtypes: one allreduce."""
    layout = ";".join([*names, *(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)])
    mine = [len(tensors), sum(t.numel() for t in tensors), zlib.crc32(layout.encode())]
    # One allreduce: the max of each value and of its negation (the min).
    device = tensors[0].device if tensors else "cpu"
    both = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=device)
    communicator.allreduce(both, op="max")
    high, low = both[:3].tolist(), [-v for v in both[3:].tolist()]
    if high != low:
        raise InvalidArgumentError(
            f"{what}: this rank has {mine[0]} {counted} ({mine[1]} elements), the ranks "
            f"{low[0]}-{high[0]} ({low[1]}-{high[1]} elements)"
            f"{', in different names, shapes or dtypes' if low[:2] == high[:2] else ''}; "
            f"{must}")


# --- Data loading (deepnex.data) -------------------------------------------


class ResumableLoader:
    """A torch DataLoader over a deepnex.data.Sharder whose state_dict() is
    that of the batches the loop has taken, not of those its workers drew::

        loader = deepnex.torch.ResumableLoader(torch.utils.data.DataLoader(
            dataset, batch_size=64, sampler=sharder, num_workers=4))
        for x, y in loader:
            ...
            checkpoint["data"] = loader.state_dict()   # resumes at the next batch

    A DataLoader with workers draws prefetch_factor * num_workers batches of
    indices ahead of the loop, so the sharder's own state_dict() counts them
    as handed out, and a resume from it skipped them. Here a pass over the
    loader notes where the sharder stood when it began and counts the
    batches taken, batch_size positions each (the last may be shorter), and
    a pass left early (break) puts the sharder back at its first batch not
    taken when the next pass begins. A resume is ``Sharder(..., state=s)``
    or load_state_dict(s), in this world or another.

    num_shards, shard, reshard() and load_state_dict() are the sharder's, so
    the loader stands in for it in ``deepnex.elastic.State(sharder=loader)``
    (TorchState too). len() is the batches a pass begun now yields, the
    same on every rank (a re-sharded epoch's shards are as long as each
    other), as DDP needs.
    """

    def __init__(self, loader):
        sampler = getattr(loader, "sampler", None)
        if not isinstance(sampler, _data.Sharder):
            raise InvalidArgumentError(
                f"loader.sampler: a {type(sampler).__name__}, not a deepnex.data.Sharder "
                "(DataLoader(dataset, batch_size, sampler=sharder))")
        self.loader = loader
        self.sharder = sampler
        # batch_size None: no batching, one index a batch.
        self._per_batch = loader.batch_size or 1
        # The pass under way: {"start": the sharder's state_dict() when it
        # began, "length": that epoch's positions, "len": its batches,
        # "batches": those taken, "cursor": the sharder's state() after the
        # last draw, to tell whether anyone else has moved it since}.
        self._pass = None

    @property
    def num_shards(self):
        return self.sharder.num_shards

    @property
    def shard(self):
        return self.sharder.shard

    def __len__(self):
        taken = self._current()
        return len(self.loader) if taken is None else taken["len"] - taken["batches"]

    def __iter__(self):
        self._rewind()
        taken = {"start": self.sharder.state_dict(), "length": self.sharder.epoch_length,
                 "len": len(self.loader), "batches": 0, "cursor": self.sharder.state()}
        self._pass = taken
        batches = iter(self.loader)  # workers start drawing here
        taken["cursor"] = self.sharder.state()
        for batch in batches:
            taken["batches"] += 1
            taken["cursor"] = self.sharder.state()
            yield batch
        if self._pass is taken:
            self._pass = None

    def _current(self):
        """The pass under way, or None (none, or the sharder was moved since)."""
        taken = self._pass
        if taken is None or self.sharder.state() != taken["cursor"]:
            return None
        return taken

    def _rewind(self):
        """Puts the sharder back at the first batch a pass left early did not take."""
        taken = self._current()
        self._pass = None
        if taken is not None:
            self.sharder.load_state_dict(self._taken_state(taken))

    def _taken_state(self, taken):
        position = taken["start"]["position"] + taken["batches"] * self._per_batch
        # The epoch's last position reached: its end, which a resume takes as
        # the next epoch's start.
        return dict(taken["start"], position=min(position, taken["length"]),
                    ranges=list(taken["start"]["ranges"]))

    def state_dict(self):
        """The sharder's state_dict() after the batches the loop has taken."""
        taken = self._current()
        return self.sharder.state_dict() if taken is None else self._taken_state(taken)

    def load_state_dict(self, state):
        """The sharder's load_state_dict(); a pass under way is dropped."""
        self._pass = None
        self.sharder.load_state_dict(state)

    def reshard(self, num_shards, shard, state=None):
        """The sharder's reshard(), from state_dict() by default."""
        if state is None:
            state = self.state_dict()
        self._pass = None
        self.sharder.reshard(num_shards, shard, state)


# --- Elastic training (deepnex.elastic) -------------------------------------


import copy as _copy  # noqa: E402
import io as _io  # noqa: E402

from . import elastic as _elastic  # noqa: E402


class TorchState(_elastic.State):
    """deepnex.elastic.State with a model and an optimizer (as Horovod's
    hvd.elastic.TorchState): ``TorchState(model, optimizer, sharder=s,
    epoch=0)``. commit() keeps copies of the model's and the optimizer's
    state_dict(); a resize broadcasts rank 0's (parameters exactly, the
    optimizer's state such as momentum buffers included).

    Allreduce mode: at the first membership ``state.model`` becomes a
    DistributedDataParallel of the module (or stays the one given, which
    may have been made before), bound to that membership's communicator
    and re-bound at each resize: call ``state.model(x)``. In PS mode the servers hold the parameters: only
    the counters and the data position are synced."""

    def __init__(self, model=None, optimizer=None, sharder=None, **counters):
        self.model = model
        self.optimizer = optimizer
        super().__init__(sharder=sharder, **counters)

    def _module(self):
        m = self.model
        return m.module if isinstance(m, DistributedDataParallel) else m

    def _capture(self, full=True):
        out = super()._capture(full)
        if full and self.model is not None:
            out["model"] = {k: v.detach().clone() for k, v in self._module().state_dict().items()}
        if full and self.optimizer is not None:
            out["optimizer"] = _copy.deepcopy(self.optimizer.state_dict())
        return out

    def _apply(self, snapshot, world=None):
        super()._apply(snapshot, world)
        if "model" in snapshot:
            self._module().load_state_dict(snapshot["model"])
        if "optimizer" in snapshot:
            self.optimizer.load_state_dict(snapshot["optimizer"])

    def _dumps(self, snapshot):
        buf = _io.BytesIO()
        torch.save(snapshot, buf)
        return buf.getvalue()

    def _loads(self, payload):
        return torch.load(_io.BytesIO(payload), weights_only=False)

    def _on_communicator(self, comm):
        if comm is None or self.model is None:
            return
        if isinstance(self.model, DistributedDataParallel):
            self.model.set_communicator(comm)
        else:
            # The state's broadcast syncs the parameters.
            self.model = DistributedDataParallel(self.model, communicator=comm,
                                                 sync_parameters=False)
