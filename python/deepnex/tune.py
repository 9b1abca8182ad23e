"""Hyperparameter search: ``deepnex.tune`` (and ``deepnex tune``).

A search runs a training command once per configuration (a trial), as many
at once as the machine's capacity (and ``max_concurrent``) allows, and ends in a results table, a CSV and
the best configuration::

    from deepnex import tune
    results = tune.run(
        ["python3", "examples/digits/mlp_numpy.py", "--mode", "allreduce"],
        space={"lr": tune.loguniform(0.01, 0.5), "hidden": tune.choice([32, 64, 128])},
        metric="accuracy", mode="max", num_samples=8,
        scheduler=tune.ASHA(max_t=12))
    results.best.config

Search spaces: ``uniform(a, b)``, ``loguniform(a, b)``, ``randint(a, b)``
(a <= n < b), ``choice([...])`` are sampled (random search); ``grid([...])``
dimensions are expanded into every combination (grid search); plain values
are passed as they are. ``num_samples`` configurations are drawn for each
grid point.

A trial gets its configuration as ``--name value`` arguments (underscores in
names become dashes) and as JSON in $DEEPNEX_TUNE_CONFIG (``get_config()``).
The training script calls ``deepnex.tune.report(step=epoch, accuracy=acc)``:
the metrics travel through a deepnex.collective.Store served by the search,
and the call returns True when the scheduler (ASHA) stops the trial, which
should then end. Outside a search report() does nothing and returns False.
In a multi-worker trial every worker calls report() at the same steps, one of
them (rank 0) with the metrics: all of them get the same answer.

While trials run, the search shows their status (trial, state, last
metric, parameters): a table redrawn in place on a terminal, otherwise a
line when a trial starts and one when it ends. Ctrl-C (SIGINT) or SIGTERM
ends a search cleanly: no trial is started any more, the running ones are
stopped (SIGTERM, SIGKILL after a grace period) and their allocations
released, results.csv and best.json are written for what finished, and
run() raises ``Interrupted`` (a KeyboardInterrupt); ``deepnex tune`` exits
130 or 143. A trial whose search is gone fails in report() within 5 s.

Trials are started by a runner, ``runner(trial_id, argv, env, log_path)`` ->
an object with poll(), wait() and kill() (kill: stop it, waiting out its
grace period). A runner may have cancel(): an interrupted search calls it,
and the starts then waiting for resources raise CancelledError. The
default, ``job_runner()``, runs each trial as a deepnex job
(deepnex.job.Job: allocated cores and GPUs, its workers started with the job
environment, parameter servers in the PS modes) and starts a trial only when
its workers fit on the machine beside the running trials', so trials run in
parallel up to the machine's capacity::

    tune.run(cmd, space, runner=tune.job_runner(workers=2, mode="sync"))

``subprocess_runner`` runs each trial as one plain child process.
"""

import ast
import csv
import itertools
import json
import math
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from .errors import (CancelledError, DeadlineExceededError, InvalidArgumentError,
                     ResourceExhaustedError, UnavailableError)

__all__ = ["uniform", "loguniform", "randint", "choice", "grid", "ASHA", "run",
           "report", "get_config", "generate_configs", "parse_space", "Trial", "Results",
           "Interrupted", "job_runner", "subprocess_runner"]

ENV_STORE = "DEEPNEX_TUNE_STORE"
ENV_TRIAL = "DEEPNEX_TUNE_TRIAL"
ENV_CONFIG = "DEEPNEX_TUNE_CONFIG"


# ---- search spaces

class _Domain:
    def sample(self, rng):
        raise NotImplementedError


@dataclass(frozen=True)
class _Uniform(_Domain):
    low: float
    high: float

    def sample(self, rng):
        return rng.uniform(self.low, self.high)


@dataclass(frozen=True)
class _LogUniform(_Domain):
    low: float
    high: float

    def sample(self, rng):
        return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))


@dataclass(frozen=True)
class _RandInt(_Domain):
    low: int
    high: int

    def sample(self, rng):
        return rng.randrange(self.low, self.high)


@dataclass(frozen=True)
class _Choice(_Domain):
    values: tuple

    def sample(self, rng):
        return rng.choice(self.values)


@dataclass(frozen=True)
class _Grid:
    values: tuple


def _check_range(name, low, high):
    if not low < high:
        raise InvalidArgumentError(f"{name}({low}, {high}): low must be below high")


def uniform(low, high):
    """A float drawn uniformly from [low, high)."""
    _check_range("uniform", low, high)
    return _Uniform(float(low), float(high))


def loguniform(low, high):
    """A float whose logarithm is uniform: as likely in [1e-3, 1e-2) as in
    [1e-2, 1e-1). 0 < low < high."""
    _check_range("loguniform", low, high)
    if low <= 0:
        raise InvalidArgumentError(f"loguniform({low}, {high}): low must be positive")
    return _LogUniform(float(low), float(high))


def randint(low, high):
    """An int n with low <= n < high."""
    _check_range("randint", low, high)
    return _RandInt(int(low), int(high))


def choice(values):
    """One of `values`, each equally likely."""
    values = tuple(values)
    if not values:
        raise InvalidArgumentError("choice([]): needs at least one value")
    return _Choice(values)


def grid(values):
    """Every one of `values`: the search runs each (times the other grid
    dimensions' values, times num_samples)."""
    values = tuple(values)
    if not values:
        raise InvalidArgumentError("grid([]): needs at least one value")
    return _Grid(values)


def generate_configs(space, num_samples=1, seed=0):
    """The configurations of a search: for each combination of the grid()
    dimensions (in the order of `space`), num_samples draws of the others."""
    if num_samples < 1:
        raise InvalidArgumentError(f"num_samples: {num_samples} must be at least 1")
    rng = random.Random(seed)
    grid_keys = [k for k, v in space.items() if isinstance(v, _Grid)]
    configs = []
    for point in itertools.product(*(space[k].values for k in grid_keys)):
        for _ in range(num_samples):
            config = {}
            for k, v in space.items():
                if isinstance(v, _Grid):
                    config[k] = point[grid_keys.index(k)]
                elif isinstance(v, _Domain):
                    config[k] = v.sample(rng)
                else:
                    config[k] = v
            configs.append(config)
    return configs


_FUNCTIONS = {"uniform": uniform, "loguniform": loguniform, "randint": randint,
              "choice": choice, "grid": grid}


def parse_space(specs):
    """A space from "name=expr" strings, expr a Python literal or one of
    uniform(a, b), loguniform(a, b), randint(a, b), choice([...]), grid([...]):
    ``parse_space(["lr=loguniform(1e-3, 0.5)", "hidden=grid([32, 64])"])``."""
    space = {}
    for spec in specs:
        name, sep, expr = spec.partition("=")
        name, expr = name.strip(), expr.strip()
        if not sep or not name:
            raise InvalidArgumentError(f'space: "{spec}" is not name=expression')
        try:
            node = ast.parse(expr, mode="eval").body
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id not in _FUNCTIONS or node.keywords:
                    raise ValueError(f"unknown function {node.func.id}")
                args = [ast.literal_eval(a) for a in node.args]
                space[name] = _FUNCTIONS[node.func.id](*args)
            else:
                space[name] = ast.literal_eval(node)
        except InvalidArgumentError:
            raise
        except (SyntaxError, ValueError, TypeError) as e:
            raise InvalidArgumentError(
                f'space: "{spec}": {e} (use a literal, uniform(a, b), loguniform(a, b), '
                f'randint(a, b), choice([...]) or grid([...]))') from None
    return space


# ---- ASHA

class ASHA:
    """Asynchronous successive halving (Li et al., 2020), as early stopping.

    Rungs sit at t = min_t * eta^k below max_t. When a trial first reports a
    step t at or past a rung above the ones it has been judged at, its value
    is recorded at the highest such rung; the trial goes on only if it is among the top max(1, floor(n/eta))
    of the n values recorded at that rung so far (itself included; ties go
    on), so early trials are promoted optimistically and later ones must beat
    the rung's record. A trial that reaches max_t is done.
    """

    def __init__(self, metric="accuracy", mode="max", min_t=1, max_t=100, eta=3):
        if mode not in ("max", "min"):
            raise InvalidArgumentError(f'mode: "{mode}" is not max or min')
        if min_t < 1 or max_t < min_t:
            raise InvalidArgumentError(f"min_t={min_t}, max_t={max_t}: need 1 <= min_t <= max_t")
        if eta < 2:
            raise InvalidArgumentError(f"eta: {eta} must be at least 2")
        self.metric, self.mode = metric, mode
        self.min_t, self.max_t, self.eta = min_t, max_t, eta
        self.rungs = []
        t = min_t
        while t < max_t:
            self.rungs.append(t)
            t *= eta
        self._recorded = {r: {} for r in self.rungs}

    def recorded(self, rung):
        """{trial: value} at `rung`."""
        return dict(self._recorded[rung])

    def on_result(self, trial, t, value):
        """"continue" or "stop" for `trial` reporting `value` at step `t`."""
        if t >= self.max_t:
            return "stop"
        for rung in reversed(self.rungs):
            if t < rung:
                continue
            if trial in self._recorded[rung]:
                break  # judged here already; lower rungs are behind it
            values = self._recorded[rung]
            values[trial] = value
            sign = 1 if self.mode == "max" else -1
            better = sum(1 for v in values.values() if sign * v > sign * value)
            if better >= max(1, len(values) // self.eta):
                return "stop"
            break
        return "continue"


# ---- reporting from a trial

_report_state = {"client": None, "count": 0}

# A live search answers a call at once (its store is served by C++ threads,
# whatever its Python threads do); one that has not answered within this
# many seconds is gone (killed, or ended while its trial went on).
_REACH_TIMEOUT = 2.0
# How long report() waits for a decision between checks that the search is
# still there: with _REACH_TIMEOUT (and the store's 1 s grace on a wait),
# a trial learns that its search is gone within 3.5 s, and exits within 5.
_DECISION_SLICE = 0.5


def get_config():
    """This trial's configuration ({} outside a search)."""
    return json.loads(os.environ.get(ENV_CONFIG, "{}"))


def report(step, timeout=600.0, **metrics):
    """Reports `metrics` at `step` to the search running this trial; returns
    True when the trial should stop. Outside a search: False. Workers without
    metrics (ranks other than 0) wait, up to `timeout` seconds, for the
    answer to rank 0's report of the same step. A search that is gone
    (killed, or ended) raises UnavailableError within 5 s, so that the trial
    ends rather than training on for nobody."""
    address, trial = os.environ.get(ENV_STORE), os.environ.get(ENV_TRIAL)
    if not address or not trial:
        return False
    from .collective import StoreClient
    deadline = time.monotonic() + timeout
    try:
        if _report_state["client"] is None:
            # Connecting is the first contact: a search already gone fails here.
            _report_state["client"] = StoreClient(address, prefix=f"tune/{trial}",
                                                  timeout=_REACH_TIMEOUT)
        client = _report_state["client"]
        if metrics:
            record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
            client.set(f"report/{_report_state['count']}", json.dumps(record))
            _report_state["count"] += 1
        while True:
            left = deadline - time.monotonic()
            try:
                return client.get(f"decision/{step}",
                                  timeout=max(0.001, min(_DECISION_SLICE, left))) == b"stop"
            except DeadlineExceededError:
                if left <= _DECISION_SLICE:
                    break
                # No answer yet, or no search: check() tells them apart.
                client.check([f"decision/{step}"])
    except (DeadlineExceededError, UnavailableError, CancelledError) as e:
        raise UnavailableError(
            f"tune.report(step={step}): the search at {address} that runs trial {trial} "
            f"does not answer ({e}); the trial should end") from None
    raise DeadlineExceededError(
        f"tune.report(step={step}): no decision within {timeout:g} s (does rank 0 report "
        f"step {step}?)")


# ---- running a search

@dataclass
class Trial:
    id: int
    config: dict
    # pending, running, stopping (told to stop, not ended yet), then one of
    # completed, stopped (early, by the scheduler), failed (exit N),
    # interrupted (ended by Ctrl-C / SIGTERM), not started.
    status: str = "pending"
    results: list = field(default_factory=list)
    log_path: str = ""
    exit_code: int = None

    @property
    def last(self):
        return self.results[-1] if self.results else {}

    @property
    def finished(self):
        """Whether the trial ran to an end of its own (or the scheduler's)."""
        return self.status not in ("pending", "running", "stopping", "interrupted",
                                   "not started")


@dataclass
class Results:
    trials: list
    metric: str
    mode: str
    csv_path: str
    interrupted: str = None     # "SIGINT" or "SIGTERM" when a signal ended the search

    @property
    def best(self):
        """The finished trial whose last reported metric is best (None if
        none reported)."""
        scored = [t for t in self.trials if t.finished and self.metric in t.last]
        if not scored:
            return None
        sign = 1 if self.mode == "max" else -1
        return max(scored, key=lambda t: sign * t.last[self.metric])


class Interrupted(KeyboardInterrupt):
    """Raised by run() when SIGINT (Ctrl-C) or SIGTERM ended the search,
    after the running trials were stopped and results.csv and best.json
    written for the finished ones. A KeyboardInterrupt, so that a script's
    Ctrl-C handling still applies. ``signal``: the signal's number,
    ``exit_code``: 128 + it (130, 143), ``results``: the Results."""

    def __init__(self, signum, results):
        finished = sum(1 for t in results.trials if t.finished)
        super().__init__(f"tune: interrupted by {signal.Signals(signum).name}: {finished} of "
                         f"{len(results.trials)} trials finished; results in {results.csv_path}")
        self.signal, self.exit_code, self.results = signum, 128 + signum, results


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


def _config_args(config):
    args = []
    for k, v in config.items():
        args += [f"--{k.replace('_', '-')}", f"{v:.6g}" if isinstance(v, float) else str(v)]
    return args


def _shown(value):
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _params(config):
    return " ".join(f"{k}={_shown(v)}" for k, v in config.items())


class _Status:
    """What the search shows while trials run. On a terminal: a table (trial,
    state, step, metric, parameters) redrawn in place a few times a second.
    Otherwise (a pipe, a log): a line when a trial starts and one when it
    ends, never one per report. Lines given to say() stay above the table.
    Thread-safe."""

    REFRESH = 0.25   # seconds between redraws of a changed table

    def __init__(self, trials, metric, out):
        self.trials, self.metric, self.out = trials, metric, out
        try:
            self.tty = out.isatty() and os.environ.get("TERM") != "dumb"
        except (AttributeError, ValueError):
            self.tty = False
        self._lock = threading.Lock()
        self._drawn = 0          # lines of the table on the screen now
        self._dirty = False
        self._closed = threading.Event()
        self._thread = None
        if self.tty:
            self._thread = threading.Thread(target=self._refresh, daemon=True)
            self._thread.start()

    def say(self, line):
        with self._lock:
            self._erase()
            print(line, file=self.out, flush=True)
            self._dirty = True

    def started(self, trial):
        self._changed(f"trial {trial.id} {trial.status}: {_params(trial.config)}")

    def updated(self):
        """A trial reported or was told to stop: the table's business only."""
        self._changed(None)

    def ended(self, trial):
        line = f"trial {trial.id} {trial.status}"
        if trial.results:
            line += f" at step {_shown(trial.last.get('step'))}"
            if self.metric in trial.last:
                line += f": {self.metric}={_shown(trial.last[self.metric])}"
        self._changed(line)

    def close(self):
        """Stops redrawing and takes the table off the screen."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._erase()

    def _changed(self, line):
        with self._lock:
            if self.tty:
                self._dirty = True
            elif line is not None:
                print(line, file=self.out, flush=True)

    def _refresh(self):
        while not self._closed.wait(self.REFRESH):
            with self._lock:
                if self._dirty:
                    self._erase()
                    self._draw()

    def _erase(self):
        if self._drawn:
            # To the first line of the table, then clear to the end of the screen.
            self.out.write(f"\x1b[{self._drawn}F\x1b[J")
            self.out.flush()
            self._drawn = 0

    def _draw(self):
        size = shutil.get_terminal_size()
        trials = self.trials
        counts = {}
        for t in trials:
            counts[t.status.split(" ")[0]] = counts.get(t.status.split(" ")[0], 0) + 1
        head = "tune: " + ", ".join(f"{n} {state}" for state, n in counts.items())
        rows = [["trial", "state", "step", self.metric, "parameters"]]
        room = max(3, size.lines - 4)
        shown = trials
        if len(trials) > room:
            # The running ones first, then the finished, then the pending.
            order = {"running": 0, "stopping": 0, "pending": 2}
            shown = sorted(sorted(trials, key=lambda t: order.get(t.status, 1))[:room - 1],
                           key=lambda t: t.id)
        for t in shown:
            rows.append([str(t.id), t.status, _shown(t.last.get("step", "")),
                         _shown(t.last.get(self.metric, "")), _params(t.config)])
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4]
                          for r in rows]
        if len(shown) < len(trials):
            lines.append(f"... {len(trials) - len(shown)} more")
        # A line that wraps would throw the cursor arithmetic off.
        lines = [line[:max(1, size.columns - 1)] for line in lines]
        self.out.write("\n".join(lines) + "\n")
        self.out.flush()
        self._drawn, self._dirty = len(lines), False


class _Search:
    def __init__(self, command, metric, mode, scheduler, runner, env, out_dir, stop_grace,
                 status):
        from .collective import Store
        self.command, self.metric, self.mode = list(command), metric, mode
        self.scheduler, self.runner = scheduler, runner or job_runner()
        self.env, self.out_dir, self.stop_grace = env, out_dir, stop_grace
        self.status = status
        self.store = Store("127.0.0.1:0")
        self.lock = threading.Lock()
        self.running = {}      # trial id -> handle
        self.interrupted = None   # the signal that ended the search early

    def interrupt(self, signum):
        """Ends the search early: no trial starts any more, and each running
        trial's thread stops it (kill(): SIGTERM, SIGKILL after a grace period)."""
        with self.lock:
            if self.interrupted is not None:
                return
            self.interrupted = signum
            running = len(self.running)
        pending = sum(1 for t in self.status.trials if t.status == "pending")
        self.status.say(f"tune: {signal.Signals(signum).name}: stopping {running} running "
                        f"trial{'' if running == 1 else 's'}; {pending} not started")
        cancel = getattr(self.runner, "cancel", None)
        if cancel is not None:
            cancel()

    def kill_all(self):
        """Ends every running trial now, from this thread (when the search
        cannot wait for its trials' threads to do it)."""
        with self.lock:
            handles = list(self.running.values())
        for h in handles:
            h.kill()

    def run_trial(self, trial):
        from .collective import StoreClient
        env = dict(os.environ)
        env.update(self.env or {})
        env.update({ENV_STORE: self.store.address, ENV_TRIAL: str(trial.id),
                    ENV_CONFIG: json.dumps(trial.config)})
        trial.log_path = os.path.join(self.out_dir, f"trial_{trial.id}.log")
        if self.interrupted is not None:
            trial.status = "not started"
            return
        handle = self.runner(trial.id, self.command + _config_args(trial.config), env,
                             trial.log_path)
        with self.lock:
            self.running[trial.id] = handle
        trial.status = "running"
        self.status.started(trial)
        client = StoreClient(self.store.address, prefix=f"tune/{trial.id}")
        stopped_at = None
        interrupted = killed = False
        while True:
            if self.interrupted is not None and not interrupted:
                # Stopping a job waits out its grace period: each trial's
                # thread stops its own, so they stop together.
                interrupted = True
                trial.status = "stopping"
                self.status.updated()
                handle.kill()
            try:
                record = json.loads(client.get(f"report/{len(trial.results)}", timeout=0.2))
            except DeadlineExceededError:
                if handle.poll() is not None:
                    # A report may have landed after the last wait.
                    if client.check([f"report/{len(trial.results)}"])[0]:
                        continue
                    break
                if (stopped_at is not None and not killed
                        and time.monotonic() - stopped_at > self.stop_grace):
                    killed = True
                    handle.kill()
                continue
            trial.results.append(record)
            decision = "continue"
            if self.interrupted is not None:
                # The loop's top stops the trial; it ends "interrupted", never
                # "stopped" early by the scheduler, even when the signal came
                # after that check.
                decision = "stop"
            elif self.scheduler is not None and self.metric in record:
                with self.lock:
                    decision = self.scheduler.on_result(trial.id, record["step"],
                                                        record[self.metric])
                if decision == "stop" and stopped_at is None:
                    stopped_at = time.monotonic()
                    trial.status = "stopping"
            client.set(f"decision/{record['step']}", decision)
            self.status.updated()
        trial.exit_code = handle.wait()
        with self.lock:
            del self.running[trial.id]
        max_t = getattr(self.scheduler, "max_t", None)
        early = (stopped_at is not None
                 and not (max_t is not None and trial.last.get("step", 0) >= max_t))
        if early:
            trial.status = "stopped"
        elif interrupted:
            trial.status = "interrupted"
        elif trial.exit_code == 0:
            trial.status = "completed"
        else:
            trial.status = f"failed (exit {trial.exit_code})"
        self.status.ended(trial)


class _Signals:
    """SIGINT and SIGTERM, while a search runs in the main thread: the
    handler only notes the signal (it runs between two bytecodes of the main
    thread, which may hold any lock); the search's loop acts on it."""

    def __init__(self):
        self.received = []
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum, frame):
        self.received.append(signum)

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def run(command, space, metric="accuracy", mode="max", num_samples=1, scheduler=None,
        max_concurrent=None, seed=0, out_dir="tune-results", runner=None, env=None,
        stop_grace=30.0, out=None):
    """Runs the search and returns its Results; shows the trials' status
    while they run (see the module's doc), then prints the table and the
    best configuration, and writes <out_dir>/results.csv, <out_dir>/best.json
    and each trial's log.

    scheduler: ASHA(...) or None (every trial runs to its end). A trial that
    goes on running stop_grace seconds after being told to stop is killed.
    runner: how a trial starts (default job_runner(): a 1-worker allreduce
    job). max_concurrent: a limit of the search's own; None: as many trials
    at once as the runner admits (job_runner: what fits on the machine;
    subprocess_runner: every trial).

    SIGINT (Ctrl-C) or SIGTERM, when run() runs in the main thread: no trial
    starts any more, the running ones are stopped, results.csv and best.json
    are written for the finished ones (the interrupted ones are in the CSV
    with status "interrupted"), and run() raises Interrupted. A second
    signal stops the waiting for the trials' threads.
    """
    if mode not in ("max", "min"):
        raise InvalidArgumentError(f'mode: "{mode}" is not max or min')
    if max_concurrent is not None and max_concurrent < 1:
        raise InvalidArgumentError(f"max_concurrent: {max_concurrent} must be at least 1")
    out = out or sys.stdout
    os.makedirs(out_dir, exist_ok=True)
    trials = [Trial(i, c) for i, c in enumerate(generate_configs(space, num_samples, seed))]
    status = _Status(trials, metric, out)
    signals = _Signals()
    search = None
    try:
        try:
            search = _Search(command, metric, mode, scheduler, runner, env, out_dir,
                             stop_grace, status)
            _run_trials(search, trials, max_concurrent, signals)
        finally:
            if search is not None:
                search.store.stop()
            status.close()
        results = Results(trials, metric, mode, os.path.join(out_dir, "results.csv"))
        if search.interrupted is not None:
            results.interrupted = signal.Signals(search.interrupted).name
        _write_results(results, out_dir, out)
    finally:
        signals.restore()
    if search.interrupted is not None:
        raise Interrupted(search.interrupted, results)
    return results


def _run_trials(search, trials, max_concurrent, signals):
    """Starts a thread per trial as slots free up and waits for them,
    acting on the signals received meanwhile."""
    at_once = "up to capacity" if max_concurrent is None else f"{max_concurrent} at a time"
    search.status.say(f"tune: {len(trials)} trials, {at_once}, metric {search.metric} "
                      f"({search.mode})")
    slots = threading.Semaphore(max_concurrent or max(1, len(trials)))
    threads = []

    def body(trial):
        try:
            search.run_trial(trial)
        except CancelledError:
            trial.status = "not started"
        except Exception as e:  # noqa: BLE001 - the search goes on without it
            trial.status = f"failed ({e})"
            search.status.ended(trial)
        finally:
            slots.release()

    def signalled():
        if signals.received and search.interrupted is None:
            search.interrupt(signals.received[0])
        return search.interrupted is not None

    try:
        for trial in trials:
            while not slots.acquire(timeout=0.1):
                if signalled():
                    break
            if signalled():
                break
            t = threading.Thread(target=body, args=(trial,), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.1)
                # A second signal: the user will not wait any longer.
                if signalled() and len(signals.received) > 1:
                    return
    except BaseException:
        # Not a signal the search handles (e.g. KeyboardInterrupt outside
        # the main thread's handlers): no trial job outlives the search.
        search.interrupted = search.interrupted or signal.SIGINT
        search.kill_all()
        raise
    finally:
        if search.interrupted is not None:
            for t in trials:
                if t.status == "pending":
                    t.status = "not started"
                elif t.status in ("running", "stopping"):
                    # Only where the search stopped waiting for them.
                    t.status = "interrupted"


def _write_results(results, out_dir, out):
    """The table (trials that started), results.csv, best.json and the summary."""
    shown = [t for t in results.trials if t.status != "not started"]
    keys = list(dict.fromkeys(k for t in shown for k in t.config))
    metrics = list(dict.fromkeys(k for t in shown for k in t.last if k != "step"))
    header = ["trial", "status", "steps"] + keys + metrics
    rows = []
    for t in shown:
        cell = lambda v: f"{v:.6g}" if isinstance(v, float) else str(v)  # noqa: E731
        rows.append([str(t.id), t.status, str(t.last.get("step", ""))]
                    + [cell(t.config.get(k, "")) for k in keys]
                    + [cell(t.last[m]) if m in t.last else "" for m in metrics])
    with open(results.csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    print("", file=out)
    for r in [header] + rows:
        print("  ".join(c.ljust(n) for c, n in zip(r, widths)).rstrip(), file=out)
    best = results.best
    if best is None:
        print(f"\nno finished trial reported {results.metric}", file=out)
    else:
        with open(os.path.join(out_dir, "best.json"), "w") as f:
            json.dump({"trial": best.id, "config": best.config, "result": best.last}, f,
                      indent=1)
        shown_config = " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in best.config.items())
        print(f"\nbest: trial {best.id} {results.metric}={best.last[results.metric]:.4f} "
              f"config: {shown_config}", file=out)
    if results.interrupted:
        finished = sum(1 for t in results.trials if t.finished)
        print(f"tune: interrupted by {results.interrupted}: {finished} of "
              f"{len(results.trials)} trials finished", file=out)
    print(f"results: {results.csv_path}", file=out, flush=True)
