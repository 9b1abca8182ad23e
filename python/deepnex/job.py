"""Jobs: one call from allocation to a trained model.

    import deepnex
    result = deepnex.job.run(["python3", "train.py"], workers=2, mode="sync")
    result.exit_code, result.workers, result.seconds

``run`` allocates the workers' GPUs, CPU cores and memory (a local allocator
over this machine, or deepnex-central with ``central=ADDR``), serves the
job's rendezvous store, starts the parameter servers and the workers through
a launch backend with the job environment (DEEPNEX_RANK, DEEPNEX_PS_ADDRS,
... and torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), prints their
output prefixed with "[worker 0]" / "[ps 0]", restarts them under
``restart`` and releases everything when the workers are done, on an error,
or on KeyboardInterrupt. With the process backend a helper process (C++
Job's) sweeps the job's containers when the calling process ends without
that (SIGKILL).
"""

import os
import shutil
import signal as _signal
import sys
import threading
from typing import Callable, Dict, Optional, Sequence

from . import _C
from .errors import DeadlineExceededError, InvalidArgumentError
from ._convert import byte_size, options
from .launch import _mount_args, _options

__all__ = ["Job", "JobResult", "run"]

JobResult = _C.job.JobResult

# C++'s defaults, which Job's keyword defaults show.
_JOB = _C.job.JobOptions()


# Serializes what the job's threads write to stdout and stderr: a long line
# into a pipe is many write()s, and another thread's landed between them
# (probe: two workers' 3 MB lines into `deepnex run ... | tee` came out in
# 32 KiB pieces, most without their "[worker N]"). Reentrant: a signal
# handler that stops the job tells it while the main thread may be writing.
_write_lock = threading.RLock()


def _write_line(stream, line: str) -> None:
    """Writes line and a newline to stream, whole among the job's threads."""
    with _write_lock:
        stream.write(line + "\n")
        stream.flush()


def _ps_binary() -> Optional[str]:
    """deepnex-ps: $DEEPNEX_PS_BIN, the one shipped beside the package, the
    build tree's (DEEPNEX_BUILD_DIR), then PATH."""
    candidates = [os.environ.get("DEEPNEX_PS_BIN"),
                  os.path.join(os.path.dirname(__file__), "bin", "deepnex-ps")]
    build = os.environ.get("DEEPNEX_BUILD_DIR")
    if build:
        candidates.append(os.path.join(build, "bin", "deepnex-ps"))
    # The build tree: <build>/python/deepnex/job.py -> <build>/bin/deepnex-ps.
    candidates.append(os.path.join(os.path.dirname(__file__), "..", "..", "bin", "deepnex-ps"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.abspath(c)
    return shutil.which("deepnex-ps")


class Job:
    """A started job; see ``run``. ``stop()`` may be called from any thread."""

    def __init__(self, command: Sequence[str], *, workers: int = _JOB.workers,
                 min_workers: int = _JOB.min_workers,
                 nodes: int = _JOB.nodes, ps: Optional[int] = None, mode: str = _JOB.mode,
                 gpus_per_worker: int = _JOB.gpus_per_worker, gpu_mode: str = _JOB.gpu_mode,
                 gpu_memory=_JOB.gpu_memory, cpus: float = _JOB.cpus, memory=_JOB.memory,
                 backend: str = _JOB.backend,
                 central: Optional[str] = None, central_token: Optional[str] = None,
                 central_token_file: Optional[str] = None, notify: Sequence[str] = (),
                 notify_every: float = 0, notify_when: Optional[str] = None,
                 restart: str = _JOB.restart, checkpoint_dir: Optional[str] = None,
                 optimizer: str = _JOB.optimizer, lr: Optional[float] = _JOB.lr,
                 momentum: float = _JOB.momentum, name: Optional[str] = None,
                 user: Optional[str] = None, env: Optional[Dict[str, str]] = None,
                 working_dir: Optional[str] = None, mounts: Sequence = (),
                 image: str = _JOB.image,
                 output: Optional[Callable[[str, str], None]] = None,
                 on_event: Optional[Callable[[str], None]] = None,
                 advertise_address: Optional[str] = None, **launcher_options):
        """``min_workers`` (1 <= min_workers < workers): elastic, as ``deepnex
        run --workers MIN:MAX``: the job starts once ``min_workers`` are
        granted, grows toward ``workers`` as capacity frees (asked for at
        priority -1) and drops a failed or lost worker while ``min_workers``
        remain; each membership is published to the job's store
        (``elastic/members/<G>``, ``elastic/generation``) and each resize is
        an event. ``nodes``: spread the workers over this many nodes (0: where they
        fit). ``image``: what the workers run in (``deepnex run --image``):
        "host", or an image the backend takes (an OCI layout or rootfs
        directory for oci, a reference for docker and kubernetes, a catalog
        name with central's agents); in another image than "host" a worker
        gets only ``env`` and the job's variables, not this process's
        environment. ``advertise_address``: the host the job's processes reach this
        process's store at (default: 127.0.0.1 when the whole job is local,
        else this host's primary address).
        ``user``: empty with ``central``: the token's user. ``notify``: with
        ``central``, URLs that central POSTs the job's events to;
        ``notify_every`` (minutes; 0: never) and ``notify_when``
        ("accuracy>=0.9", once) add job.progress events with rank 0's last
        ``deepnex.report()``. ``output(who,
        line)`` gets what the processes print, ``on_event(message)`` what
        happens to them ("worker 1 exited(1); restarting (1/2) in 0.1s";
        default: stderr)."""
        if output is None:
            def output(who, line):
                _write_line(sys.stdout, f"[{who}] {line}")
        if on_event is None:
            def on_event(message):
                _write_line(sys.stderr, message)
        if ps is not None and ps < 0:  # None is the default; -1 means it to C++ alone
            raise InvalidArgumentError(f"ps: {ps} is below 0")
        job = options(
            _C.job.JobOptions, command=list(command), workers=workers,
            min_workers=min_workers, nodes=nodes,
            ps=_JOB.ps if ps is None else ps, mode=mode,
            gpus_per_worker=gpus_per_worker, gpu_mode=gpu_mode,
            gpu_memory=byte_size(gpu_memory, "gpu_memory"), cpus=float(cpus),
            memory=byte_size(memory, "memory"), user=user or "", central=central or "",
            central_token=central_token or "", central_token_file=central_token_file or "",
            notify=list(notify), notify_every_minutes=_minutes(notify_every, "notify_every"),
            notify_when=notify_when or "",
            backend=backend, restart=restart,
            checkpoint_dir=os.path.abspath(checkpoint_dir) if checkpoint_dir else "",
            optimizer=optimizer, lr=lr, momentum=momentum, ps_binary=_ps_binary() or "",
            image=image, env=dict(env or {}), mounts=_mount_args(mounts),
            working_dir=os.path.abspath(working_dir) if working_dir else "",
            name=name or "", advertise_address=advertise_address or "")
        self._job = _C.job.Job(job, launcher=_options(launcher_options), output=output,
                               on_event=on_event)

    @property
    def name(self) -> str:
        return self._job.name

    @property
    def backend(self) -> str:
        """The launch backend of its containers: the one asked for, or
        "central" once started on deepnex-central's agent nodes."""
        return self._job.backend

    def start(self) -> "Job":
        """Allocates and starts everything. With deepnex-central it may wait
        in the queue (on_event says where and why); Ctrl-C meanwhile stops
        the job, withdraws the request and is raised."""
        failed = []

        def start():
            try:
                self._job.start()
            except BaseException as e:  # raised below, on the caller's thread
                failed.append(e)
        # On a thread of its own, so that signals reach Python's handlers here.
        starting = threading.Thread(target=start, name=f"deepnex start {self.name}", daemon=True)
        starting.start()
        try:
            while starting.is_alive():
                starting.join(0.2)
        except BaseException as e:
            self._job.stop(_signal.SIGINT if isinstance(e, KeyboardInterrupt) else 0)
            starting.join()
            raise
        if failed:
            raise failed[0]
        return self

    def wait(self, timeout: Optional[float] = None) -> JobResult:
        """Until every worker has ended, or stop() was called (the result's
        `stopped` says which); then the job is stopped and released. Waits in
        short slices so that Ctrl-C reaches Python."""
        import time
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = 0.2 if deadline is None else max(0.001, min(0.2, deadline - time.monotonic()))
            result = self._job.wait(step)
            if result is not None:
                return result
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(f"job {self.name} is still running")

    def stop(self, signal: int = 0) -> None:
        """Stops every container and releases every allocation. `signal`:
        the one that stopped the job, which its record in deepnex-central
        says (cancelled, exit 128 + signal); 0: failed, exit 1."""
        self._job.stop(int(signal))

    def unstopped(self):
        """The containers a stop has not stopped (yet): "worker 1 on node
        \"h2\"" for each one left to its unreachable node, or still stopping."""
        return self._job.unstopped()

    def containers(self):
        return self._job.containers()

    def allocations(self):
        return self._job.allocations()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def run(command: Sequence[str], **options) -> JobResult:
    """Starts a job, waits for it and returns its JobResult (exit_code,
    workers' ExitStatus, seconds, stopped). Stops and releases everything on every
    path, KeyboardInterrupt included. Options: see ``Job``."""
    job = Job(command, **options)
    try:
        job.start()
        return job.wait()
    finally:
        job.stop()


def _minutes(value, field):
    """`value` as a number of minutes >= 0 (at most deepnex's longest duration,
    1e9 s); InvalidArgumentError naming `field` else."""
    try:
        minutes = float(value)
    except (TypeError, ValueError):
        minutes = -1.0
    if isinstance(value, (str, bool)) or not minutes >= 0:
        raise InvalidArgumentError(f"{field}: {value!r} is not a number of minutes >= 0")
    if minutes * 60 > 1e9:
        raise InvalidArgumentError(f"{field}: {value!r} minutes is more than deepnex's longest "
                                   "duration (1e9 s, about 31 years)")
    return minutes
