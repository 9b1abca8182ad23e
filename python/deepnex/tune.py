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

Trials are started by a runner, ``runner(trial_id, argv, env, log_path)`` ->
an object with poll(), wait() and kill(). The default, ``job_runner()``,
runs each trial as a deepnex job (deepnex.job.Job: allocated cores and GPUs,
its workers started with the job environment, parameter servers in the PS
modes) and starts a trial only when its workers fit on the machine beside the
running trials', so trials run in parallel up to the machine's capacity::

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
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from .errors import DeadlineExceededError, InvalidArgumentError, ResourceExhaustedError

__all__ = ["uniform", "loguniform", "randint", "choice", "grid", "ASHA", "run",
           "report", "get_config", "generate_configs", "parse_space", "Trial", "Results",
           "job_runner", "subprocess_runner"]

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


def get_config():
    """This trial's configuration ({} outside a search)."""
    return json.loads(os.environ.get(ENV_CONFIG, "{}"))


def report(step, timeout=600.0, **metrics):
    """Reports `metrics` at `step` to the search running this trial; returns
    True when the trial should stop. Outside a search: False. Workers without
    metrics (ranks other than 0) wait for the answer to rank 0's report of
    the same step."""
    address, trial = os.environ.get(ENV_STORE), os.environ.get(ENV_TRIAL)
    if not address or not trial:
        return False
    from .collective import StoreClient
    if _report_state["client"] is None:
        _report_state["client"] = StoreClient(address, prefix=f"tune/{trial}",
                                              timeout=timeout)
    client = _report_state["client"]
    if metrics:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        client.set(f"report/{_report_state['count']}", json.dumps(record))
        _report_state["count"] += 1
    return client.get(f"decision/{step}") == b"stop"


# ---- running a search

@dataclass
class Trial:
    id: int
    config: dict
    status: str = "pending"      # running, completed, stopped, failed (exit N)
    results: list = field(default_factory=list)
    log_path: str = ""
    exit_code: int = None

    @property
    def last(self):
        return self.results[-1] if self.results else {}


@dataclass
class Results:
    trials: list
    metric: str
    mode: str
    csv_path: str

    @property
    def best(self):
        """The trial whose last reported metric is best (None if none reported)."""
        scored = [t for t in self.trials if self.metric in t.last]
        if not scored:
            return None
        sign = 1 if self.mode == "max" else -1
        return max(scored, key=lambda t: sign * t.last[self.metric])


def subprocess_runner(trial_id, argv, env, log_path):
    """The default runner: the trial as a child process, output to log_path."""
    with open(log_path, "w") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


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

    def acquire(self, need):
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
                    self.cond.wait()
            finally:
                self.queue.remove(ticket)
                self.cond.notify_all()
            self.used = [u + n for u, n in zip(self.used, need)]

    def release(self, need):
        with self.cond:
            self.used = [u - n for u, n in zip(self.used, need)]
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
        self._job.stop()

    def _end(self, result):
        # A job that was stopped exits 0 (nothing failed); a trial whose
        # workers were killed reads as a killed process does: -signal.
        signals = [w.signal for w in result.workers if w.reason == "signaled"]
        self._code = result.exit_code or (-signals[0] if signals else 0)
        self._job.stop()
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


def job_runner(workers=1, mode="allreduce", ps=None, cpus=1, gpus_per_worker=0,
               gpu_mode="exclusive", retry_interval=1.0, **job_options):
    """A runner that runs each trial as a deepnex job: ``workers`` workers
    in ``mode`` (sync, ssp:S, async with parameter servers; allreduce
    without), each with ``cpus`` cores and ``gpus_per_worker`` GPUs; other
    options go to deepnex.job.Job (backend, memory, central, restart, ...).
    A trial's configuration values for optimizer, lr and momentum also go to
    its parameter servers, which apply the updates in the PS modes.

    With the local allocator a trial starts once its workers' cores and GPUs
    fit beside the running trials' (trials wait, in order); a trial that
    could never fit on this machine fails. With ``central`` deepnex-central
    queues the trial's gang. A start refused for lack of resources
    (ResourceExhausted) is retried every ``retry_interval`` seconds."""
    from . import job as job_module
    capacity = None
    need = (workers * max(1, math.ceil(cpus)), workers * gpus_per_worker)
    lock = threading.Lock()

    def runner(trial_id, argv, env, log_path):
        nonlocal capacity
        config = json.loads(env.get(ENV_CONFIG, "{}"))
        options = dict(job_options)
        options.update({k: config[k] for k in _SERVER_OPTIONS if k in config})
        # The job's processes inherit this process's environment; the
        # trial's own variables come on top.
        extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
        if not options.get("central"):
            with lock:
                if capacity is None:
                    capacity = _Capacity(gpu_mode)
            capacity.acquire(need)
        released = []

        def release():
            if capacity is not None and not released:
                released.append(True)
                capacity.release(need)

        log = _Log(log_path)
        try:
            while True:
                job = job_module.Job(argv, workers=workers, mode=mode, ps=ps, cpus=cpus,
                                     gpus_per_worker=gpus_per_worker, gpu_mode=gpu_mode,
                                     env=extra, name=f"trial-{trial_id}-{secrets.token_hex(3)}",
                                     output=log.write, **options)
                try:
                    job.start()
                    break
                except ResourceExhaustedError:
                    time.sleep(retry_interval)
        except BaseException:
            log.close()
            release()
            raise

        def on_end():
            log.close()
            release()
        return _JobTrial(job, on_end)

    return runner


def _config_args(config):
    args = []
    for k, v in config.items():
        args += [f"--{k.replace('_', '-')}", f"{v:.6g}" if isinstance(v, float) else str(v)]
    return args


class _Search:
    def __init__(self, command, metric, mode, scheduler, runner, env, out_dir, stop_grace,
                 out):
        from .collective import Store
        self.command, self.metric, self.mode = list(command), metric, mode
        self.scheduler, self.runner = scheduler, runner or job_runner()
        self.env, self.out_dir, self.stop_grace, self.out = env, out_dir, stop_grace, out
        self.store = Store("127.0.0.1:0")
        self.lock = threading.Lock()
        self.running = {}      # trial id -> handle
        self.stopping = False

    def kill_all(self):
        """Ends every running trial (on Ctrl-C: no trial job outlives the search)."""
        with self.lock:
            self.stopping = True
            handles = list(self.running.values())
        for h in handles:
            h.kill()

    def say(self, line):
        with self.lock:
            print(line, file=self.out, flush=True)

    def run_trial(self, trial):
        from .collective import StoreClient
        env = dict(os.environ)
        env.update(self.env or {})
        env.update({ENV_STORE: self.store.address, ENV_TRIAL: str(trial.id),
                    ENV_CONFIG: json.dumps(trial.config)})
        trial.log_path = os.path.join(self.out_dir, f"trial_{trial.id}.log")
        handle = self.runner(trial.id, self.command + _config_args(trial.config), env,
                             trial.log_path)
        with self.lock:
            self.running[trial.id] = handle
            stopping = self.stopping
        if stopping:
            handle.kill()
        trial.status = "running"
        client = StoreClient(self.store.address, prefix=f"tune/{trial.id}")
        stopped_at = None
        while True:
            try:
                record = json.loads(client.get(f"report/{len(trial.results)}", timeout=0.2))
            except DeadlineExceededError:
                if handle.poll() is not None:
                    # A report may have landed after the last wait.
                    if client.check([f"report/{len(trial.results)}"])[0]:
                        continue
                    break
                if stopped_at is not None and time.monotonic() - stopped_at > self.stop_grace:
                    handle.kill()
                continue
            trial.results.append(record)
            decision = "continue"
            if self.scheduler is not None and self.metric in record:
                with self.lock:
                    decision = self.scheduler.on_result(trial.id, record["step"],
                                                        record[self.metric])
            client.set(f"decision/{record['step']}", decision)
            shown = " ".join(f"{k}={v:.4g}" for k, v in record.items() if k != "step")
            self.say(f"trial {trial.id} step {record['step']}: {shown}"
                     + ("  -> stop" if decision == "stop" else ""))
            if decision == "stop" and stopped_at is None:
                stopped_at = time.monotonic()
        trial.exit_code = handle.wait()
        with self.lock:
            del self.running[trial.id]
        max_t = getattr(self.scheduler, "max_t", None)
        early = (stopped_at is not None
                 and not (max_t is not None and trial.last.get("step", 0) >= max_t))
        if early:
            trial.status = "stopped"
        elif trial.exit_code == 0:
            trial.status = "completed"
        else:
            trial.status = f"failed (exit {trial.exit_code})"
        self.say(f"trial {trial.id} {trial.status}")


def run(command, space, metric="accuracy", mode="max", num_samples=1, scheduler=None,
        max_concurrent=None, seed=0, out_dir="tune-results", runner=None, env=None,
        stop_grace=30.0, out=None):
    """Runs the search and returns its Results; prints a line per report,
    then the table and the best configuration, and writes
    <out_dir>/results.csv, <out_dir>/best.json and each trial's log.

    scheduler: ASHA(...) or None (every trial runs to its end). A trial that
    goes on running stop_grace seconds after being told to stop is killed.
    runner: how a trial starts (default job_runner(): a 1-worker allreduce
    job). max_concurrent: a limit of the search's own; None: as many trials
    at once as the runner admits (job_runner: what fits on the machine;
    subprocess_runner: every trial).
    """
    if mode not in ("max", "min"):
        raise InvalidArgumentError(f'mode: "{mode}" is not max or min')
    if max_concurrent is not None and max_concurrent < 1:
        raise InvalidArgumentError(f"max_concurrent: {max_concurrent} must be at least 1")
    out = out or sys.stdout
    os.makedirs(out_dir, exist_ok=True)
    trials = [Trial(i, c) for i, c in enumerate(generate_configs(space, num_samples, seed))]
    search = _Search(command, metric, mode, scheduler, runner, env, out_dir, stop_grace, out)
    search.say(f"tune: {len(trials)} trials, "
               f"{'up to capacity' if max_concurrent is None else f'{max_concurrent} at a time'}"
               f", metric {metric} ({mode})")
    slots = threading.Semaphore(max_concurrent or max(1, len(trials)))
    threads = []

    def body(trial):
        try:
            search.run_trial(trial)
        except Exception as e:  # noqa: BLE001 - the search goes on without it
            trial.status = f"failed ({e})"
            search.say(f"trial {trial.id} failed: {e}")
        finally:
            slots.release()

    try:
        for trial in trials:
            slots.acquire()
            t = threading.Thread(target=body, args=(trial,), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
    except BaseException:
        search.kill_all()
        raise
    finally:
        search.store.stop()
    results = Results(trials, metric, mode, os.path.join(out_dir, "results.csv"))
    _write_results(results, out_dir, out)
    return results


def _write_results(results, out_dir, out):
    keys = list(dict.fromkeys(k for t in results.trials for k in t.config))
    metrics = list(dict.fromkeys(k for t in results.trials for k in t.last if k != "step"))
    header = ["trial", "status", "steps"] + keys + metrics
    rows = []
    for t in results.trials:
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
        print(f"\nno trial reported {results.metric}", file=out)
        return
    with open(os.path.join(out_dir, "best.json"), "w") as f:
        json.dump({"trial": best.id, "config": best.config, "result": best.last}, f, indent=1)
    shown = " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in best.config.items())
    print(f"\nbest: trial {best.id} {results.metric}={best.last[results.metric]:.4f} "
          f"config: {shown}", file=out)
    print(f"results: {results.csv_path}", file=out, flush=True)
