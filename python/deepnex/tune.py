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
(a <= n < b), ``choice([...])`` are sampled; ``grid([...])`` dimensions are
expanded into every combination; plain values are passed as they are.
``num_samples`` configurations are drawn for each grid point, by the search
method (``search=``): "tpe" or "cmaes", Optuna's samplers (ask and tell:
each new trial's configuration is proposed from the trials that ended
before; deepnex still runs the trials and decides on stopping them),
"random", or "grid" (choice() dimensions gridded too). The default is tpe
where Optuna is importable, random otherwise. ``seed`` reproduces a random
or grid search, and a tpe or cmaes one whose trials run one at a time.

A search is journalled in <out_dir>/journal.jsonl (trials, their starts,
reports and decisions, their ends; fsync'd per record): ``run(...,
resume=True)`` or ``deepnex tune --resume OUT`` continues it after a crash
or a kill, and ``load(out_dir)``, ``show`` and ``plot`` read it. The
sampler's history is the trials' configurations and results, told to it
again on a resume. Trials whose command is ``python SCRIPT.py`` start warm
(``warm=``): forked from a worker that imported what the script imports.

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

``subprocess_runner`` runs each trial as one plain child process (as many
at once as there are cores, unless max_concurrent says otherwise).
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

from . import _tune_journal
from .errors import (AlreadyExistsError, CancelledError, DeadlineExceededError,
                     FailedPreconditionError, InvalidArgumentError, NotFoundError,
                     ResourceExhaustedError, UnavailableError)

__all__ = ["uniform", "loguniform", "randint", "choice", "grid", "ASHA", "run",
           "report", "get_config", "checkpoint_dir", "generate_configs", "parse_space",
           "Trial", "Results", "Interrupted", "job_runner", "subprocess_runner", "load",
           "show", "plot", "default_search", "SEARCHES"]

ENV_STORE = "DEEPNEX_TUNE_STORE"
ENV_TRIAL = "DEEPNEX_TUNE_TRIAL"
ENV_CONFIG = "DEEPNEX_TUNE_CONFIG"
ENV_CHECKPOINT = "DEEPNEX_TUNE_CHECKPOINT_DIR"
ENV_ATTEMPT = "DEEPNEX_TUNE_ATTEMPT"


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


# ---- search methods: which configuration a new trial gets

SEARCHES = ("random", "grid", "tpe", "cmaes")


def default_search():
    """"tpe" where Optuna is importable, "random" otherwise."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        return "random"
    return "tpe"


def _space_json(space):
    """The space as the journal records it (a resume must get the same)."""
    out = {}
    for k, v in space.items():
        if isinstance(v, (_Domain, _Grid)):
            out[k] = [type(v).__name__.lstrip("_").lower(), list(getattr(v, "values", ()))
                      or [v.low, v.high]]
        else:
            out[k] = ["value", v]
    return json.loads(json.dumps(out))


class _Sampler:
    """Picks the configurations of a search: num_samples for each point of
    the grid() dimensions. random: generate_configs (the i-th trial gets the
    i-th configuration of the seed, however trials interleave). grid: every
    choice() dimension is a grid dimension too. tpe, cmaes: Optuna's sampler
    proposes the sampled dimensions from the trials that ended so far (ask
    and tell); deepnex runs the trials and decides on stopping them."""

    def __init__(self, space, num_samples, seed, search):
        if search not in SEARCHES:
            raise InvalidArgumentError(f'search: "{search}" is not one of '
                                       f'{", ".join(SEARCHES)}')
        if num_samples < 1:
            raise InvalidArgumentError(f"num_samples: {num_samples} must be at least 1")
        self.search, self.label = search, f"search {search}"
        if search == "grid":
            space = dict(space)
            for k, v in space.items():
                if isinstance(v, _Choice):
                    space[k] = _Grid(v.values)
                elif isinstance(v, _Domain):
                    raise InvalidArgumentError(
                        f"space: {k} is {_describe(v)}, which search grid cannot enumerate "
                        f"(use grid([...]) or choice([...]), or search random or tpe)")
        self.space, self.num_samples = space, num_samples
        grid_keys = [k for k, v in space.items() if isinstance(v, _Grid)]
        self._points = [dict(zip(grid_keys, p))
                        for p in itertools.product(*(space[k].values for k in grid_keys))]
        self.total = len(self._points) * num_samples
        self._study = None
        if search in ("random", "grid"):
            self._configs = generate_configs(space, num_samples, seed)
            return
        try:
            import optuna
        except ImportError:
            raise InvalidArgumentError(
                f"search: {search} needs Optuna (Debian: python3-optuna); use search "
                "random") from None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        self._dists = {k: _distribution(optuna, v) for k, v in space.items()
                       if isinstance(v, _Domain)}
        if search == "tpe":
            sampler = optuna.samplers.TPESampler(seed=seed)
        else:
            try:
                import cmaes  # noqa: F401
            except ImportError:
                raise InvalidArgumentError("search: cmaes needs the cmaes package "
                                           "(Debian: python3-cmaes)") from None
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # CmaEsSampler's "experimental" notes
                sampler = optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
        self._study = optuna.create_study(direction="maximize", sampler=sampler)
        self._asked = {}   # trial id -> Optuna's trial, until told

    def config(self, trial_id):
        """The configuration of the trial_id-th trial (ids from 0, in order)."""
        if self._study is None:
            return self._configs[trial_id]
        config = {}
        asked = self._study.ask(self._dists) if self._dists else None
        if asked is not None:
            self._asked[trial_id] = asked
        point = self._points[trial_id // self.num_samples]
        for k, v in self.space.items():
            if isinstance(v, _Grid):
                config[k] = point[k]
            elif isinstance(v, _Domain):
                config[k] = asked.params[k]
            else:
                config[k] = v
        return config

    def tell(self, trial, metric, sign):
        """What `trial` came to (it ended for good), for the model: a
        completed trial's value, a stopped one's as pruned with its
        intermediate values, a failed one as failed. `sign`: 1 when the
        metric is maximized, -1 when minimized (the study maximizes)."""
        if self._study is None or not self._dists:
            return
        optuna = self._optuna
        State = optuna.trial.TrialState
        steps = {}
        for r in trial.results:
            v = r.get(metric)
            if isinstance(v, float) and math.isfinite(v) and isinstance(r.get("step"), int):
                steps[r["step"]] = sign * v
        value = steps[max(steps)] if steps else None
        if trial.status == "completed" and value is not None and not trial.nonfinite:
            state = State.COMPLETE
        elif trial.status == "stopped" and value is not None:
            state, value = State.PRUNED, None
        else:
            state, value, steps = State.FAIL, None, {}
        asked = self._asked.pop(trial.id, None)
        if asked is not None:
            for step, v in sorted(steps.items()):
                asked.report(v, step)
            self._study.tell(asked, value, state=state)
            return
        # A trial from before a resume: its history, as Optuna records it.
        params = {k: trial.config[k] for k in self._dists}
        self._study.add_trial(optuna.trial.create_trial(
            params=params, distributions=self._dists, value=value, state=state,
            intermediate_values=steps))


def _distribution(optuna, domain):
    d = optuna.distributions
    if isinstance(domain, _Uniform):
        return d.FloatDistribution(domain.low, domain.high)
    if isinstance(domain, _LogUniform):
        return d.FloatDistribution(domain.low, domain.high, log=True)
    if isinstance(domain, _RandInt):
        return d.IntDistribution(domain.low, domain.high - 1)
    return d.CategoricalDistribution(domain.values)


def _describe(domain):
    if isinstance(domain, _Choice):
        return f"choice({list(domain.values)})"
    return f"{type(domain).__name__.lstrip('_').lower()}({domain.low}, {domain.high})"


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


def checkpoint_dir():
    """This trial's own directory for checkpoints (None outside a search):
    <out>/checkpoints/trial_N, kept when the trial is restarted (a retry, a
    resumed search), so that a script that saves its state there and loads
    it at the start goes on where the last attempt was."""
    path = os.environ.get(ENV_CHECKPOINT)
    if path:
        os.makedirs(path, exist_ok=True)
    return path or None


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
            attempt = os.environ.get(ENV_ATTEMPT, "0")
            _report_state["client"] = StoreClient(address, prefix=f"tune/{trial}/{attempt}",
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
    attempts: int = 0
    # A report whose metric was NaN or infinite: the trial failed.
    nonfinite: bool = False

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
    note: dict = field(default_factory=dict)   # run()'s note

    @property
    def best(self):
        """The completed or stopped trial whose last reported metric is
        best (None if none reported): never a failed one."""
        scored = [t for t in self.trials if t.status in ("completed", "stopped")
                  and _finite(t.last.get(self.metric))]
        if not scored:
            return None
        sign = 1 if self.mode == "max" else -1
        return max(scored, key=lambda t: sign * t.last[self.metric])


def _finite(value):
    return isinstance(value, (int, float)) and math.isfinite(value)


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
        # repr: the shortest string that reads back as the same float.
        args += [f"--{k.replace('_', '-')}", repr(v) if isinstance(v, float) else str(v)]
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
                 status, sampler, journal, retries, warm):
        from .collective import Store
        self.command, self.metric, self.mode = list(command), metric, mode
        self.scheduler, self.runner = scheduler, runner or job_runner()
        self.env, self.out_dir, self.stop_grace = env, out_dir, stop_grace
        self.status, self.sampler, self.journal = status, sampler, journal
        self.retries = retries
        self.store = Store("127.0.0.1:0")
        self.lock = threading.Lock()
        self.running = {}      # trial id -> handle
        self.interrupted = None   # the signal that ended the search early
        self.aborted = None       # why a check ended the search early
        self.reported = False     # whether any trial has reported yet
        self.early_failures = {}  # trial id (< _EARLY) -> exit code, for start-up failures
        self.warm = _Warm(self.command, env, out_dir) if warm else None

    def close(self):
        self.store.stop()
        if self.warm is not None:
            self.warm.close()

    @property
    def stopping(self):
        return self.interrupted is not None or self.aborted is not None

    def interrupt(self, signum=None, message=None):
        """Ends the search early, for a signal or (message) a check that
        failed: no trial starts any more, and each running trial's thread
        stops it (kill(): SIGTERM, SIGKILL after a grace period)."""
        with self.lock:
            if self.stopping:
                return
            self.interrupted, self.aborted = signum, message
            running = len(self.running)
        started = sum(1 for t in self.status.trials if t.status != "pending")
        why = signal.Signals(signum).name if signum is not None else "check failed"
        self.status.say(f"tune: {why}: stopping {running} running "
                        f"trial{'' if running == 1 else 's'}; {self.sampler.total - started} "
                        "not started")
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
        """Runs `trial`, again after a failure while it has retries left;
        tells the sampler what it came to."""
        while True:
            self._run_attempt(trial)
            if not (trial.status.startswith("failed (exit") and not self.stopping
                    and trial.attempts <= self.retries):
                break
            self.status.say(f"tune: trial {trial.id} {trial.status}: retry "
                            f"{trial.attempts} of {self.retries}")
        if trial.finished:
            with self.lock:
                self.sampler.tell(trial, self.metric, 1 if self.mode == "max" else -1)
            self._check_start_up(trial)

    def _check_start_up(self, trial):
        """The same start-up failure (an exit before any report) in the
        first _EARLY trials is the script's, not a configuration's: the
        search ends rather than spend its budget on it."""
        if trial.id >= _EARLY:
            return
        with self.lock:
            failed = trial.status.startswith("failed (exit") and not trial.results
            self.early_failures[trial.id] = trial.exit_code if failed else None
            codes = set(self.early_failures.values())
            if (len(self.early_failures) < _EARLY or codes != {trial.exit_code}
                    or trial.exit_code is None):
                return
        self.interrupt(message=(
            f"the first {len(self.early_failures)} trials all failed with exit code "
            f"{trial.exit_code} before reporting; the last lines of {trial.log_path}:\n"
            + "\n".join("  " + line for line in _tail(trial.log_path, 5))))

    def _run_attempt(self, trial):
        from .collective import StoreClient
        attempt = trial.attempts
        env = dict(os.environ)
        env.update(self.env or {})
        env.update({ENV_STORE: self.store.address, ENV_TRIAL: str(trial.id),
                    ENV_ATTEMPT: str(attempt), ENV_CONFIG: json.dumps(trial.config),
                    ENV_CHECKPOINT: os.path.join(self.out_dir, "checkpoints",
                                                 f"trial_{trial.id}")})
        trial.log_path = os.path.join(self.out_dir, f"trial_{trial.id}.log")
        if self.stopping:
            trial.status = "not started"
            return
        argv = self.command + _config_args(trial.config)
        if self.warm is not None:
            argv = self.warm.wrap(argv)
        handle = self.runner(trial.id, argv, env, trial.log_path)
        with self.lock:
            self.running[trial.id] = handle
        trial.status, trial.results, trial.nonfinite = "running", [], False
        trial.attempts += 1
        self.journal.append({"event": "start", "trial": trial.id, "attempt": attempt})
        self.status.started(trial)
        client = StoreClient(self.store.address, prefix=f"tune/{trial.id}/{attempt}")
        stopped_at = None
        interrupted = killed = False
        while True:
            if self.stopping and not interrupted:
                # Stopping a job waits out its grace period: each trial's
                # thread stops its own, so they stop together.
                interrupted = True
                trial.status = "stopping"
                self.status.updated()
                handle.kill()
            try:
                record = json.loads(client.get(f"report/{len(trial.results)}",
                                              timeout=_POLL))
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
            decision = self._decide(trial, record)
            if decision == "stop" and stopped_at is None and not self.stopping:
                stopped_at = time.monotonic()
                trial.status = "stopping"
            self.journal.append({"event": "report", "trial": trial.id, "attempt": attempt,
                                 "record": record, "decision": decision})
            client.set(f"decision/{record['step']}", decision)
            self.status.updated()
        trial.exit_code = handle.wait()
        with self.lock:
            del self.running[trial.id]
        max_t = getattr(self.scheduler, "max_t", None)
        early = (stopped_at is not None
                 and not (max_t is not None and trial.last.get("step", 0) >= max_t))
        if trial.nonfinite:
            trial.status = f"failed ({self.metric}={trial.last.get(self.metric)})"
        elif early:
            trial.status = "stopped"
        elif interrupted:
            trial.status = "interrupted"
        elif trial.exit_code == 0:
            trial.status = "completed"
        else:
            trial.status = f"failed (exit {trial.exit_code})"
        self.journal.append({"event": "end", "trial": trial.id, "attempt": attempt,
                             "status": trial.status, "exit_code": trial.exit_code,
                             "nonfinite": trial.nonfinite})
        self.status.ended(trial)

    def _decide(self, trial, record):
        """continue or stop, for `trial` reporting `record`."""
        if self.stopping:
            # The loop's top stops the trial; it ends "interrupted", never
            # "stopped" early by the scheduler, even when the signal came
            # after that check.
            return "stop"
        with self.lock:
            first, self.reported = not self.reported, True
        if first and self.metric not in record:
            # A misspelt --metric would turn ASHA off and rank nothing:
            # better to learn it from the first report than after the budget.
            reported = ", ".join(k for k in record if k != "step") or "no metric"
            self.interrupt(message=(
                f'metric: trial {trial.id} reported {reported} at step {record.get("step")}, '
                f'not "{self.metric}"; the search stopped (pass --metric one of them)'))
            return "stop"
        value = record.get(self.metric)
        if value is None:
            return "continue"
        if not _finite(value):
            trial.nonfinite = True
            return "stop"
        if self.scheduler is None:
            return "continue"
        with self.lock:
            return self.scheduler.on_result(trial.id, record["step"], value)


# Seconds a trial's thread waits for a report before it checks whether the
# trial ended: how late the search may learn that a slot is free.
_POLL = 0.05

# Start-up failures in this many first trials end the search.
_EARLY = 3


def _tail(path, n):
    """The last n non-empty lines of the file at path."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
    except OSError:
        return []
    return lines[-n:]


def _warm_wanted(command, warm):
    """Whether trials start warm: a `python script.py` command, unless
    warm is False (InvalidArgumentError when True for another command)."""
    fits = (len(command) >= 2 and os.path.basename(command[0]).startswith("python")
            and command[1].endswith(".py") and os.path.isfile(command[1]))
    if warm and not fits:
        raise InvalidArgumentError(f"warm: the command {command[:2]} is not python SCRIPT.py, "
                                   "which warm trials need")
    return fits if warm is None else bool(warm)


class _Warm:
    """The search's warm worker (deepnex/_tune_warm.py serve), started at
    once so that it imports while the first trials start; trials that come
    before it is ready wait for it."""

    def __init__(self, command, env, out_dir):
        import tempfile
        from . import _tune_warm
        self._dir = tempfile.mkdtemp(prefix="deepnex-tune-")
        self.socket = os.path.join(self._dir, "warm.sock")
        self._script = _tune_warm.__file__
        self._python = command[0]
        with open(os.path.join(out_dir, "warm.log"), "w") as log:
            self._p = subprocess.Popen(
                [self._python, self._script, "serve", self.socket, command[1]],
                env={**os.environ, **(env or {})}, stdin=subprocess.PIPE, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    def wrap(self, argv):
        """The command that runs argv through the warm worker."""
        # -S: the stand-in needs only the standard library; it starts faster
        # without site's imports (the trial, forked, has the worker's).
        return [self._python, "-S", self._script, "run", self.socket] + argv

    def close(self):
        """Ends the warm worker (closing its stdin: it kills what it still runs)."""
        self._p.stdin.close()
        try:
            self._p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._p.kill()
            self._p.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


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
        stop_grace=30.0, out=None, search=None, retries=0, resume=False, note=None,
        warm=None):
    """Runs the search and returns its Results; shows the trials' status
    while they run (see the module's doc), then prints a summary (at most
    20 lines) and the best configuration, and writes <out_dir>/results.csv,
    <out_dir>/best.json, each trial's log and the journal.

    search: random, grid, tpe or cmaes (None: default_search(), said in
    one line). seed: random and grid draw the same configurations for the
    same seed whatever the timing; tpe and cmaes only when trials run one
    at a time (max_concurrent=1): with several at once, which results the
    model has seen when it proposes depends on which trials ended first.
    scheduler: ASHA(...) or None (every trial runs to its end). A trial that
    goes on running stop_grace seconds after being told to stop is killed.
    runner: how a trial starts (default job_runner(): a 1-worker allreduce
    job). max_concurrent: a limit of the search's own; None: as many trials
    at once as the runner admits (job_runner: what fits on the machine;
    subprocess_runner: the local cores). retries: a failed trial is run
    again up to this many times.

    resume: continue the search journalled in out_dir (run() with the same
    command, space, metric, mode, num_samples, seed and search): finished
    trials are kept, the ones that were running or interrupted start again
    (from their checkpoint_dir() where the script keeps one), failed ones
    are retried while retries allow; no trial runs twice to its end.
    note: JSON data kept in the journal with the search (load(...).note);
    deepnex tune keeps its flags there for --resume.

    warm: start trials warm (see _tune_warm): a warm worker imports what the
    script imports once, and each trial's process is forked from it rather
    than a fresh interpreter's (its environment, working directory, exit
    code and log as a cold trial's). None: warm when the command is
    ``python SCRIPT.py ...``; False: every trial a fresh interpreter.

    Checks: the search stops (FailedPreconditionError) when the first
    report lacks `metric`, or when the first 3 trials fail the same way
    before reporting. A NaN or infinite metric fails its trial.

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
    if retries < 0:
        raise InvalidArgumentError(f"retries: {retries} must be at least 0")
    warm = _warm_wanted(command, warm)
    if max_concurrent is None and runner is subprocess_runner:
        max_concurrent = os.cpu_count() or 1
    out = out or sys.stdout
    said = search is None
    search = search or default_search()
    sampler = _Sampler(space, num_samples, seed, search)
    head = {"event": "search", "command": list(command), "space": _space_json(space),
            "metric": metric, "mode": mode, "num_samples": num_samples, "seed": seed,
            "search": search}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, _tune_journal.JOURNAL)
    trials = []
    if resume:
        records, keep = _tune_journal.read(path) if os.path.exists(path) else ([], 0)
        if not records:
            raise NotFoundError(f"out_dir: {out_dir} has no search to resume ({path})")
        _check_resume(path, records[0], head)
        journal = _tune_journal.Journal(path, keep=keep)
        trials = _replay(records, sampler, scheduler, metric, mode, retries)
    else:
        if os.path.exists(path):
            raise AlreadyExistsError(
                f"out_dir: {out_dir} holds a search already ({path}): resume it "
                f"(deepnex tune --resume {out_dir}) or choose another out_dir")
        journal = _tune_journal.Journal(path)
        journal.append({**head, "note": note or {}})
    if said:
        sampler.label += (" (the default)" if search == "tpe"
                          else " (the default: Optuna is not importable)")
    status = _Status(trials, metric, out)
    signals = _Signals()
    state = None
    try:
        try:
            state = _Search(command, metric, mode, scheduler, runner, env, out_dir,
                            stop_grace, status, sampler, journal, retries, warm)
            _run_trials(state, trials, max_concurrent, signals)
        finally:
            journal.close()
            if state is not None:
                state.close()
            status.close()
        trials.sort(key=lambda t: t.id)
        trials += [Trial(i, {}, "not started") for i in range(len(trials), sampler.total)]
        results = Results(trials, metric, mode, os.path.join(out_dir, "results.csv"))
        if state.interrupted is not None:
            results.interrupted = signal.Signals(state.interrupted).name
        _write_results(results, out_dir, out)
    finally:
        signals.restore()
    if state.interrupted is not None:
        raise Interrupted(state.interrupted, results)
    if state.aborted is not None:
        raise FailedPreconditionError(state.aborted)
    return results


def _check_resume(path, recorded, head):
    for key, value in head.items():
        if recorded.get(key) != value:
            raise InvalidArgumentError(
                f"resume: {key} is {value!r}; the search in {path} has "
                f"{recorded.get(key)!r}")


def _trials_of(records):
    """The trials a journal records, as they stood at its last record, and
    the (trial, attempt, report) records in their order."""
    trials, reports = {}, []
    for r in records:
        event = r["event"]
        if event == "trial":
            trials[r["trial"]] = Trial(r["trial"], r["config"])
            continue
        t = trials.get(r.get("trial"))
        if t is None:
            continue
        if event == "start":
            t.attempts, t.status, t.results, t.nonfinite = r["attempt"] + 1, "running", [], False
        elif event == "report":
            t.results.append(r["record"])
            reports.append((t, r["attempt"], r["record"]))
        elif event == "end":
            t.status, t.exit_code = r["status"], r["exit_code"]
            t.nonfinite = r.get("nonfinite", False)
    return [trials[i] for i in sorted(trials)], reports


def _replay(records, sampler, scheduler, metric, mode, retries):
    """The trials of a resumed search: the finished ones as they ended
    (told to the sampler and the scheduler again), the others pending."""
    trials, reports = _trials_of(records)
    ended = [r["trial"] for r in records if r["event"] == "end"]
    by_id = {t.id: t for t in trials}
    for t in trials:
        failed = t.status.startswith("failed (exit")
        if not t.finished or (failed and t.attempts <= retries):
            t.status, t.results, t.nonfinite = "pending", [], False
    # Each trial's last end, in their order: the order the sampler learnt them.
    for i in list(dict.fromkeys(reversed(ended)))[::-1]:
        t = by_id[i]
        if t.finished:
            sampler.tell(t, metric, 1 if mode == "max" else -1)
    if scheduler is not None:
        for t, attempt, record in reports:
            value = record.get(metric)
            if t.finished and attempt == t.attempts - 1 and _finite(value):
                scheduler.on_result(t.id, record["step"], value)
    return trials


def load(out_dir):
    """The Results of the search journalled in out_dir, finished or still
    running (its trials as they stand)."""
    path = os.path.join(out_dir, _tune_journal.JOURNAL)
    if not os.path.exists(path):
        raise NotFoundError(f"out_dir: {out_dir} has no search ({path})")
    records, _ = _tune_journal.read(path)
    head = records[0] if records else {}
    trials, _ = _trials_of(records)
    return Results(trials, head.get("metric", "accuracy"), head.get("mode", "max"),
                   os.path.join(out_dir, "results.csv"), note=head.get("note", {}))


def show(out_dir, out=None):
    """Prints the search in out_dir: its trials, the best one and each
    trial's reports (also while the search runs)."""
    out = out or sys.stdout
    results = load(out_dir)
    _print_table(results, out, limit=None)
    print("", file=out)
    for t in results.trials:
        history = " ".join(f"{_shown(r.get('step'))}:{_shown(r.get(results.metric, ''))}"
                           for r in t.results)
        print(f"trial {t.id} {t.status}: {history or '(no reports)'}", file=out)
    _print_best(results, out)


def plot(out_dir, path=None):
    """Draws the search in out_dir into a PNG (default <out_dir>/tune.png):
    the optimisation history, each trial's intermediate values and the
    parameters' parallel coordinates. Returns the PNG's path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = load(out_dir)
    path = path or os.path.join(out_dir, "tune.png")
    metric, sign = results.metric, 1 if results.mode == "max" else -1
    fig, (history, curves, coords) = plt.subplots(1, 3, figsize=(16, 4.5))
    scored = [t for t in results.trials if t.finished and _finite(t.last.get(metric))]
    best, xs, ys = None, [], []
    for t in scored:
        v = t.last[metric]
        best = v if best is None or sign * v > sign * best else best
        xs.append(t.id)
        ys.append(best)
    history.scatter([t.id for t in scored], [t.last[metric] for t in scored], s=12)
    history.step(xs, ys, where="post", color="tab:red", label="best so far")
    history.set(title="optimisation history", xlabel="trial", ylabel=metric)
    history.legend()
    for t in results.trials:
        points = [(r["step"], r[metric]) for r in t.results if _finite(r.get(metric))]
        if points:
            curves.plot(*zip(*points), marker=".", linewidth=0.8)
    curves.set(title="intermediate values", xlabel="step", ylabel=metric)
    keys = [k for k in dict.fromkeys(k for t in scored for k in t.config)
            if all(isinstance(t.config.get(k), (int, float)) for t in scored)]
    if scored and keys:
        cols = []
        for k in keys:
            vals = [float(t.config[k]) for t in scored]
            lo, hi = min(vals), max(vals)
            cols.append([(v - lo) / (hi - lo) if hi > lo else 0.5 for v in vals])
        values = [t.last[metric] for t in scored]
        lo, hi = min(values), max(values)
        cmap = plt.get_cmap("viridis")
        for i in range(len(scored)):
            shade = (values[i] - lo) / (hi - lo) if hi > lo else 1.0
            coords.plot(range(len(keys)), [c[i] for c in cols], color=cmap(shade), alpha=0.7)
        coords.set_xticks(range(len(keys)), keys)
    coords.set(title=f"parallel coordinates (colour: {metric})", ylabel="scaled value")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _run_trials(search, trials, max_concurrent, signals):
    """Starts a thread per trial as slots free up (the trials to run again
    first, then new ones, each configured by the sampler when its slot
    frees, so that it learns from every trial that ended before) and waits
    for them, acting on the signals received meanwhile."""
    at_once = "up to capacity" if max_concurrent is None else f"{max_concurrent} at a time"
    again = [t for t in trials if t.status == "pending"]
    done = len(trials) - len(again)
    resumed = f" ({done} finished before, {len(again)} to run again)" if trials else ""
    search.status.say(f"tune: {search.sampler.total} trials{resumed}, {at_once}, metric "
                      f"{search.metric} ({search.mode}), {search.sampler.label}")
    slots = threading.Semaphore(max_concurrent or max(1, search.sampler.total))
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
        return search.stopping

    def next_trial():
        if again:
            return again.pop(0)
        i = len(trials)
        if i >= search.sampler.total:
            return None
        with search.lock:
            trial = Trial(i, search.sampler.config(i))
        search.journal.append({"event": "trial", "trial": i, "config": trial.config})
        trials.append(trial)
        return trial

    try:
        while True:
            while not slots.acquire(timeout=0.1):
                if signalled():
                    break
            if signalled():
                break
            trial = next_trial()
            if trial is None:
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
        if search.stopping:
            for t in trials:
                if t.status == "pending":
                    t.status = "not started"
                elif t.status in ("running", "stopping"):
                    # Only where the search stopped waiting for them.
                    t.status = "interrupted"


# The summary shows this many trials at most (the best ones); results.csv
# has them all.
_SUMMARY_ROWS = 10


def _cell(v):
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _print_table(results, out, limit):
    """The trials that started (the `limit` best when there are more)."""
    shown = [t for t in results.trials if t.status != "not started"]
    rows, header = _rows(shown)
    more = 0
    if limit is not None and len(rows) > limit:
        sign = 1 if results.mode == "max" else -1
        ranked = sorted(shown, key=lambda t: (not (t.finished and _finite(
            t.last.get(results.metric))), -sign * t.last.get(results.metric, 0)
            if _finite(t.last.get(results.metric)) else 0, t.id))
        keep = {t.id for t in ranked[:limit]}
        more = len(rows) - limit
        rows = [r for t, r in zip(shown, rows) if t.id in keep]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    print("", file=out)
    for r in [header] + rows:
        print("  ".join(c.ljust(n) for c, n in zip(r, widths)).rstrip(), file=out)
    if more:
        counts = {}
        for t in shown:
            state = t.status.split(" ")[0]
            counts[state] = counts.get(state, 0) + 1
        print(f"... and {more} more ({', '.join(f'{n} {s}' for s, n in counts.items())} in "
              f"all; every trial in {results.csv_path})", file=out)


def _rows(shown):
    keys = list(dict.fromkeys(k for t in shown for k in t.config))
    metrics = list(dict.fromkeys(k for t in shown for k in t.last if k != "step"))
    header = ["trial", "status", "steps"] + keys + metrics
    rows = [[str(t.id), t.status, str(t.last.get("step", ""))]
            + [_cell(t.config.get(k, "")) for k in keys]
            + [_cell(t.last[m]) if m in t.last else "" for m in metrics] for t in shown]
    return rows, header


def _print_best(results, out):
    best = results.best
    if best is None:
        print(f"\nno finished trial reported {results.metric}", file=out)
        return
    shown_config = " ".join(f"{k}={_cell(v)}" for k, v in best.config.items())
    print(f"\nbest: trial {best.id} {results.metric}={best.last[results.metric]:.4f} "
          f"config: {shown_config}", file=out)


def _write_results(results, out_dir, out):
    """results.csv, best.json and the summary (at most 20 lines)."""
    rows, header = _rows([t for t in results.trials if t.status != "not started"])
    with open(results.csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    _print_table(results, out, _SUMMARY_ROWS)
    best = results.best
    if best is not None:
        with open(os.path.join(out_dir, "best.json"), "w") as f:
            json.dump({"trial": best.id, "config": best.config, "result": best.last}, f,
                      indent=1)
    _print_best(results, out)
    if results.interrupted:
        finished = sum(1 for t in results.trials if t.finished)
        print(f"tune: interrupted by {results.interrupted}: {finished} of "
              f"{len(results.trials)} trials finished", file=out)
    print(f"results: {results.csv_path}", file=out, flush=True)
