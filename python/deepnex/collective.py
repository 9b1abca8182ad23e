"""Collectives: ``deepnex.collective.Store``, ``StoreClient`` and ``Communicator``.

A rendezvous store lets the ranks of a job find each other; a communicator
runs allreduce, broadcast, allgather, reduce_scatter and barrier among them::

    store = deepnex.collective.Store("127.0.0.1:0")        # serving on return
    comm = deepnex.collective.Communicator(rank, world_size, store=store.address)
    comm.allreduce(grad, op="mean")                         # in place
    gathered = comm.allgather(x)                            # (world_size, *x.shape)
    work = comm.allreduce_async(grad); work.wait(timeout=10)

Arrays are numpy arrays or CPU torch tensors, used without copies: a wrong
dtype, a non-contiguous array or a read-only output raises
``InvalidArgumentError`` (a ``ValueError``) instead of copying.
"""

import operator

import numpy as np

from . import _C
from ._convert import byte_size, number, options, to_buffer
from .errors import InvalidArgumentError

__all__ = ["Store", "StoreClient", "Communicator", "Work", "GradientBucketer"]

# C++'s defaults, which the keyword defaults below show.
_SERVER = _C.collective.StoreServerOptions()
_CLIENT = _C.collective.StoreClientOptions()
_COMM = _C.collective.CommunicatorOptions()
_BUCKET = _C.collective.BucketOptions()


def _seconds(timeout, default):
    return number(default if timeout is None else timeout, "timeout")


class Store:
    """A rendezvous store served from this process until ``stop()``.

    ``advertise`` is the host peers dial, put in ``address`` (default: the
    listen host; for "0.0.0.0" or "[::]" this host's primary address)."""

    def __init__(self, address=_SERVER.address, token=None, token_file=None,
                 max_value_bytes=_SERVER.max_value_bytes, advertise=None,
                 max_bytes=_SERVER.max_bytes):
        self._server = _C.collective.StoreServer(options(
            _C.collective.StoreServerOptions, address=address, token=token or "",
            token_file=token_file or "", max_value_bytes=int(max_value_bytes),
            advertise=advertise or "", max_bytes=int(max_bytes)))

    @property
    def address(self):
        """host:port, with the port the OS picked for port 0."""
        return self._server.address

    @property
    def port(self):
        return self._server.port

    def __len__(self):
        return len(self._server)

    def stop(self):
        self._server.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class StoreClient:
    """A connection to a store. Keys are prefixed with ``prefix + "/"``.

    Values are bytes (str is encoded as UTF-8). ``get`` and ``wait`` wait up
    to ``timeout`` seconds (default: the client's) for missing keys, then raise
    ``DeadlineExceededError`` (a ``TimeoutError``) naming them.
    """

    def __init__(self, address, prefix=_CLIENT.prefix, timeout=_CLIENT.timeout, token=None,
                 token_file=None):
        self._timeout = number(timeout, "timeout")
        self._client = _C.collective.StoreClient(options(
            _C.collective.StoreClientOptions, address=address, prefix=prefix,
            timeout=self._timeout, token=token or "", token_file=token_file or ""))

    @staticmethod
    def _bytes(value):
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key, value):
        self._client.set(key, self._bytes(value))

    def get(self, key, timeout=None):
        return self._client.get([key], _seconds(timeout, self._timeout))[0]

    def multi_get(self, keys, timeout=None):
        return self._client.get(list(keys), _seconds(timeout, self._timeout))

    def add(self, key, delta=1):
        delta = int(delta)
        if not -2**63 <= delta < 2**63:
            raise InvalidArgumentError(f"store add: delta={delta}: must fit int64")
        return self._client.add(key, delta)

    def compare_set(self, key, expected, desired):
        """Sets key to desired if its value is expected (or it is missing and
        expected is empty); returns the value after the call."""
        return self._client.compare_set(key, self._bytes(expected), self._bytes(desired))

    def delete(self, key):
        return self._client.delete(key)

    def wait(self, keys, timeout=None):
        self._client.wait(list(keys), _seconds(timeout, self._timeout))

    def check(self, keys):
        return self._client.check(list(keys))

    @property
    def address(self):
        return self._client.address


_TORCH_DTYPES = {"float32": "float32", "float64": "float64", "float16": "float16",
                 "bfloat16": "bfloat16", "int32": "int32", "int64": "int64"}


def _cuda(x):
    """A CUDA torch tensor's (address, dtype name, numel), after the work
    queued on torch's current stream (which wrote x) has finished."""
    if not x.is_contiguous():
        raise InvalidArgumentError("the tensor is not contiguous; deepnex never copies: "
                                   "pass x.contiguous()")
    name = str(x.dtype).replace("torch.", "")
    if name not in _TORCH_DTYPES:
        raise InvalidArgumentError(f"dtype {name} is not supported")
    import torch
    torch.cuda.current_stream(x.device).synchronize()
    return x.data_ptr(), name, x.numel()


def _is_cuda(x):
    return type(x).__module__.startswith("torch") and x.device.type == "cuda"


def _empty_like(x, shape):
    if isinstance(x, np.ndarray):
        return np.empty(shape, dtype=x.dtype)
    import torch
    return torch.empty(shape, dtype=x.dtype, device=x.device)


class Work:
    """A collective in flight: ``wait(timeout=None)`` returns its result (the
    tensor or array) or raises its error; ``TimeoutError``
    (DeadlineExceededError) if it is still running then."""

    def __init__(self, work, result=None, keep=None):
        self._work = work
        self._result = result
        self._keep = keep  # an input the collective reads (CUDA tensors)

    def wait(self, timeout=None):
        self._work.wait(timeout)
        return self._result

    def done(self):
        return self._work.done()


class Communicator:
    """This process's member of a communicator of ``world_size`` ranks.

    store: host:port of the rendezvous store; prefix: the communicator's
    namespace there (communicators sharing a store at once need different
    prefixes). backend: "auto" (host arrays and tensors go through the cpu
    backend; CUDA tensors through an nccl communicator of the same ranks,
    created at the first CUDA collective, as torch's "cpu:gloo,cuda:nccl"
    does), "cpu" or "nccl". timeout: seconds
    for init and for each collective. transport (cpu): "auto" (shared memory
    between ranks on one host that can open each other's segments, TCP
    otherwise), "tcp" or "shm"; the variable DEEPNEX_COLLECTIVE_TRANSPORT
    overrides it. host (cpu): the address other ranks reach this one at
    (default: this host's address on the route to the store).
    """

    def __init__(self, rank, world_size, store=_COMM.store, backend=_COMM.backend,
                 timeout=_COMM.timeout, prefix=_COMM.prefix, transport=_COMM.transport,
                 connections_per_peer=_COMM.connections_per_peer,
                 shm_channels=_COMM.shm_channels, token=None, token_file=None,
                 device=_COMM.device, host=None):
        args = dict(rank=int(rank), world_size=int(world_size), store=store, prefix=prefix,
                    backend=backend, timeout=number(timeout, "timeout"), transport=transport,
                    connections_per_peer=int(connections_per_peer),
                    shm_channels=int(shm_channels), token=token or "",
                    token_file=token_file or "", device=int(device), host=host or "")
        self._comm = _C.collective.Communicator(options(_C.collective.CommunicatorOptions, **args))
        self._nccl = None
        self._nccl_args = None
        if backend == "auto":
            self._nccl_args = dict(args, backend="nccl", prefix=f"{prefix}/nccl")

    def _cuda_comm(self):
        """The communicator CUDA tensors go through: this one, or with
        backend "auto" the nccl one, made on first use. Every rank makes it
        in the same collective, so the rendezvous lines up."""
        if self._nccl_args is None:
            return self._comm
        if self._nccl is None:
            self._nccl = _C.collective.Communicator(
                options(_C.collective.CommunicatorOptions, **self._nccl_args))
        return self._nccl

    @classmethod
    def from_context(cls, context=None, **kwargs):
        """A communicator of the job's workers, from ``deepnex.init()``'s
        context (rank, world size, store address, token)."""
        if context is None:
            from . import init
            context = init()
        kwargs.setdefault("token", getattr(context, "token", None) or None)
        kwargs.setdefault("prefix", getattr(context, "job_id", "") or "deepnex")
        return cls(context.rank, context.world_size, store=context.store_addr, **kwargs)

    rank = property(lambda self: self._comm.rank)
    world_size = property(lambda self: self._comm.world_size)
    backend = property(lambda self: self._comm.backend)
    transport = property(lambda self: self._comm.transport)

    def _issue(self, kind, x, issue):
        """Returns issue(), which checks this rank's arguments and then
        issues collective `kind`. Where it raises, nothing was issued: this
        rank still takes its part, as a call every rank refuses, so that the
        others fail with InvalidArgument too and all stay in step. (Skipped,
        a probe's rank 1 met rank 0's next call: its sum of 1 + 2 came back
        as 12 with no error, and rank 0's later sums were wrong too.)"""
        try:
            return issue()
        except Exception:
            try:
                comm = self._cuda_comm() if _is_cuda(x) else self._comm
            except Exception:  # x is not even a tensor
                comm = self._comm
            comm.refuse(kind)
            raise

    def allreduce_async(self, x, op="sum"):
        def issue():
            if _is_cuda(x):
                ptr, dtype, n = _cuda(x)
                return Work(self._cuda_comm().allreduce_raw_async(ptr, dtype, n, _op(op)), x)
            b, dtype = to_buffer(x, "allreduce")
            return Work(self._comm.allreduce_async(b, dtype, _op(op)), x)
        return self._issue("allreduce", x, issue)

    def broadcast_async(self, x, root=0):
        def issue():
            r = int(root)
            # The communicator refuses a root outside the ranks on every rank;
            # one past an int32 would not reach it.
            if not -2**31 <= r < 2**31:
                raise InvalidArgumentError(f"broadcast: root {r} is outside "
                                           f"0..{self.world_size - 1}")
            if _is_cuda(x):
                ptr, dtype, n = _cuda(x)
                return Work(self._cuda_comm().broadcast_raw_async(ptr, dtype, n, r), x)
            b, dtype = to_buffer(x, "broadcast")
            return Work(self._comm.broadcast_async(b, dtype, r), x)
        return self._issue("broadcast", x, issue)

    def allgather_async(self, x):
        def issue():
            if not _is_cuda(x):
                to_buffer(x, "allgather")  # what x is not, before its shape is read
            out = _empty_like(x, (self.world_size, *tuple(x.shape)))
            if _is_cuda(x):
                ptr, dtype, n = _cuda(x)
                return Work(self._cuda_comm().allgather_raw_async(ptr, out.data_ptr(), dtype, n),
                            out, keep=x)
            bi, dtype = to_buffer(x, "allgather")
            bo, _ = to_buffer(out, "allgather")
            return Work(self._comm.allgather_async(bi, bo, dtype), out)
        return self._issue("allgather", x, issue)

    def reduce_scatter_async(self, x, op="sum"):
        def issue():
            if not _is_cuda(x):
                to_buffer(x, "reduce_scatter")  # what x is not, before its shape is read
            shape = tuple(x.shape)
            if not shape or shape[0] % self.world_size:
                raise InvalidArgumentError(
                    f"reduce_scatter: the first dimension of a {list(shape)} tensor must be a "
                    f"multiple of world_size {self.world_size}")
            out = _empty_like(x, (shape[0] // self.world_size, *shape[1:]))
            if _is_cuda(x):
                ptr, dtype, _ = _cuda(x)
                return Work(self._cuda_comm().reduce_scatter_raw_async(
                    ptr, out.data_ptr(), dtype, out.numel(), _op(op)), out, keep=x)
            bi, dtype = to_buffer(x, "reduce_scatter")
            bo, _ = to_buffer(out, "reduce_scatter")
            return Work(self._comm.reduce_scatter_async(bi, bo, dtype, _op(op)), out)
        return self._issue("reduce_scatter", x, issue)

    def barrier_async(self):
        return Work(self._comm.barrier_async())

    def allreduce(self, x, op="sum"):
        """In place; returns x."""
        return self.allreduce_async(x, op).wait()

    def broadcast(self, x, root=0):
        """In place: every rank ends with root's x; returns x."""
        return self.broadcast_async(x, root).wait()

    def allgather(self, x):
        """A new array (world_size, *x.shape) of every rank's x."""
        return self.allgather_async(x).wait()

    def reduce_scatter(self, x, op="sum"):
        """x's first dimension is split into world_size blocks; returns the
        reduction of block `rank` over all ranks."""
        return self.reduce_scatter_async(x, op).wait()

    def barrier(self):
        self.barrier_async().wait()

    def abort(self):
        """Breaks the communicator; the other ranks see this rank leave."""
        self._comm.abort()
        if self._nccl is not None:
            self._nccl.abort()


def _op(op):
    """A reduction's name as the communicator takes it; anything but a
    string is refused as the communicator refuses an unknown name."""
    if not isinstance(op, str):
        raise InvalidArgumentError(f"op: {op!r} is not a name (one of sum, mean, max, min, prod)")
    return op


class GradientBucketer:
    """Allreduces many tensors (e.g. gradients) in buckets of about
    ``bucket_bytes`` (default 25 MiB), bucket by bucket and asynchronously, as
    PyTorch DDP does. Buckets fill in reverse order of ``tensors`` (backward
    produces gradients last layer first) and start, in order, as soon as all
    their tensors are marked ready; ``wait()`` writes the results back::

        b = GradientBucketer(comm, [p.grad for p in model.parameters()])
        # from backward hooks: b.mark_ready(i) ... or at the end:
        b.mark_all_ready()
        b.wait()                      # grads now hold the mean over ranks

    CPU arrays/tensors; they must stay the same objects across rounds.
    """

    def __init__(self, comm, tensors, bucket_bytes=_BUCKET.bucket_bytes, op=_BUCKET.op):
        args = [to_buffer(t, f"tensor {i}") for i, t in enumerate(tensors)]
        self._tensors = list(tensors)
        self._b = _C.collective.GradientBucketer(
            comm._comm, args, options(_C.collective.BucketOptions,
                                      bucket_bytes=byte_size(bucket_bytes, "bucket_bytes"), op=op))

    def mark_ready(self, index):
        index = operator.index(index)
        if index < 0:
            raise InvalidArgumentError(f"mark_ready({index}): an index is 0 or more")
        self._b.mark_ready(index)

    def mark_all_ready(self):
        self._b.mark_all_ready()

    def wait(self):
        self._b.wait()

    @property
    def num_buckets(self):
        return self._b.num_buckets

    @property
    def bucket_of(self):
        return list(self._b.bucket_of)
