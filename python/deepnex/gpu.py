"""GPU allocation: ``deepnex.gpu.Allocator`` and its values.

    alloc = deepnex.gpu.Allocator()                  # in memory
    alloc = deepnex.gpu.Allocator(state_dir="/var/lib/deepnex")  # persistent
    alloc.add_node(deepnex.gpu.Node("n1", gpus=[deepnex.gpu.Gpu(memory="80GiB")] * 8,
                                    cpus=64, memory="512GiB", mode="shared"))
    a = alloc.allocate(deepnex.gpu.Request(user="alice", gpus=2, mode="shared",
                                           gpu_memory="10GiB", cpus=4, memory="16GiB"))
    a.id, a.node, a.gpus, a.env
    alloc.release(a.id)                              # idempotent

Sizes are ints (bytes) or strings such as "80GiB". Errors are
``deepnex.DeepnexError`` subclasses: a bad value is InvalidArgumentError (a
ValueError) naming the field; over quota, or no free capacity with
``wait=False``, is ResourceExhaustedError; a queue timeout is
DeadlineExceededError (a TimeoutError).
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from . import _C
from ._convert import byte_size, options, text
from .errors import InvalidArgumentError, NotFoundError

__all__ = [
    "Allocator", "CentralClient", "Gpu", "Node", "Request", "Allocation", "GrantedGpu", "NodeInfo",
    "discover", "local_node", "load_nodes", "parse_nodes",
]

Allocation = _C.gpu.Allocation
GrantedGpu = _C.gpu.GrantedGpu
NodeInfo = _C.gpu.NodeInfo

# C++'s defaults, which the keyword defaults below show.
_ALLOCATOR = _C.gpu.AllocatorOptions()
_REQUEST = _C.gpu.Request()
_CENTRAL = _C.gpu.CentralClientOptions()


def _int(value, name):
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name}: expected an int, got {value!r}")
    return value


def _int32(value, name):
    value = _int(value, name)
    if not -2**31 <= value < 2**31:
        raise InvalidArgumentError(f"{name}={value}: must fit in 32 bits")
    return value


def _int64(value, name):
    value = _int(value, name)
    if not -2**63 <= value < 2**63:
        raise InvalidArgumentError(f"{name}={value}: must fit in 64 bits")
    return value


def _seconds(value, name):
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgumentError(f"{name}={value!r}: must be a positive number of seconds")
    return float(value)


@dataclass
class Gpu:
    """One GPU of a node. ``uuid`` None: the allocator names it
    "GPU-<node>-<index>"; ``index`` None: its position in the node's list."""
    memory: object
    uuid: Optional[str] = None
    name: str = ""
    index: Optional[int] = None
    numa_node: int = -1
    switch_id: int = -1
    pci_bus_id: str = ""

    def _args(self, where):
        return (byte_size(self.memory, f"{where}.memory"), self.uuid or "", self.name,
                -1 if self.index is None else _int32(self.index, f"{where}.index"),
                _int32(self.numa_node, f"{where}.numa_node"),
                _int32(self.switch_id, f"{where}.switch_id"), self.pci_bus_id)


@dataclass
class Node:
    """A machine whose GPUs, CPU cores and memory the allocator hands out.
    mode: "exclusive" (a GPU per allocation) or "shared" (GPU memory shared)."""
    name: str
    gpus: Sequence[Gpu] = ()
    cpus: int = 0
    memory: object = 0
    mode: str = "exclusive"
    labels: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def _from_dict(cls, d):
        return cls(d["name"], [Gpu(memory=g["memory"], uuid=g["uuid"] or None, name=g["name"],
                                   index=g["index"] if g["index"] >= 0 else None,
                                   numa_node=g["numa_node"], switch_id=g["switch_id"],
                                   pci_bus_id=g["pci_bus_id"]) for g in d["gpus"]],
                   d["cpus"], d["memory"], d["mode"], dict(d["labels"]))


@dataclass
class Request:
    """What a user asks for. ``gpu_memory``: per GPU, required for shared
    GPUs; for exclusive ones the least memory a GPU must have. ``replicas``
    > 1 is a gang: all parts or none. ``lease``: seconds; the holder renews
    it (``Allocator.renew``) or the allocation is released."""
    user: str
    gpus: int = _REQUEST.gpus
    mode: str = _REQUEST.mode
    gpu_memory: object = _REQUEST.gpu_memory
    cpus: int = _REQUEST.cpus
    memory: object = _REQUEST.memory
    selector: Dict[str, str] = field(default_factory=dict)
    node: Optional[str] = None
    priority: int = _REQUEST.priority
    replicas: int = _REQUEST.replicas
    spread: bool = _REQUEST.spread
    lease: Optional[float] = None
    # The job it is for (deepnex run sets its job name); shown in listings.
    job: Optional[str] = None


class Allocator:
    """Hands out GPUs, CPU cores and memory of its nodes; thread-safe.

    ``state_dir``: persist every change in a crash-safe ledger there (fsynced
    before each call returns, replayed on the next start); None keeps state
    in memory. ``reservation_after``: seconds the head of the queue waits
    before the capacity it needs is reserved; until then requests behind it
    that fit are granted (backfill); 0 reserves at once.
    """

    def __init__(self, state_dir=None, fsync=_ALLOCATOR.fsync,
                 snapshot_every=_ALLOCATOR.snapshot_every,
                 lease_check_interval=_ALLOCATOR.lease_check_interval,
                 reservation_after=_ALLOCATOR.reservation_after):
        if (isinstance(reservation_after, bool) or
                not isinstance(reservation_after, (int, float)) or not reservation_after >= 0):
            raise InvalidArgumentError(
                f"reservation_after={reservation_after!r}: must be a number of seconds >= 0")
        self._a = _C.gpu.Allocator(options(
            _C.gpu.AllocatorOptions, state_dir=state_dir or "", fsync=bool(fsync),
            snapshot_every=_int(snapshot_every, "snapshot_every"),
            lease_check_interval=_seconds(lease_check_interval, "lease_check_interval"),
            reservation_after=float(reservation_after)))

    # ---- nodes (admin)

    def add_node(self, node: Node):
        if not isinstance(node, Node):
            raise TypeError(f"add_node: expected deepnex.gpu.Node, got {type(node).__name__}")
        where = f"node {node.name}"
        gpus = []
        for i, g in enumerate(node.gpus):
            if not isinstance(g, Gpu):
                raise TypeError(f"{where}: gpus[{i}]: expected deepnex.gpu.Gpu, "
                                f"got {type(g).__name__}")
            gpus.append(g._args(f"{where}: gpus[{i}]"))
        self._a.add_node(name=text(node.name, "node name"), gpus=gpus,
                         cpus=_int32(node.cpus, f"{where}: cpus"),
                         memory=byte_size(node.memory, f"{where}: memory"), mode=node.mode,
                         labels=dict(node.labels or {}))

    def remove_node(self, name):
        """Refused (FailedPreconditionError) while the node holds allocations."""
        self._a.remove_node(text(name, "node"))

    def set_node_mode(self, name, mode, when_drained=False):
        """Switch a node to "exclusive" or "shared". A node holding GPU
        allocations of its current mode refuses (FailedPreconditionError naming
        them), or with ``when_drained=True`` switches once they are released."""
        self._a.set_node_mode(name=text(name, "node"), mode=text(mode, "mode"),
                              when_drained=bool(when_drained))

    def cordon(self, name):
        self._a.cordon(text(name, "node"))

    def uncordon(self, name):
        self._a.uncordon(text(name, "node"))

    def drain(self, name, release=False):
        """Cordon the node and mark it draining; ``release=True`` also
        releases its allocations."""
        self._a.drain(name=text(name, "node"), release=bool(release))

    def nodes(self) -> List[NodeInfo]:
        return self._a.nodes()

    def node(self, name) -> NodeInfo:
        return self._a.node(text(name, "node"))

    # ---- quotas (admin)

    def set_quota(self, user, gpus=None, gpu_memory=None, cpus=None, memory=None,
                  max_priority=0) -> str:
        """Set ``user``'s quota (None: unlimited). Allowed below what the user
        holds; then the returned note says so and new grants are refused until
        use drops. Returns "" otherwise. ``max_priority``: the highest
        request priority the user may ask for (above it: PermissionError)."""
        if not user:
            raise InvalidArgumentError("user: empty (use set_default_quota)")
        return self._set_quota(user, gpus, gpu_memory, cpus, memory, max_priority)

    def set_default_quota(self, gpus=None, gpu_memory=None, cpus=None, memory=None,
                          max_priority=0) -> str:
        """The quota of users without their own."""
        return self._set_quota("", gpus, gpu_memory, cpus, memory, max_priority)

    def _set_quota(self, user, gpus, gpu_memory, cpus, memory, max_priority):
        who = f"quota of {user or 'default'}"
        return self._a.set_quota(
            user=text(user, "user"),
            gpus=None if gpus is None else _int64(gpus, f"{who}: gpus"),
            gpu_memory=(None if gpu_memory is None
                        else byte_size(gpu_memory, f"{who}: gpu_memory")),
            cpus=None if cpus is None else _int64(cpus, f"{who}: cpus"),
            memory=None if memory is None else byte_size(memory, f"{who}: memory"),
            max_priority=_int32(max_priority, f"{who}: max_priority"))

    def clear_quota(self, user):
        self._a.clear_quota(text(user, "user"))

    def quota(self, user) -> dict:
        return self._a.quota(text(user, "user"))

    def usage(self, user) -> dict:
        return self._a.usage(text(user, "user"))

    def quotas(self, user=None) -> List[dict]:
        """Quotas beside usage: dicts {"user", "own", "quota", "usage"},
        where "quota" and "usage" are dicts of gpus, gpu_memory, cpus and
        memory (a quota's None: unlimited) and "own" says whether the user
        has a quota of their own (else the default applies). ``user`` None:
        the default quota first (user ""), then every user with a quota or
        holding something; otherwise that user alone. Through
        deepnex-central a user token sees only its own."""
        return self._a.quotas(text(user or "", "user"))

    def pending(self, user=None) -> List[dict]:
        """The queue in order: dicts {"position" (1-based, in the whole
        queue), "id", "user", "gpus", "mode", "gpu_memory", "cpus", "memory",
        "replicas", "priority", "node", "selector", "waited" (seconds),
        "reason"}; "reason" says why it waits, e.g. "waiting for 2 exclusive
        GPUs (0 free on any eligible node)" or "behind 3 requests". ``user``
        filters; through deepnex-central a user sees only their own."""
        return self._a.pending(text(user or "", "user"))

    # ---- allocations

    def allocate(self, request: Request, wait=True, timeout=None):
        """Grant ``request``: an Allocation, or for a gang (replicas > 1) the
        list of its parts. Over free capacity it waits in the queue (priority,
        then FIFO, with backfill: see the Allocator's ``reservation_after``) up
        to ``timeout`` seconds (None: until granted); ``wait=False`` raises
        ResourceExhaustedError instead. A priority above the user's quota
        ``max_priority`` raises PermissionDeniedError."""
        if not isinstance(request, Request):
            raise TypeError(f"allocate: expected deepnex.gpu.Request, "
                            f"got {type(request).__name__}")
        r = request
        parts = self._a.allocate(options(
            _C.gpu.Request, user=r.user, job=r.job or "", gpus=_int32(r.gpus, "gpus"),
            mode=r.mode, gpu_memory=byte_size(r.gpu_memory, "gpu_memory"),
            cpus=_int32(r.cpus, "cpus"), memory=byte_size(r.memory, "memory"),
            selector=dict(r.selector or {}), node=r.node or "",
            priority=_int32(r.priority, "priority"), replicas=_int32(r.replicas, "replicas"),
            spread=bool(r.spread), lease=_seconds(r.lease, "lease")),
            wait=bool(wait), timeout=_seconds(timeout, "timeout"))
        return parts if r.replicas != 1 else parts[0]

    def release(self, id):  # noqa: A002 - the issue's name
        """Release an allocation (or a whole gang by its gang id). Idempotent."""
        self._a.release(text(id, "id"))

    def renew(self, id) -> Allocation:  # noqa: A002
        return self._a.renew(text(id, "id"))

    def allocations(self, user=None) -> List[Allocation]:
        return self._a.allocations(text(user or "", "user"))

    def allocation(self, id) -> Allocation:  # noqa: A002
        return self._a.allocation(text(id, "id"))

    def queue_length(self) -> int:
        return self._a.queue_length()

    # ---- persistence and checks

    def compact(self):
        """Write a snapshot and drop the log behind it."""
        self._a.compact()

    def check_invariants(self):
        """Raises InternalError on any inconsistency (for tests)."""
        self._a.check_invariants()

    def _digest(self) -> bytes:
        return self._a.state_digest()

    def _ledger_records(self) -> int:
        return self._a.ledger_records()


def discover(library="libnvidia-ml.so.1") -> dict:
    """This machine's GPUs through NVML: {"gpus": [...], "links": [[...]],
    "driver_version", "summary"}; without the driver, no GPUs and summary
    "0 GPUs (NVML not found)"."""
    return _C.gpu.discover(library)


def local_node(name=None, mode="exclusive") -> Node:
    """This machine as a Node (host name, discovered GPUs, CPU cores, memory)."""
    return Node._from_dict(_C.gpu.local_node(name or "", mode))


def load_nodes(path) -> List[Node]:
    """Nodes declared in a JSON file (see include/deepnex/gpu/discovery.h)."""
    return [Node._from_dict(d) for d in _C.gpu.load_nodes(str(path))]


def parse_nodes(text, source="<string>") -> List[Node]:
    return [Node._from_dict(d) for d in _C.gpu.parse_nodes(text, source)]


# The year 10000: a time past it is a typo (and its milliseconds would not
# fit central's 64-bit ones much later).
MAX_EPOCH_SECONDS = 253402300800


class CentralClient:
    """The Allocator's methods against deepnex-central over gRPC.

    ``token`` / ``token_file``: the caller's bearer token; a user token acts
    on its own allocations only (another user's is PermissionDeniedError),
    node, mode and quota changes need an admin token. ``timeout``: seconds
    per call (a waiting allocate adds its own timeout).
    """

    def __init__(self, address, token=None, token_file=None, tls_ca_file=None,
                 timeout=_CENTRAL.timeout):
        o = options(_C.gpu.CentralClientOptions, address=address, token=token or "",
                    token_file=token_file or "", tls_ca_file=tls_ca_file or "",
                    timeout=_seconds(timeout, "timeout"))
        self._a = _C.gpu.CentralClient(o)
        # The launcher's calls (the Containers service on the same address).
        self._c = _C.launch.CentralClient(o)
        # The job records (the Jobs service on the same address).
        self._j = _C.jobs.JobsClient(o)

    add_node = Allocator.add_node
    remove_node = Allocator.remove_node
    set_node_mode = Allocator.set_node_mode
    cordon = Allocator.cordon
    uncordon = Allocator.uncordon
    drain = Allocator.drain
    nodes = Allocator.nodes
    set_quota = Allocator.set_quota
    set_default_quota = Allocator.set_default_quota
    _set_quota = Allocator._set_quota
    allocate = Allocator.allocate
    release = Allocator.release
    renew = Allocator.renew
    allocations = Allocator.allocations
    quotas = Allocator.quotas
    pending = Allocator.pending

    # The Allocator's single lookups, made of the lists above (the README
    # promised them; they raised AttributeError). A user token sees its own.
    def node(self, name) -> NodeInfo:
        for n in self.nodes():
            if n.name == name:
                return n
        raise NotFoundError(f'node: no node named "{name}"')

    def allocation(self, id) -> Allocation:  # noqa: A002
        for a in self.allocations():
            if a.id == id:
                return a
        raise NotFoundError(f'allocation "{id}" does not exist')

    def quota(self, user) -> dict:
        return self._quota_entry(user)["quota"]

    def usage(self, user) -> dict:
        return self._quota_entry(user)["usage"]

    def _quota_entry(self, user):
        if not user:
            raise InvalidArgumentError("user: empty (the default quota is quotas()[0])")
        [entry] = self.quotas(user)
        return entry

    def queue_length(self) -> int:
        """The requests waiting: all of them for an admin, a user's own for
        a user token."""
        return len(self.pending())

    def metrics(self) -> str:
        """Prometheus text: GPU memory per GPU, GPUs by mode, queue, counters."""
        return self._a.metrics()

    # ---- the launcher: containers on the caller's allocations
    #
    # Containers are reported as dicts shaped like a launcher's record (name,
    # user, allocation, backend, id, state, restarts, last_exit, gpus, cpus,
    # memory, usage, started_at, allocation_released), so that
    # deepnex._cli_launch.rows() tables them. Names are per user; another
    # user's container is NotFoundError. `user` arguments are for admins.

    def start_container(self, spec, allocation) -> dict:
        """Starts a deepnex.launch.ContainerSpec (its allocation None; mounts
        only from under the server's --allow-mount directories) on
        `allocation` (an id or an Allocation), which must be the
        caller's (PermissionDeniedError otherwise; NotFoundError for an
        unknown id). When it ends for good, and no other container runs on
        the allocation, deepnex-central releases the allocation."""
        from .launch import ContainerSpec
        if not isinstance(spec, ContainerSpec):
            raise InvalidArgumentError(
                f"start_container: expected a deepnex.launch.ContainerSpec, got {spec!r}")
        allocation_id = allocation if isinstance(allocation, str) else allocation.id
        return self._c.start(allocation_id, spec._spec())

    def containers(self, user=None, all=False) -> List[dict]:
        """The caller's containers (admins: everyone's, or `user`'s). With
        ``all=True``, every user's (admins only: PermissionDeniedError otherwise)."""
        if all and user:
            raise InvalidArgumentError(f"containers: all=True lists every user's; "
                                       f"user={user!r} names one")
        return self._c.list("*" if all else user or "")

    def stop_container(self, name, grace=10.0, user=None) -> dict:
        """SIGTERM, SIGKILL after grace seconds, no restart; returns once it
        ended, with its allocation released as above."""
        return self._c.stop(name, float(grace), user or "")

    def container_logs(self, name, follow=False, user=None, poll=0.2):
        """The container's stdout and stderr so far, across restarts. With
        follow: an iterator of the log's pieces, from the start, as they come,
        until the container ended for good."""
        if follow:
            return self._follow(name, user or "", poll)
        out, offset, ended = [], 0, False
        while not ended:
            data, offset, ended = self._c.logs(name, offset, user or "")
            if not data:
                break
            out.append(data)
        return b"".join(out).decode("utf-8", errors="replace")

    def exec(self, name, command, input=None, on_output=None, user=None):
        """Runs `command` (a list) in the caller's running container `name`,
        as the container's user, through its node's agent where it runs
        there; `input` (bytes) is its stdin, then EOF. Returns an ExecResult
        (exit_code: 128 + N for signal N; stdout, stderr: bytes, unless
        on_output(kind, data) took them as they came). Another user's
        container is NotFoundError."""
        from ._session import exec_
        return exec_(self._c, name, command, input=input, on_output=on_output, user=user)

    def port_forward(self, name, remote, local=0, host="127.0.0.1", user=None):
        """Listens on host:local (0: any free port; .port says which) and
        passes each connection to TCP port `remote` on the loopback of the
        caller's container `name`. Close it (or use it as a context manager)
        to stop."""
        from ._session import PortForward
        return PortForward(self._c, name, remote, local=local, host=host, user=user)

    def _follow(self, name, user, poll):
        import codecs
        import time
        # A character may span two pieces.
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        offset = 0
        while True:
            data, offset, ended = self._c.logs(name, offset, user)
            text = decoder.decode(data, final=ended)
            if text:
                yield text
            if ended:
                return
            if not data:
                time.sleep(poll)

    # ---- jobs: the records of `deepnex run --central` jobs, and their history
    #
    # Jobs are dicts: name, user, command, mode, workers, ps, allocations,
    # nodes, state (pending, running, completed, failed, cancelled),
    # submitted_ms / started_ms / ended_ms (central's clock, ms since the
    # epoch; 0: not yet), exit_code, restarts, containers (name, node, role,
    # state, restarts, last_exit, cpu_seconds, memory_peak), message,
    # cancelled_by, lost (failed because its runner stopped reporting),
    # elapsed (seconds), gpu_hours, cpu_hours, peak_memory (bytes). Users see
    # their own; another user's job is NotFoundError.

    def jobs(self, all=False, user=None, state=None, since=None) -> List[dict]:
        """Jobs that have not ended, as squeue; with `all`, `since` (a
        datetime or seconds since the epoch: jobs not ended before then) or
        an ended `state`, the history too, as sacct. Admins see everyone's
        unless `user` filters."""
        import datetime
        if isinstance(since, datetime.datetime):
            since = since.timestamp()
        if since is not None and not (isinstance(since, (int, float)) and not isinstance(
                since, bool) and 0 < since < MAX_EPOCH_SECONDS):
            raise InvalidArgumentError(
                f"since: {since!r} is not a datetime or positive seconds since the epoch "
                f"(before the year 10000)")
        return self._j.list(bool(all), user or "", state or "",
                            int(since * 1000) if since is not None else 0)

    def job(self, name) -> dict:
        """One job, with its containers per node."""
        return self._j.get(name)

    def cancel_job(self, name) -> dict:
        """Cancels a job that has not ended: central releases its
        allocations (stopping its containers there) and its runner stops the
        rest and exits non-zero. FailedPreconditionError once it ended."""
        return self._j.cancel(name)

    # ---- the image catalog: what the caller may run
    #
    # Images are dicts (name, tag, owner, visibility, shared_with, size,
    # created): name as the caller gives it (NAME for their own and presets,
    # OWNER/NAME for another's shared with them), owner "" for a preset,
    # visibility preset, public, shared or private, size in bytes, created in
    # seconds since the epoch. A name takes an optional ":TAG" (default
    # "latest"). What the caller may not run is NotFoundError; another's
    # image they may run but not change is PermissionDeniedError.

    def images(self) -> List[dict]:
        """The images the caller may run (admins: every image)."""
        return self._c.images()

    def register_image(self, name, source, owner=None, force=False) -> dict:
        """Admins: adds image `name` from `source` (a directory on
        deepnex-central's host, or "host") as a preset, or as `owner`'s.
        A name and tag that exist are AlreadyExistsError unless `force`."""
        return self._c.register_image(name, source, owner or "", bool(force))

    def share_image(self, name, users=(), public=False) -> dict:
        """Lets `users` (a name or a list), and with `public` everyone, run
        the caller's image `name`."""
        return self._c.share_image(name, _names(users), bool(public))

    def unshare_image(self, name, users=()) -> dict:
        """Takes the shares of `users` back; none given: every share and the
        public one."""
        return self._c.unshare_image(name, _names(users))

    def remove_image(self, name) -> dict:
        """Removes the caller's image `name` (a preset: admins only)."""
        return self._c.remove_image(name)

    def commit(self, container, name) -> dict:
        """Saves the caller's running oci container `container`'s changes
        as their own private image `name` (NAME[:TAG])."""
        return self._c.commit(container, name)


def _names(users) -> List[str]:
    return [users] if isinstance(users, str) else list(users)
