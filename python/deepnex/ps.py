"""Parameter server: ``deepnex.ps.Server`` and ``deepnex.ps.Client``.

A server holds partitions of named dense tensors and applies a server-side
optimizer to the gradients workers push::

    server = deepnex.ps.Server(address="127.0.0.1:0", mode="sync", num_workers=2,
                               optimizer=deepnex.ps.SGD(lr=0.1))
    client = deepnex.ps.Client([server.address], worker_id=0)
    client.init({"w": np.zeros((4, 3), np.float32)})
    client.push({"w": grad})
    params = client.pull(["w"])

Arrays are numpy arrays or CPU torch tensors, passed without copies: a wrong
dtype, a non-contiguous array or a read-only output raises
``InvalidArgumentError`` (a ``ValueError``) instead of copying.
"""

import threading
from dataclasses import dataclass, fields

import numpy as np

from . import _C
from ._convert import byte_size, not_utf8, number, options, to_buffer
from .errors import DeepnexError, InvalidArgumentError

__all__ = [
    "Server", "Client", "PendingOp",
    "SGD", "Adam", "AdamW", "Adagrad", "Sum", "Assign",
]

# Fresh C++ option structs: the keyword defaults below are theirs.
_SERVER = _C.ps.ServerOptions()
_CLIENT = _C.ps.ClientOptions()


# ---- optimizers (applied by the server)

class _Optimizer:
    """Refuses a bool for a number at construction: float() takes it, and
    a probe's SGD(lr=True) trained at lr 1."""

    def __post_init__(self):
        for f in fields(self):
            if f.type in (bool, "bool"):
                continue
            value = getattr(self, f.name)
            for x in value if isinstance(value, tuple) else (value,):
                number(x, f"{type(self).__name__}.{f.name}")


@dataclass(frozen=True)
class SGD(_Optimizer):
    """torch.optim.SGD's rule: momentum, Nesterov and L2 weight decay."""
    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def _config(self):
        return _C.ps.OptimizerConfig("sgd", lr=self.lr, momentum=self.momentum,
                                     nesterov=self.nesterov,
                                     weight_decay=self.weight_decay)


@dataclass(frozen=True)
class Adam(_Optimizer):
    """torch.optim.Adam's rule; weight_decay is L2 added to the gradient."""
    lr: float = 0.001
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    _kind = "adam"

    def _config(self):
        return _C.ps.OptimizerConfig(self._kind, lr=self.lr, beta1=self.betas[0],
                                     beta2=self.betas[1], eps=self.eps,
                                     weight_decay=self.weight_decay)


@dataclass(frozen=True)
class AdamW(Adam):
    """torch.optim.AdamW's rule: decoupled weight decay (default 0.01)."""
    weight_decay: float = 0.01
    _kind = "adamw"


@dataclass(frozen=True)
class Adagrad(_Optimizer):
    """torch.optim.Adagrad's rule."""
    lr: float = 0.01
    eps: float = 1e-10
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0

    def _config(self):
        return _C.ps.OptimizerConfig(
            "adagrad", lr=self.lr, eps=self.eps, weight_decay=self.weight_decay,
            initial_accumulator=self.initial_accumulator_value)


@dataclass(frozen=True)
class Sum(_Optimizer):
    """Pure aggregation: values += the round's aggregate (or each push)."""

    def _config(self):
        return _C.ps.OptimizerConfig("sum")


@dataclass(frozen=True)
class Assign(_Optimizer):
    """values = the round's aggregate (async: the latest push)."""

    def _config(self):
        return _C.ps.OptimizerConfig("assign")


_OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": AdamW, "adagrad": Adagrad,
               "sum": Sum, "assign": Assign}


def _optimizer_config(optimizer):
    if optimizer is None:
        optimizer = SGD()
    elif isinstance(optimizer, str):
        if optimizer not in _OPTIMIZERS:
            raise InvalidArgumentError(f"optimizer: unknown {optimizer!r} "
                                       f"(one of {', '.join(_OPTIMIZERS)})")
        optimizer = _OPTIMIZERS[optimizer]()
    if not hasattr(optimizer, "_config"):
        raise TypeError(f"optimizer: expected deepnex.ps.SGD, Adam, ... or a name, "
                        f"got {type(optimizer).__name__}")
    return optimizer._config()


# ---- arrays in and out

def _text(text, what):
    """`text`, refused naming `what` where it is a str the C++ layer cannot
    take: one with a lone surrogate (as os.fsdecode makes of bytes that are
    not UTF-8) failed inside pybind11 with "incompatible function
    arguments". Bytes go on to the C++ layer, which checks them."""
    if isinstance(text, str) and not_utf8(text) is not None:
        raise InvalidArgumentError(f"{what} {text!r} is not UTF-8 text")
    return text


def _key(key, op):
    return _text(key, f"{op}: key")


def _buffers(tensors, op, known=None):
    """The C++ layer's arguments for `op`; numpy has no bfloat16, so uint16
    arrays stand for the keys `known` says are bfloat16."""
    if not isinstance(tensors, dict):
        raise TypeError(f"expected a dict of name -> array, got {type(tensors).__name__}")
    args = [(_key(k, op), *to_buffer(v, repr(k))) for k, v in tensors.items()]
    if known:
        args = [(k, b, _C.DType.bfloat16 if a is None and known.get(k, ("",))[0] == "bfloat16"
                 and b.dtype == np.uint16 else a) for k, b, a in args]
    return args


_NUMPY = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
          "bfloat16": np.uint16}


class PendingOp:
    """An operation in flight; ``wait(timeout=None)`` returns its result
    (a dict of arrays for pulls, None for pushes) or raises its error;
    ``TimeoutError`` (DeadlineExceededError) if it is still running then."""

    def __init__(self, op, result=None, finish=None):
        self._op = op
        self._result = result
        self._finish = finish  # applied to the result once, at the first wait that ends
        self._lock = threading.Lock()

    def wait(self, timeout=None):
        self._op.wait(timeout)
        with self._lock:
            if self._finish is not None:
                self._result, self._finish = self._finish(self._result), None
        return self._result

    def done(self):
        return self._op.done()


# ---- server and client

class Server:
    """A parameter server, serving on return until ``stop()``.

    mode: "sync" (a round completes when every live worker of
    ``num_workers`` pushed, and the optimizer is applied once to their mean
    or sum, by ``reduction``), "ssp" (as sync, but a worker may run
    ``staleness`` rounds ahead of the slowest) or "async" (each push applied
    at once). ``reject_nonfinite``: refuse gradients holding NaN/Inf.
    ``token`` or ``token_file``: bearer-token auth. ``tls_cert_file`` /
    ``tls_key_file``: serve TLS. ``bulk_tcp``: offer clients a plain TCP
    connection beside gRPC for pushes and pulls (never with TLS); False
    keeps every call on gRPC.

    Membership: workers hold leases renewed by their clients' heartbeats
    (every ``heartbeat_interval`` seconds; 0: a quarter of the lease);
    after ``lease_timeout`` seconds without one, ``lease_policy`` "shrink"
    completes rounds without the worker (``keep_dead_contributions``: keep
    or drop what it pushed into open rounds), "abort" fails the waiting calls
    with ``AbortedError`` naming it.

    Checkpoints: ``checkpoint(dir)``, or periodic into ``checkpoint_dir``
    every ``checkpoint_every_rounds`` rounds or ``checkpoint_interval``
    seconds, as ``<dir>/<name>.ckpt``; ``restore=dir`` starts from one.
    A client's ``checkpoint(name)`` writes only inside ``checkpoint_dir``.

    Limits on what clients may make the server hold: a pull reply of at most
    ``max_pull_reply_bytes`` (None: ``max_message_bytes``), pull replies
    held per connection up to ``max_pending_reply_bytes``, and pushes kept
    out of order per worker up to ``max_deferred_push_bytes``; past them a
    call fails with ``ResourceExhaustedError``.
    ``metrics_address="127.0.0.1:0"`` serves Prometheus text (see
    ``metrics_port``). ``advertise`` is the host peers dial, put in
    ``address`` (default: the listen host; for "0.0.0.0" or "[::]" this
    host's primary address).
    """

    def __init__(self, address=_SERVER.address, mode=_SERVER.mode,
                 num_workers=_SERVER.num_workers, optimizer=None,
                 reduction=_SERVER.reduction, staleness=_SERVER.staleness,
                 reject_nonfinite=_SERVER.reject_nonfinite,
                 max_message_bytes=_SERVER.max_message_bytes, max_pull_reply_bytes=None,
                 max_pending_reply_bytes=_SERVER.max_pending_reply_bytes,
                 max_deferred_push_bytes=_SERVER.max_deferred_push_bytes, token=None,
                 token_file=None, job_id=_SERVER.job_id, tls_cert_file=None,
                 tls_key_file=None, lease_timeout=_SERVER.lease_timeout,
                 heartbeat_interval=_SERVER.heartbeat_interval,
                 lease_policy=_SERVER.lease_policy,
                 keep_dead_contributions=_SERVER.keep_dead_contributions,
                 name=_SERVER.name, checkpoint_dir=None,
                 checkpoint_every_rounds=_SERVER.checkpoint_every_rounds,
                 checkpoint_interval=_SERVER.checkpoint_interval, restore=None,
                 metrics_address=None, advertise=None, bulk_tcp=_SERVER.bulk_tcp,
                 _drop_push_replies=_SERVER.drop_push_replies_for_testing):
        self._server = _C.ps.Server(options(
            _C.ps.ServerOptions, address=address, advertise=advertise or "", mode=mode,
            num_workers=num_workers, staleness=staleness, reduction=reduction,
            optimizer=_optimizer_config(optimizer), reject_nonfinite=reject_nonfinite,
            max_message_bytes=byte_size(max_message_bytes, "max_message_bytes"),
            # None: the C++ default, 0, which means max_message_bytes.
            max_pull_reply_bytes=(byte_size(max_pull_reply_bytes, "max_pull_reply_bytes")
                                  if max_pull_reply_bytes is not None
                                  else _SERVER.max_pull_reply_bytes),
            max_pending_reply_bytes=byte_size(max_pending_reply_bytes,
                                              "max_pending_reply_bytes"),
            max_deferred_push_bytes=byte_size(max_deferred_push_bytes,
                                              "max_deferred_push_bytes"),
            token=token or "", token_file=token_file or "", job_id=job_id or "",
            tls_cert_file=tls_cert_file or "", tls_key_file=tls_key_file or "",
            lease_timeout=number(lease_timeout, "lease_timeout"),
            heartbeat_interval=number(heartbeat_interval, "heartbeat_interval"),
            lease_policy=lease_policy,
            keep_dead_contributions=keep_dead_contributions, name=name,
            checkpoint_dir=str(checkpoint_dir or ""),
            checkpoint_every_rounds=checkpoint_every_rounds,
            checkpoint_interval=number(checkpoint_interval, "checkpoint_interval"),
            restore_dir=str(restore or ""), metrics_address=metrics_address or "",
            bulk_tcp=bool(bulk_tcp), drop_push_replies_for_testing=_drop_push_replies))

    @property
    def address(self):
        """host:port, with the port the OS picked for port 0."""
        return self._server.address

    @property
    def port(self):
        return self._server.port

    @property
    def metrics_port(self):
        """The port serving /metrics, 0 when metrics_address was not given."""
        return self._server.metrics_port

    def metrics_text(self):
        """The server's metrics as Prometheus text."""
        return self._server.metrics_text()

    def checkpoint(self, dir, timeout=60.0):
        """Writes <dir>/<name>.ckpt atomically, cut at a round boundary in
        sync and ssp modes; returns the round it holds. The server holds
        <dir>/<name>.lock until it stops (FailedPreconditionError for
        another server of this name there)."""
        return self._server.checkpoint(_text(str(dir), "checkpoint: dir"),
                                       number(timeout, "timeout"))

    def stop(self):
        self._server.stop()

    def wait(self):
        """Blocks until stop() is called from another thread."""
        self._server.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class Client:
    """A worker's connection to the job's parameter servers.

    servers: "host:port" strings, each once, in the same order on every
      worker (FailedPreconditionError where a server was listed at another
      position by an earlier client).
    worker_id: 0..num_workers-1, or -1 for an observer that only reads.
    timeout: seconds for each operation (retries on Unavailable included);
    retry_backoff: the first pause before a retry, doubling each time.
    transport: "auto" (a server on this host moves the values through shared
    memory, others by TCP), "tcp", or "shm" (an error when a server cannot
    give shared memory); DEEPNEX_PS_TRANSPORT=tcp|shm|auto, when set,
    overrides it. shm_bytes: the segment asked of each server on this host
    (an int or a size such as "64MiB"); a request that finds no room in it
    goes by TCP.
    """

    def __init__(self, servers, worker_id=_CLIENT.worker_id,
                 partition_bytes=_CLIENT.partition_bytes, request_bytes=_CLIENT.request_bytes,
                 timeout=_CLIENT.timeout, connections_per_server=_CLIENT.connections_per_server,
                 token=None, token_file=None, tls_ca_file=None, heartbeat=_CLIENT.heartbeat,
                 retry_backoff=_CLIENT.retry_backoff, transport=_CLIENT.transport,
                 shm_bytes=_CLIENT.shm_bytes):
        if isinstance(servers, str):
            servers = [s for s in servers.split(",") if s]
        self._client = _C.ps.Client(options(
            _C.ps.ClientOptions, servers=list(servers), worker_id=worker_id,
            partition_bytes=byte_size(partition_bytes, "partition_bytes"),
            request_bytes=byte_size(request_bytes, "request_bytes"),
            timeout=number(timeout, "timeout"), connections_per_server=connections_per_server,
            token=token or "", token_file=token_file or "",
            tls_ca_file=tls_ca_file or "", heartbeat=heartbeat,
            retry_backoff=number(retry_backoff, "retry_backoff"),
            # str(): a value of another type is refused naming it too.
            transport=str(transport), shm_bytes=byte_size(shm_bytes, "shm_bytes")))
        self._shapes = {}

    @property
    def worker_id(self):
        return self._client.worker_id

    def init(self, tensors):
        """Creates the tensors; the first init of each key wins."""
        self._client.init(_buffers(tensors, "init"))

    def push(self, grads):
        """Sync: joins this worker's next round. Async: applied at once."""
        self._client.push(self._args(grads, "push"))

    def pull(self, keys):
        """A dict of new arrays. Sync: waits for this worker's last round.
        A bfloat16 tensor comes as float32 (numpy has no bfloat16; every
        bfloat16 is a float32 exactly); pull_into fills a torch.bfloat16
        tensor, or a uint16 array with the bits."""
        out = self._new_arrays(keys)
        self.pull_into(out)
        return self._widened(out)

    def pull_into(self, out):
        """Pulls into the caller's arrays (writable, contiguous, right dtype)."""
        self._client.pull_into(self._args(out, "pull"))

    def push_pull(self, grads, keys=None):
        """Pushes, then pulls `keys` (default: the pushed keys) as a dict."""
        out = self._new_arrays(list(grads) if keys is None else keys)
        self.push_pull_into(grads, out)
        return self._widened(out)

    def push_pull_into(self, grads, out):
        """Pushes, then pulls into the caller's arrays `out` (as pull_into)."""
        self._client.push_pull_into(self._args(grads, "push"), self._args(out, "pull"))

    def push_pull_into_async(self, grads, out):
        """push_pull_into in flight; `grads` and `out` stay untouched until
        it is done."""
        return PendingOp(self._client.push_pull_into_async(self._args(grads, "push"),
                                                           self._args(out, "pull")), out)

    def push_async(self, grads):
        return PendingOp(self._client.push_async(self._args(grads, "push")))

    def pull_async(self, keys):
        out = self._new_arrays(keys)
        return PendingOp(self._client.pull_into_async(self._args(out, "pull")), out,
                         self._widened)

    def pull_into_async(self, out):
        return PendingOp(self._client.pull_into_async(self._args(out, "pull")), out)

    def push_pull_async(self, grads, keys=None):
        out = self._new_arrays(list(grads) if keys is None else keys)
        return PendingOp(self._client.push_pull_into_async(self._args(grads, "push"),
                                                           self._args(out, "pull")),
                         out, self._widened)

    def describe(self, keys):
        """{key: (dtype name, shape)} of tensors on the servers."""
        return {k: (dtype, tuple(shape))
                for k, dtype, shape, _ in self._client.describe(
                    [_key(k, "describe") for k in keys])}

    def version(self, key):
        """Updates applied to `key` (rounds in sync/ssp, pushes in async).
        After a server restart from a checkpoint, training resumes at
        version + 1."""
        return self._client.describe([_key(key, "describe")])[0][3]

    def stats(self):
        """One dict of counters per server (pushes, pulls, bytes, rounds,
        round latency, live workers, lease expiries, per-worker state and
        staleness, and the Prometheus text)."""
        return self._client.stats()

    def checkpoint(self, name=""):
        """Asks every server to checkpoint into ``<checkpoint_dir>/<name>``,
        inside the server's own ``checkpoint_dir`` ("": that directory
        itself); returns their rounds. `name` is a plain name, never a path
        (``InvalidArgumentError``); it takes an admin token or the job's
        (``PermissionDeniedError``)."""
        return self._client.checkpoint(_text(str(name), "checkpoint: name"))

    def close(self):
        """Leaves the job: the servers stop waiting for this worker (unless
        this client pushed nothing and the worker had not joined before).
        A push that failed unsure goes again first; an error if it cannot
        (the servers may then hold it in part)."""
        self._client.close()

    def leave(self):
        """close(), the worker leaving for good even if this client pushed
        nothing (an elastic job releasing a slot)."""
        self._client.leave()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self.close()
        except DeepnexError:
            if exc_type is None:  # else the error that ended the block is the one to see
                raise

    def _args(self, tensors, op):
        return _buffers(tensors, op, self._shapes)

    def _widened(self, arrays):
        """`arrays` with the bfloat16 ones' bits (uint16) made float32: a
        probe's pull() gave [[48896, ...]] for [[-0.5, ...]]."""
        return {k: (a.astype(np.uint32) << 16).view(np.float32)
                if self._shapes[k][0] == "bfloat16" else a for k, a in arrays.items()}

    def _new_arrays(self, keys):
        if isinstance(keys, str):
            keys = [keys]
        missing = [k for k in keys if k not in self._shapes]
        if missing:
            self._shapes.update(self.describe(missing))
        return {k: np.empty(self._shapes[k][1], _NUMPY[self._shapes[k][0]])
                for k in keys}
