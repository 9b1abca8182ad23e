"""How deepnex.tune starts a trial: subprocess_runner (one child process)
and job_runner (a deepnex job, admitted when it fits beside the running
trials)."""

import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time

from . import _tune_files
from ._tune_report import ENV_CONFIG
from ._tune_warm import _END, _receive, _send
from .errors import (AlreadyExistsError, CancelledError, DeadlineExceededError,
                     InvalidArgumentError, ResourceExhaustedError, UnavailableError)


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
    with _tune_files.open_new(log_path) as log:
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

    def __init__(self, gpu_mode, need):
        from . import gpu
        node = gpu.local_node(mode=gpu_mode)
        self.total = (node.cpus, len(node.gpus) if gpu_mode == "exclusive" else 0)
        self.need = need   # a trial's (cores, GPUs)
        self.used = [0, 0]
        self.queue = []
        self.cond = threading.Condition()

    def check(self):
        """ResourceExhaustedError when a trial could never fit."""
        need = self.need
        if any(n > t for n, t in zip(need, self.total)):
            raise ResourceExhaustedError(
                f"a trial needs {need[0]} cores and {need[1]} GPUs; this machine has "
                f"{self.total[0]} cores and {self.total[1]} GPUs")

    @property
    def trials(self):
        """How many trials of `need` fit at once."""
        return min(t // n for n, t in zip(self.need, self.total) if n > 0)

    def acquire(self, cancelled, take=None):
        """Waits until a trial's `need` fits (check() said it can) and takes
        it, or, where take() gives something first (an idle trial slot, which
        holds cores already), returns that; None when it took `need`. The waiters
        are served in arrival order either way, so trials start in the order
        they came. CancelledError once cancelled() is true (checked whenever
        wake() or a release wakes the waiters)."""
        ticket = object()
        with self.cond:
            self.queue.append(ticket)
            try:
                while True:
                    if self.queue[0] is ticket:
                        taken = take() if take is not None else None
                        if taken is not None:
                            return taken
                        if all(u + n <= t for u, n, t in zip(self.used, self.need, self.total)):
                            self.used = [u + n for u, n in zip(self.used, self.need)]
                            return None
                    if cancelled():
                        raise CancelledError("the trial's start was cancelled while it "
                                             "waited for cores and GPUs")
                    self.cond.wait()
            finally:
                self.queue.remove(ticket)
                self.cond.notify_all()

    def release(self):
        with self.cond:
            self.used = [u - n for u, n in zip(self.used, self.need)]
            self.cond.notify_all()

    def wake(self):
        with self.cond:
            self.cond.notify_all()


class _JobTrial:
    """A trial's job as the search sees it: poll(), wait(), kill()."""

    def __init__(self, job, on_end):
        self._job, self._on_end = job, on_end
        self._code = None
        self.job_name = job.name   # journalled (see _JobRunner.cancel_jobs)

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


class _Slot:
    """A trial slot: a 1-worker job whose process (_tune_warm.py slot) runs
    the trials given to it one after the other, so that a trial pays neither
    an allocation, nor a job's start and teardown, nor a fresh interpreter.
    The trial's exit code comes over the control socket; its output goes to
    its log, which the end line in the job's output closes."""

    def __init__(self, make_job, start_job, python, warm_script, warm_socket, release):
        import tempfile
        self._dir = tempfile.mkdtemp(prefix="deepnex-slot-")
        self._lock = threading.Lock()
        self._logs = []   # the logs of the trials whose end line is still to come
        self._code, self._notify, self._gone = None, None, False
        self._ended = threading.Event()
        self._release = None   # once started: the allocation is the slot's
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        control = os.path.join(self._dir, "control.sock")
        listener.bind(control)
        listener.listen(1)
        self.job = make_job([python, "-S", warm_script, "slot", control, warm_socket],
                            self._output)
        try:
            start_job(self.job)
            # The slot's process connects as it starts; a job that ends
            # first (its process failed) fails the slot.
            listener.settimeout(0.05)
            while True:
                try:
                    self._control, _ = listener.accept()
                    self._release = release
                    break
                except socket.timeout:
                    try:
                        result = self.job.wait(timeout=0.001)
                    except DeadlineExceededError:
                        continue
                    raise UnavailableError(f"tune: the trial slot's job {self.job.name} ended "
                                           f"(exit {result.exit_code}) before it connected")
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        threading.Thread(target=self._read, args=(self._control,), daemon=True).start()

    @property
    def allocation(self):
        """The job's allocation ids: the same for every trial of the slot."""
        return [a.id for a in self.job.allocations()]

    def _read(self, control):
        """The trials' exit codes, as the slot's process sends them; its
        end (it died) ends the running trial too."""
        while True:
            try:
                message, _ = _receive(control)
            except OSError:
                message = None
            with self._lock:
                if message is None:
                    self._gone = True
                else:
                    self._code = message["exit"]
                self._ended.set()
                notify, self._notify = self._notify, None
            if notify is not None:
                notify()
            if message is None:
                return

    def _output(self, who, line):
        with self._lock:
            log = self._logs[0] if self._logs else None
            if line.startswith(_END):
                if log is not None:
                    self._logs.pop(0)
                    log.close()
            elif log is not None:
                log.write(who, line)

    def on_end(self, notify):
        """notify() once the running trial has ended (at once if it has)."""
        with self._lock:
            if not self._ended.is_set():
                self._notify = notify
                return
        notify()

    def start(self, argv, env, log):
        """Runs the trial argv with env (on top of the job's) and log."""
        with self._lock:
            self._logs.append(log)
            self._code, self._notify = None, None
            self._ended.clear()
        _send(self._control, {"argv": argv, "env": env})

    def signal(self, sig):
        try:
            _send(self._control, {"signal": int(sig)})
        except OSError:
            pass

    def wait(self, timeout=None):
        """The trial's exit code; None on timeout, or when the slot's
        process is gone (the slot is broken: close() it)."""
        self._ended.wait(timeout)
        with self._lock:
            return self._code if self._ended.is_set() and not self._gone else None

    def close(self):
        """Ends the slot's job and releases its allocation."""
        control = getattr(self, "_control", None)
        if control is not None:
            control.shutdown(socket.SHUT_RDWR)   # the slot's process ends at EOF
            control.close()
            self._control = None
        job = getattr(self, "job", None)
        if job is not None:
            if self._release is not None:
                try:
                    job.wait(timeout=_KILL_GRACE)
                except DeadlineExceededError:
                    pass
            job.stop()
            self.job = None
        with self._lock:
            logs, self._logs = self._logs, []
        for log in logs:
            log.close()
        if self._release is not None:
            self._release()
            self._release = None
        shutil.rmtree(self._dir, ignore_errors=True)


class _SlotTrial:
    """A trial run by a _Slot, as the search sees it; the slot goes back to
    its runner when the trial ends, or is closed when it broke."""

    def __init__(self, slot, log, on_end):
        self._slot, self._log, self._on_end = slot, log, on_end
        self._code = None
        self.job_name = slot.job.name   # journalled (see _JobRunner.cancel_jobs)

    def poll(self):
        if self._code is None and self._slot._ended.is_set():
            self._end(self._slot.wait())
        return self._code

    def wait(self):
        if self._code is None:
            self._end(self._slot.wait())
        return self._code

    def on_end(self, notify):
        """notify() once the trial has ended, from another thread: the
        search learns it then, not at its next poll."""
        self._slot.on_end(notify)

    def kill(self):
        """SIGTERM to the trial, SIGKILL after the grace period; the slot
        stays for the next trial."""
        if self._code is not None:
            return
        self._slot.signal(signal.SIGTERM)
        if self._slot.wait(timeout=_KILL_GRACE) is None:
            self._slot.signal(signal.SIGKILL)
        self.wait()

    def _end(self, code):
        broken = code is None
        self._code = -signal.SIGKILL if broken else code
        if self._code != 0:
            # A failed trial's log is read at once (the search's start-up
            # check): its last lines first.
            self._log.closed.wait(_KILL_GRACE)
        self._on_end(self._slot, broken)


class _Log:
    """A trial's log file, written by the job's output threads."""

    def __init__(self, path):
        self._file = _tune_files.open_new(path)
        self._lock = threading.Lock()
        self.closed = threading.Event()

    def write(self, who, line):
        with self._lock:
            if not self._file.closed:
                self._file.write(f"[{who}] {line}\n")
                self._file.flush()

    def close(self):
        with self._lock:
            self._file.close()
        self.closed.set()


_MODES = ("sync", "async", "allreduce")


def _check_mode(mode):
    """`mode` if it is a job's training mode (sync, ssp:S, async, allreduce)."""
    staleness = mode[4:] if isinstance(mode, str) and mode.startswith("ssp:") else None
    if mode in _MODES or (staleness is not None and staleness.isdigit()):
        return mode
    raise InvalidArgumentError(f'mode: "{mode}" is not sync, ssp:S (S >= 0), async or allreduce')


# The words of the allocator's refusal of a request that no set of nodes
# could ever hold (src/gpu/placement.cc) or that is alone over the user's
# quota (src/gpu/allocator_state.cc), as against one that waits for
# capacity or for the user's own grants to end.
_NEVER_FITS = "can ever hold this request"

# deepnex-central's refusal of a job name it has (src/gpu/jobs_store.cc),
# and how many random names a trial's start tries.
_NAME_TAKEN = "exists: a job of that name"
_NAME_TRIES = 5


class _JobRunner:
    """job_runner()'s runner: each call starts a trial's job."""

    def __init__(self, workers, mode, ps, cpus, gpus_per_worker, gpu_mode, retry_interval,
                 job_options):
        self._job_options = dict(workers=workers, mode=_check_mode(mode), ps=ps, cpus=cpus,
                                 gpus_per_worker=gpus_per_worker, gpu_mode=gpu_mode,
                                 **job_options)
        # Bad job options, or trials that could never fit on this machine,
        # fail the search before it starts rather than every trial. A Job
        # checks its options when made, before it starts anything (and
        # before ceil() below meets a cpus of nan or inf).
        from . import job as job_module
        job_module.Job(["true"], **self._job_options)
        self._need = (workers * max(1, math.ceil(cpus)), workers * gpus_per_worker)
        self._retry_interval = retry_interval
        self._capacity = None
        if not job_options.get("central"):
            self._capacity = _Capacity(gpu_mode, self._need)
            self._capacity.check()
        self._lock = threading.Lock()
        # cancel() counts up; a start that began before a cancel() gives up.
        self._cancels = 0
        self._idle = []    # slots that run no trial now
        self._slots = []   # all of them, for close()
        # The jobs whose start() is in progress, each with its give_up():
        # central may queue a start for ever (another user's grants fill
        # its nodes), and only a stop() ends that wait.
        self._starting = {}

    @property
    def capacity(self):
        """How many trials can run at once: as many as fit on this machine's
        cores and GPUs; None with central, which queues them (and knows what
        it can grant)."""
        return self._capacity.trials if self._capacity is not None else None

    def cancel(self):
        """Starts in progress (waiting for cores and GPUs, or retrying a
        refused start) raise CancelledError; later ones go ahead."""
        with self._lock:
            self._cancels += 1
        if self._capacity is not None:
            self._capacity.wake()
        self._stop_starts()

    def _start_job(self, job, give_up):
        """job.start(); CancelledError once give_up() is true, checked here
        and whenever _stop_starts() runs (a cancel(), a slot falling idle),
        which stops the job's start where central has queued it."""
        with self._lock:
            self._starting[job] = give_up
        try:
            if give_up():
                raise CancelledError(f"job {job.name}'s start was cancelled")
            return job.start()
        except CancelledError:
            raise
        except BaseException:
            if give_up():
                raise CancelledError(f"job {job.name}'s start was cancelled") from None
            raise
        finally:
            with self._lock:
                del self._starting[job]

    def _stop_starts(self):
        """Stops the starts in progress whose give_up() is now true."""
        with self._lock:
            jobs = [job for job, give_up in self._starting.items() if give_up()]
        for job in jobs:
            job.stop()

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
        warm = _warm_argv(argv)
        if warm is not None and options["workers"] == 1 and options["mode"] == "allreduce":
            return self._in_slot(trial_id, warm, extra, log_path, options, cancelled)
        _, release = self._acquire(cancelled)
        log = _Log(log_path)

        def start():
            job = job_module.Job(argv, env=extra, name=f"trial-{trial_id}-{secrets.token_hex(3)}",
                                 output=log.write,
                                 # Restarts go to the trial's log: stderr
                                 # would break the live status table.
                                 on_event=lambda message: log.write("job", message), **options)
            return self._start_job(job, cancelled)
        try:
            job = self._retrying(start, cancelled)
        except BaseException:
            log.close()
            release()
            raise

        def on_end():
            log.close()
            release()
        return _JobTrial(job, on_end)

    def _in_slot(self, trial_id, warm, env, log_path, options, cancelled):
        """The trial in an idle slot, or in a new one when none is idle."""
        python, script, socket_path, argv = warm
        # The trial's own variables go with the trial; the slot's job has
        # those that all trials share.
        trial_env = {k: v for k, v in env.items() if k.startswith("DEEPNEX_TUNE_")}
        shared = {k: v for k, v in env.items() if k not in trial_env}
        while True:
            slot, release = self._acquire(cancelled, take=self._take_idle)
            if slot is not None:
                break
            try:
                slot = self._new_slot(trial_id, python, script, socket_path, shared, options,
                                      cancelled, release)
                break
            except CancelledError:
                # A slot fell idle while this trial waited for cores or
                # quota for a new one: it takes that slot instead.
                if cancelled():
                    raise
        log = _Log(log_path)
        try:
            slot.start(argv, trial_env, log)
        except BaseException:
            log.close()
            self._slot_free(slot, True)
            raise
        return _SlotTrial(slot, log, self._slot_free)

    def _take_idle(self):
        """An idle slot, taken; None when none is idle."""
        with self._lock:
            return self._idle.pop(0) if self._idle else None

    def _acquire(self, cancelled, take=None):
        """Waits for a trial's cores and GPUs, or for what take() gives
        first (an idle slot), in the order the trials came (CancelledError
        once cancelled() is true). Returns (what take() gave, None) or (None,
        what releases the cores and GPUs, once)."""
        capacity = self._capacity
        if capacity is None:  # central queues the trial's gang
            taken = take() if take is not None else None
            return (taken, None) if taken is not None else (None, lambda: None)
        taken = capacity.acquire(cancelled, take)
        if taken is not None:
            return taken, None
        released = []

        def release():
            if not released:
                released.append(True)
                capacity.release()
        return None, release

    def _retrying(self, start, cancelled):
        """start(), again every retry_interval while resources are short.
        A gang that deepnex-central says no set of its nodes, or no grant
        within the user's quota, could ever hold fails at once: waiting
        would never end. start() names its job anew each time: a name that
        central has already (its job names are central-wide, kept for the
        job history, another user's too) is tried again at once."""
        clashes = 0
        while True:
            try:
                return start()
            except AlreadyExistsError as e:
                clashes += 1
                if _NAME_TAKEN not in str(e) or clashes >= _NAME_TRIES:
                    raise
            except ResourceExhaustedError as e:
                if _NEVER_FITS in str(e):
                    raise
                if cancelled():
                    raise CancelledError("the trial's start was cancelled while its job "
                                         "waited for resources") from None
                time.sleep(self._retry_interval)

    def _new_slot(self, trial_id, python, script, socket_path, env, options, cancelled,
                  release):
        """A new slot, on the cores and GPUs that release() gives back."""
        # A slot that falls idle while central's quota is full ends the
        # wait: the trial takes that slot instead.
        def give_up():
            return cancelled() or bool(self._idle)

        def make_job(argv, output):
            from . import job as job_module
            # The slot's log lines come through the slot; its job events
            # (restarts) to the log of the trial it runs.
            return job_module.Job(argv, env=env, name=f"slot-{trial_id}-{secrets.token_hex(3)}",
                                  output=output, on_event=lambda m: output("job", m),
                                  **options)
        try:
            slot = self._retrying(
                lambda: _Slot(make_job, lambda job: self._start_job(job, give_up), python,
                              script, socket_path, release),
                give_up)
        except BaseException:
            release()
            raise
        with self._lock:
            self._slots.append(slot)
        return slot

    def _slot_free(self, slot, broken):
        with self._lock:
            if not broken:
                self._idle.append(slot)
            else:
                self._slots.remove(slot)
        if broken:
            slot.close()
        if self._capacity is not None:
            self._capacity.wake()   # a trial waiting for cores may take the idle slot
        else:
            # A trial whose new slot waits in central's queue takes the idle
            # one: the idle slot may hold the very GPUs that it waits for,
            # until the search's end, which waits for that trial.
            self._stop_starts()

    def cancel_jobs(self, names):
        """Cancels those of `names` (trial and slot jobs that a killed
        search started) that deepnex-central still has running: a resume's
        trials would otherwise wait for their allocations, which central
        holds for a lost runner for minutes (--job-lost-release-after).
        Returns the names cancelled."""
        central = self._job_options.get("central")
        if not central or not names:
            return []
        from . import gpu
        from .errors import FailedPreconditionError, NotFoundError
        client = gpu.CentralClient(central, token=self._job_options.get("central_token"),
                                   token_file=self._job_options.get("central_token_file"),
                                   timeout=10)
        cancelled = []
        for job in client.jobs():
            if job["name"] in names:
                try:
                    client.cancel_job(job["name"])
                    cancelled.append(job["name"])
                except (FailedPreconditionError, NotFoundError):
                    pass   # it ended meanwhile
        return cancelled

    def close(self):
        """Ends the idle slots' jobs, releasing their allocations (the
        search calls it once its trials have ended)."""
        with self._lock:
            slots, self._slots, self._idle = self._slots, [], []
        for slot in slots:
            slot.close()


def _warm_argv(argv):
    """(python, warm script, socket, the trial's argv) when argv runs a
    trial through a warm worker (_tune_search's _Warm.wrap); else None."""
    from . import _tune_warm
    if len(argv) > 5 and argv[1:4] == ["-S", _tune_warm.__file__, "run"]:
        return argv[0], argv[2], argv[4], argv[5:]
    return None


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
    fit beside the running trials' (trials wait, in order). Bad job options
    and trials that could never fit on this machine raise here, before any
    trial runs (InvalidArgumentError, ResourceExhaustedError). With
    ``central`` deepnex-central queues the trial's gang, and refuses one
    that no set of its nodes could ever hold: that trial fails at once with
    its reason. Other starts refused for lack of resources (ResourceExhausted,
    e.g. the user's quota) are retried every ``retry_interval`` seconds. The
    runner's cancel() ends the waits of starts in progress.

    Warm 1-worker allreduce trials run in slots: a slot's job (allocation,
    store, worker process) outlives its trial and runs the next one, forked
    from the warm worker, with its own environment, exit code and log. The
    runner's close() (the search calls it at its end) stops the slots' jobs
    and releases their allocations."""
    return _JobRunner(workers, mode, ps, cpus, gpus_per_worker, gpu_mode, retry_interval,
                      job_options)
