"""Container launch and supervision: ``deepnex.launch.Launcher``.

    launcher = deepnex.launch.Launcher("oci")   # or "process", "docker", "slurm", "kubernetes"
    h = launcher.start(deepnex.launch.ContainerSpec(
        name="w0", image="host", command=["python3", "train.py"],
        cpus=1, memory="256MiB", env={"A": "1"}, allocation=a, restart="on-failure:2"))
    e = h.wait(timeout=60)   # ExitStatus: e.reason "exited" | "signaled" | "oom_killed" | "lost",
                             # e.code, e.signal, e.restarts, e.ok
    h.logs(), h.usage(), h.status(), h.stop()

Keyword options of Launcher are LauncherOptions' fields (state_dir, id,
allowed_mount_roots, min_memory, cgroup_parent, require_cgroups) and the backends' (runc,
runc_root, oci_init, docker_socket, docker_api_version, slurm_partition, slurm_bin_dir,
slurm_env, kubeconfig, server, token, ca_file, namespace, kind,
shared_gpu_memory_resource). Sizes are ints (bytes) or strings such as
"256MiB"; durations are seconds. Errors are ``deepnex.DeepnexError``
subclasses: a bad spec is InvalidArgumentError (a ValueError) naming the
field, a missing command or image NotFoundError, another user's allocation
PermissionDeniedError, a wait that times out DeadlineExceededError.
"""

import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from . import _C
from ._convert import byte_size, options
from .errors import InvalidArgumentError

__all__ = [
    "Launcher", "ContainerSpec", "Mount", "Handle", "Usage", "ExitStatus", "ContainerStatus",
    "probe_backends",
]

ExitStatus = _C.launch.ExitStatus
ContainerStatus = _C.launch.ContainerStatus

# C++'s defaults, which ContainerSpec's fields show.
_SPEC = _C.launch.ContainerSpec()

# A wait without a timeout: long enough to be forever, small enough for
# std::chrono::milliseconds.
_FOREVER = 10 * 365 * 24 * 3600.0


@dataclass
class Mount:
    """A bind mount; both paths absolute, the source under an allowed root.
    The process backend takes only a writable mount of a path onto itself."""
    source: str
    target: str
    read_only: bool = True

    @classmethod
    def parse(cls, text: str, flag: str = "--mount") -> "Mount":
        """From the command line's SRC:DST[:ro|:rw] (writable unless :ro); a
        relative SRC is taken from the current directory."""
        parts = text.split(":")
        mode = parts.pop() if len(parts) == 3 else "rw"
        if len(parts) != 2 or not parts[0] or not parts[1] or mode not in ("ro", "rw"):
            raise InvalidArgumentError(f"{flag} {text!r}: expected SRC:DST or SRC:DST:ro")
        return cls(os.path.abspath(parts[0]), parts[1], mode == "ro")


def _mount_args(mounts):
    """deepnex._C.launch.Mount values for the C++ layer."""
    out = []
    for i, m in enumerate(mounts):
        if isinstance(m, Mount):
            out.append(_C.launch.Mount(m.source, m.target, m.read_only))
        elif isinstance(m, (tuple, list)) and len(m) in (2, 3):
            out.append(_C.launch.Mount(m[0], m[1], bool(m[2]) if len(m) == 3 else True))
        else:
            raise InvalidArgumentError(
                f"spec.mounts[{i}]: expected a Mount or (source, target[, read_only]), got {m!r}")
    return out


@dataclass
class ContainerSpec:
    """What to run and with which resources (see deepnex/launch/launcher.h).

    ``mounts`` holds Mount values or (source, target[, read_only]) tuples;
    ``restart`` is "never", "on-failure[:N]" or "always[:N]", with
    ``backoff`` seconds before the first restart, doubling up to
    ``max_backoff``; ``allocation`` is a deepnex.gpu Allocation; ``host_network``
    (oci) shares the host's network instead of a private one with only loopback.
    """
    name: str
    command: Sequence[str]
    image: str = _SPEC.image
    env: Dict[str, str] = field(default_factory=dict)
    working_dir: str = _SPEC.working_dir
    mounts: List[Union[Mount, Tuple]] = field(default_factory=list)
    cpus: float = _SPEC.cpus
    memory: Union[int, str] = _SPEC.memory
    pids_limit: int = _SPEC.pids_limit
    allocation: Optional[object] = None
    user: str = _SPEC.user
    labels: Dict[str, str] = field(default_factory=dict)
    restart: str = _SPEC.restart
    backoff: float = _SPEC.backoff
    max_backoff: float = _SPEC.max_backoff
    network_none: bool = _SPEC.network_none
    host_network: bool = _SPEC.host_network

    def _spec(self):
        """The C++ ContainerSpec (deepnex._C.launch.ContainerSpec)."""
        mounts = _mount_args(self.mounts)
        if isinstance(self.command, str):
            raise InvalidArgumentError(
                f"spec.command: expected a list of arguments, got the string {self.command!r}")
        return options(
            _C.launch.ContainerSpec, name=self.name, image=self.image,
            command=list(self.command), env=dict(self.env), working_dir=self.working_dir,
            mounts=mounts, cpus=float(self.cpus),
            memory=byte_size(self.memory, "spec.memory"), pids_limit=int(self.pids_limit),
            allocation=self.allocation, user=self.user, labels=dict(self.labels),
            restart=self.restart, backoff=float(self.backoff),
            max_backoff=float(self.max_backoff), network_none=bool(self.network_none),
            host_network=bool(self.host_network))


@dataclass
class Usage:
    """What a container uses now; fields a backend cannot see are 0."""
    cpu_seconds: float = 0.0
    memory: int = 0
    memory_peak: int = 0
    pids: int = 0
    gpu_memory: Dict[int, int] = field(default_factory=dict)


class Handle:
    """One started container. Thread-safe."""

    def __init__(self, handle):
        self._h = handle

    @property
    def name(self) -> str:
        return self._h.name

    @property
    def env(self) -> Dict[str, str]:
        """The environment it runs with (the allocation's plus the spec's)."""
        return self._h.env

    def status(self) -> ContainerStatus:
        return self._h.status()

    def wait(self, timeout: Optional[float] = None) -> ExitStatus:
        """Waits until it ended for good; DeadlineExceededError after timeout seconds."""
        return self._h.wait(_FOREVER if timeout is None else timeout)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, SIGKILL after grace seconds, no restart; returns when it ended."""
        self._h.stop(grace)

    def logs(self) -> str:
        """stdout and stderr so far, across restarts."""
        return self._h.logs().decode("utf-8", errors="replace")

    def follow_logs(self, sink: Callable[[str], Optional[bool]]) -> None:
        """Calls sink with new output until it ends for good or sink returns False."""
        self._h.follow_logs(lambda b: sink(b.decode("utf-8", errors="replace")))

    def usage(self) -> Usage:
        return Usage(**self._h.usage())

    def __repr__(self):
        s = self.status()
        return f"Handle({s.name!r}, {s.state}, restarts={s.restarts})"


def _options(options):
    out = dict(options)
    if "min_memory" in out and out["min_memory"] is not None:
        out["min_memory"] = byte_size(out["min_memory"], "min_memory")
    if out.get("allowed_mount_roots") is not None:
        out["allowed_mount_roots"] = list(out["allowed_mount_roots"])
    return out


class Launcher:
    """Starts and supervises containers on one backend. Thread-safe.

    Closing it (close(), or the end of a with block) stops every container it
    still runs.
    """

    def __init__(self, backend: str = "process", **options):
        self._l = _C.launch.Launcher(backend=backend, **_options(options))

    @property
    def id(self) -> str:
        return self._l.id

    @property
    def backend(self) -> str:
        return self._l.backend

    def start(self, spec: ContainerSpec) -> Handle:
        if not isinstance(spec, ContainerSpec):
            raise InvalidArgumentError(f"start: expected a ContainerSpec, got {spec!r}")
        return Handle(self._l.start(spec._spec()))

    def list(self) -> List[Handle]:
        return [Handle(h) for h in self._l.list()]

    def get(self, name: str) -> Handle:
        return Handle(self._l.get(name))

    def remove(self, name: str) -> None:
        """Forgets a container that ended, with its logs and record."""
        self._l.remove(name)

    def cleanup(self, launcher_id: str) -> int:
        """Kills and removes what a launcher with this id left; returns how many."""
        return self._l.cleanup(launcher_id)

    def close(self) -> None:
        self._l = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def probe_backends(**options) -> Dict[str, str]:
    """{backend: ""} for those usable here, else the reason it is not."""
    return _C.launch.probe_backends(**_options(options))
