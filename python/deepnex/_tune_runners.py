"""How deepnex.tune starts a trial: subprocess_runner (one child process)
and job_runner (a deepnex job, admitted when it fits beside the running
trials)."""

import json
import math
import os
import secrets
import signal
import subprocess
import threading
import time

from ._tune_report import ENV_CONFIG
from .errors import (CancelledError, DeadlineExceededError, InvalidArgumentError,
                     ResourceExhaustedError)


# How long a trial has to end after SIGTERM before it is killed: as long as
# a job's workers get (deepnex.job's Stop).
_KILL_GRACE = 2.0


class _ProcessTrial:
    """A plain trial process, in a process group of its own: a Ctrl-C at
    the terminal reaches the search only, which stops its trials itself."""

    def __init__(self, popen):
        self._p = popen

    def poll(self):
        return self._p.poll()

    def wait(self):
        return self._p.wait()

    def kill(self):
        """SIGTERM to the trial's process group; SIGKILL after the grace period."""
        if self._p.poll() is not None:
            return
        self._signal(signal.SIGTERM)
        try:
            self._p.wait(timeout=_KILL_GRACE)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self._p.wait()

    def _signal(self, sig):
        try:
            os.killpg(self._p.pid, sig)
        except ProcessLookupError:
            pass


def subprocess_runner(trial_id, argv, env, log_path):
    """A runner: the trial as one child process (its own process group),
    output to log_path."""
    with open(log_path, "w") as log:
        return _ProcessTrial(subprocess.Popen(argv, env=env, stdout=log,
                                              stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL,
                                              start_new_session=True))


# Configuration keys that also configure a trial job's parameter servers
# (deepnex run's --optimizer, --lr, --momentum).
_SERVER_OPTIONS = ("optimizer", "lr", "momentum")


class _Capacity:
    """The machine's cores and GPUs as the local allocator counts them,
    shared by the trials of one job_runner. Each Job's allocator sees the
    whole machine, so this is what keeps concurrent trials within it: a
    trial waits, in arrival order, until its gang fits beside the running
    ones."""

    def __init__(self, gpu_mode):
        from . import gpu
        node = gpu.local_node(mode=gpu_mode)
        self.total = (node.cpus, len(node.gpus) if gpu_mode == "exclusive" else 0)
        self.used = [0, 0]
        self.queue = []
        self.cond = threading.Condition()

    def acquire(self, need, cancelled):
        """Waits until `need` fits; CancelledError once cancelled() is true
        (checked whenever wake() or a release wakes the waiters)."""
        if any(n > t for n, t in zip(need, self.total)):
            raise ResourceExhaustedError(
                f"a trial needs {need[0]} cores and {need[1]} GPUs; this machine has "
                f"{self.total[0]} cores and {self.total[1]} GPUs")
        ticket = object()
        with self.cond:
            self.queue.append(ticket)
            try:
                while not (self.queue[0] is ticket and all(
                        u + n <= t for u, n, t in zip(self.used, need, self.total))):
                    if cancelled():
                        raise CancelledError("the trial's start was cancelled while it "
                                             "waited for cores and GPUs")
                    self.cond.wait()
            finally:
                self.queue.remove(ticket)
                self.cond.notify_all()
            self.used = [u + n for u, n in zip(self.used, need)]

    def release(self, need):
        with self.cond:
            self.used = [u - n for u, n in zip(self.used, need)]
            self.cond.notify_all()

    def wake(self):
        with self.cond:
            self.cond.notify_all()


class _JobTrial:
    """A trial's job as the search sees it: poll(), wait(), kill()."""

    def __init__(self, job, on_end):
        self._job, self._on_end = job, on_end
        self._code = None

    def poll(self):
        if self._code is None:
            try:
                self._end(self._job.wait(timeout=0.01))
            except DeadlineExceededError:
                pass
        return self._code

    def wait(self):
        if self._code is None:
            self._end(self._job.wait())
        return self._code

    def kill(self):
        """Stops the job: SIGTERM, SIGKILL after its grace period, and its
        allocations released."""
        if self._code is None:
            self._job.stop()

    def _end(self, result):
        # A job that was stopped exits 0 (nothing failed); a trial whose
        # workers were killed reads as a killed process does: -signal.
        signals = [w.signal for w in result.workers if w.reason == "signaled"]
        self._code = result.exit_code or (-signals[0] if signals else 0)
        self._job.stop()
        # Dropping the job removes its directory (trial-*) under the run
        # directory now, not whenever the handle is collected.
        self._job = None
        self._on_end()


class _Log:
    """A trial's log file, written by the job's output threads."""

    def __init__(self, path):
        self._file = open(path, "w")
        self._lock = threading.Lock()

    def write(self, who, line):
        with self._lock:
            if not self._file.closed:
                self._file.write(f"[{who}] {line}\n")
                self._file.flush()

    def close(self):
        with self._lock:
            self._file.close()


_MODES = ("sync", "async", "allreduce")


def _check_mode(mode):
    """`mode` if it is a job's training mode (sync, ssp:S, async, allreduce)."""
    staleness = mode[4:] if isinstance(mode, str) and mode.startswith("ssp:") else None
    if mode in _MODES or (staleness is not None and staleness.isdigit()):
        return mode
    raise InvalidArgumentError(f'mode: "{mode}" is not sync, ssp:S (S >= 0), async or allreduce')


class _JobRunner:
    """job_runner()'s runner: each call starts a trial's job."""

    def __init__(self, workers, mode, ps, cpus, gpus_per_worker, gpu_mode, retry_interval,
                 job_options):
        self._job_options = dict(workers=workers, mode=_check_mode(mode), ps=ps, cpus=cpus,
                                 gpus_per_worker=gpus_per_worker, gpu_mode=gpu_mode,
                                 **job_options)
        self._need = (workers * max(1, math.ceil(cpus)), workers * gpus_per_worker)
        self._gpu_mode, self._retry_interval = gpu_mode, retry_interval
        self._capacity = None
        self._lock = threading.Lock()
        # cancel() counts up; a start that began before a cancel() gives up.
        self._cancels = 0

    def cancel(self):
        """Starts in progress (waiting for cores and GPUs, or retrying a
        refused start) raise CancelledError; later ones go ahead."""
        with self._lock:
            self._cancels += 1
            capacity = self._capacity
        if capacity is not None:
            capacity.wake()

    def __call__(self, trial_id, argv, env, log_path):
        from . import job as job_module
        cancels = self._cancels

        def cancelled():
            return self._cancels != cancels
        config = json.loads(env.get(ENV_CONFIG, "{}"))
        options = dict(self._job_options)
        options.update({k: config[k] for k in _SERVER_OPTIONS if k in config})
        # The job's processes inherit this process's environment; the
        # trial's own variables come on top.
        extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
        capacity = None
        if not options.get("central"):
            with self._lock:
                if self._capacity is None:
                    self._capacity = _Capacity(self._gpu_mode)
                capacity = self._capacity
            capacity.acquire(self._need, cancelled)
        released = []

        def release():
            if capacity is not None and not released:
                released.append(True)
                capacity.release(self._need)

        log = _Log(log_path)
        try:
            while True:
                job = job_module.Job(argv, env=extra,
                                     name=f"trial-{trial_id}-{secrets.token_hex(3)}",
                                     output=log.write,
                                     # Restarts go to the trial's log: stderr
                                     # would break the live status table.
                                     on_event=lambda message: log.write("job", message),
                                     **options)
                try:
                    job.start()
                    break
                except ResourceExhaustedError:
                    if cancelled():
                        raise CancelledError("the trial's start was cancelled while its job "
                                             "waited for resources") from None
                    time.sleep(self._retry_interval)
        except BaseException:
            log.close()
            release()
            raise

        def on_end():
            log.close()
            release()
        return _JobTrial(job, on_end)


def job_runner(workers=1, mode="allreduce", ps=None, cpus=1, gpus_per_worker=0,
               gpu_mode="exclusive", retry_interval=1.0, **job_options):
    """A runner that runs each trial as a deepnex job: ``workers`` workers
    in ``mode`` (sync, ssp:S, async with parameter servers; allreduce
    without), each with ``cpus`` cores and ``gpus_per_worker`` GPUs; other
    options go to deepnex.job.Job (backend, memory, central, central_token,
    restart, ...). A trial's configuration values for optimizer, lr and
    momentum also go to its parameter servers, which apply the updates in
    the PS modes.

    With the local allocator a trial starts once its workers' cores and GPUs
    fit beside the running trials' (trials wait, in order); a trial that
    could never fit on this machine fails. With ``central`` deepnex-central
    queues the trial's gang. A start refused for lack of resources
    (ResourceExhausted) is retried every ``retry_interval`` seconds. The
    runner's cancel() ends the waits of starts in progress."""
    return _JobRunner(workers, mode, ps, cpus, gpus_per_worker, gpu_mode, retry_interval,
                      job_options)
