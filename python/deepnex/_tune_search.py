"""The search loop of deepnex.tune: run() starts the trials, collects their
reports, asks the scheduler about each, and resumes a journalled search."""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time

from . import _tune_files, _tune_journal
from ._tune_report import (ENV_ATTEMPT, ENV_CHECKPOINT, ENV_CONFIG, ENV_STORE, ENV_STORE_TOKEN,
                           ENV_TRIAL)
from ._tune_results import Interrupted, Results, Trial, _finite, _tail, _trials_of
from ._tune_runners import job_runner
from ._tune_sampler import _Sampler, default_search
from ._tune_schedulers import (ASHA, Hyperband, adopt, make_scheduler, scheduler_label,
                               scheduler_spec)
from ._tune_space import _space_json
from ._tune_status import _Output, _Status, _write_results
from .errors import (AlreadyExistsError, CancelledError, DeadlineExceededError,
                     FailedPreconditionError, InvalidArgumentError, NotFoundError)


def command_epochs(command):
    """The value of the training command's --epochs, if it has one."""
    for i, word in enumerate(command):
        value = (command[i + 1] if word == "--epochs" and i + 1 < len(command)
                 else word[len("--epochs="):] if word.startswith("--epochs=") else None)
        if value is not None and value.isdigit():
            return int(value)
    return None


def _config_args(config):
    args = []
    # The space's names map to distinct flags (_tune_space.check_names).
    for k, v in config.items():
        # repr: the shortest string that reads back as the same float.
        args += [f"--{k.replace('_', '-')}", repr(v) if isinstance(v, float) else str(v)]
    return args


class _Search:
    def __init__(self, command, metric, mode, scheduler, runner, env, out_dir, stop_grace,
                 status, sampler, journal, retries, warm):
        from .collective import Store
        self.command, self.metric, self.mode = list(command), metric, mode
        self.scheduler, self.runner = scheduler, runner
        self.env, self.out_dir, self.stop_grace = env, out_dir, stop_grace
        self.status, self.sampler, self.journal = status, sampler, journal
        self.retries = retries
        # Any local user can reach 127.0.0.1: the token (the trials get it
        # in their environment, ENV_STORE_TOKEN) keeps the others from
        # forging reports and decisions.
        self.store_token = secrets.token_urlsafe(32)
        self.store = Store("127.0.0.1:0", token=self.store_token)
        self.lock = threading.Lock()
        self.running = {}      # trial id -> handle
        self.interrupted = None   # the signal that ended the search early
        self.aborted = None       # why a check ended the search early
        self.reported = False     # whether any trial has reported yet
        self.early_failures = {}  # trial id (< _EARLY) -> exit code, for start-up failures
        self.warm = _Warm(self.command, env, out_dir) if warm else None

    def close(self):
        # The trial slots' processes end before the warm worker they use.
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
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

    def client(self, trial_id, attempt):
        """A client of the search's store, in the keys of a trial's attempt."""
        from .collective import StoreClient
        return StoreClient(self.store.address, prefix=f"tune/{trial_id}/{attempt}",
                           token=self.store_token)

    def _run_attempt(self, trial):
        attempt = trial.attempts
        env = dict(os.environ)
        env.update(self.env or {})
        env.update({ENV_STORE: self.store.address, ENV_STORE_TOKEN: self.store_token,
                    ENV_TRIAL: str(trial.id),
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
        try:
            handle = self.runner(trial.id, argv, env, trial.log_path)
        except CancelledError:
            raise   # the search stopped while the start waited: not started
        except Exception as e:  # noqa: BLE001 - the trial fails, the search goes on
            # Journalled as an attempt that failed, so that show, load and a
            # resume see what results.csv says (not a trial still pending,
            # which a resume would run again).
            trial.attempts += 1
            trial.status, trial.results, trial.exit_code = f"failed ({e})", [], None
            trial.nonfinite = False
            self.journal.append({"event": "start", "trial": trial.id, "attempt": attempt})
            self._ended(trial, attempt)
            return
        with self.lock:
            self.running[trial.id] = handle
        trial.status, trial.results, trial.nonfinite = "running", [], False
        trial.attempts += 1
        start = {"event": "start", "trial": trial.id, "attempt": attempt}
        job = getattr(handle, "job_name", None)
        if job is not None:
            start["job"] = job   # what a resume cancels if this driver is killed
        self.journal.append(start)
        self.status.started(trial)
        client = self.client(trial.id, attempt)
        if hasattr(handle, "on_end"):
            handle.on_end(self._waker(trial, attempt))
        stopped_at = bad = None
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
                if "step" not in record:   # _waker's: the trial has ended
                    break
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
            bad = _bad_report(record)
            if bad is not None:
                # Not the trial's report() (it checks these): not judged.
                bad = f"report {len(trial.results)}: {bad}"
                handle.kill()
                break
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
        if bad is not None:
            trial.status = f"failed ({bad})"
        elif trial.nonfinite:
            trial.status = f"failed ({self.metric}={trial.last.get(self.metric)})"
        elif early:
            trial.status = "stopped"
        elif interrupted:
            trial.status = "interrupted"
        elif trial.exit_code == 0:
            trial.status = "completed"
        else:
            trial.status = f"failed (exit {trial.exit_code})"
        self._ended(trial, attempt)

    def _ended(self, trial, attempt):
        self.journal.append({"event": "end", "trial": trial.id, "attempt": attempt,
                             "status": trial.status, "exit_code": trial.exit_code,
                             "nonfinite": trial.nonfinite})
        self.status.ended(trial)

    def _waker(self, trial, attempt):
        """A callback for a handle's on_end(): it puts an end record where
        the trial's thread waits for the next report, so that the thread
        learns of the end at once, not at its next poll of the handle."""
        client = self.client(trial.id, attempt)

        def wake():
            # The trial's reports are all in (the trial waits for the
            # answer to each); the first free index is the next one awaited.
            n = len(trial.results)
            while client.check([f"report/{n}"])[0]:
                n += 1
            client.set(f"report/{n}", json.dumps({"ended": True}))
        return wake

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


def _bad_report(record):
    """What is wrong with a report as the store holds it (a JSON object
    with an integer step), or None."""
    if not isinstance(record, dict):
        return f"{record!r} is not an object"
    step = record["step"]
    if isinstance(step, bool) or not isinstance(step, int):
        return f"step={step!r} is not an integer"
    return None


# Seconds a trial's thread waits for a report before it checks whether the
# trial ended: how late the search may learn that a slot is free.
_POLL = 0.05

# Start-up failures in this many first trials end the search.
_EARLY = 3


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
        with _tune_files.open_new(os.path.join(out_dir, "warm.log")) as log:
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
    scheduler: ASHA(...), Hyperband(...), or by name "asha" or "hyperband"
    (min_t 1, eta 3, max_t the command's --epochs, else 100), or None or
    "none" (every trial runs to its end). Its decisions are journalled, and
    a resume needs the same scheduler. A trial that goes on running
    stop_grace seconds after being told to stop is killed.
    runner: how a trial starts (default job_runner(): a 1-worker allreduce
    job). max_concurrent: a limit of the search's own; None: as many trials
    at once as the runner can run (default_concurrency(): job_runner: what
    fits on the machine's cores and GPUs; subprocess_runner, a runner
    without `capacity`, or job_runner with central: the local cores); each
    trial's configuration is drawn when it can start. retries: a failed
    trial is run again up to this many times.

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
    # As the command line names them: a new user typed --samples, not
    # num_samples (and None or "2" raised a TypeError from the comparison).
    if max_concurrent is not None and not (_whole(max_concurrent) and max_concurrent >= 1):
        raise InvalidArgumentError(f"max_concurrent (--max-concurrent): {max_concurrent!r} "
                                   "must be a whole number, at least 1")
    if not (_whole(retries) and retries >= 0):
        raise InvalidArgumentError(f"retries (--retries): {retries!r} must be a whole number, "
                                   "at least 0")
    warm = _warm_wanted(command, warm)
    if isinstance(scheduler, str):
        scheduler = make_scheduler(scheduler, metric, mode, command_epochs(command) or 100)
    elif isinstance(scheduler, (ASHA, Hyperband)):
        adopt(scheduler, metric, mode)
    runner = runner or job_runner()
    if max_concurrent is None:
        max_concurrent = default_concurrency(runner)
    out = _Output(out or sys.stdout)
    said = search is None
    search = search or default_search()
    sampler = _Sampler(space, num_samples, seed, search)
    head = {"event": "search", "command": list(command), "space": _space_json(space),
            "metric": metric, "mode": mode, "num_samples": num_samples, "seed": seed,
            "search": search, "scheduler": scheduler_spec(scheduler)}
    _tune_files.prepare_dir(out_dir)
    path = os.path.join(out_dir, _tune_journal.JOURNAL)
    trials = []
    if resume and not os.path.exists(path):
        raise NotFoundError(f"out_dir: {out_dir} has no search to resume ({path})")
    if not resume and os.path.exists(path):
        raise AlreadyExistsError(
            f"out_dir: {out_dir} holds a search already ({path}): resume it "
            f"(deepnex tune --resume {out_dir}) or choose another out_dir")
    journal = _tune_journal.Journal(path, resume=resume)
    try:
        if not resume:
            journal.append({**head, "note": note or {}})
        elif not journal.records:
            raise NotFoundError(f"out_dir: {out_dir} has no search to resume ({path})")
        else:
            _check_resume(path, journal.records[0], head)
            trials = _replay(journal.records, sampler, scheduler, metric, mode, retries)
            # The jobs of a driver that was killed hold their allocations
            # on central (the journal's lock says no driver runs now).
            cancel_jobs = getattr(runner, "cancel_jobs", None)
            if cancel_jobs is not None:
                cancelled = cancel_jobs({r["job"] for r in journal.records
                                         if r["event"] == "start" and "job" in r})
                if cancelled:
                    print(f"tune: cancelled {len(cancelled)} job(s) on central that the "
                          f"search's last run left: {', '.join(sorted(cancelled))}",
                          file=out, flush=True)
    except BaseException:
        journal.close()
        raise
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


def _whole(value):
    return isinstance(value, int) and not isinstance(value, bool)


def default_concurrency(runner):
    """How many trials run at once without max_concurrent: as many as the
    runner can run at once, its `capacity` where it has one (job_runner: the
    trials that fit on this machine's cores and GPUs), else (a plain
    process each, or central, which queues what it cannot grant yet) this
    machine's cores. A trial's configuration is drawn when it can start, not
    before (tpe and cmaes then learn from every trial that ended), and the
    search holds a thread per running trial only."""
    return getattr(runner, "capacity", None) or os.cpu_count() or 1


def _check_resume(path, recorded, head):
    for key, value in head.items():
        if recorded.get(key) != value:
            raise InvalidArgumentError(
                f"resume: {key} is {value!r}; the search in {path} has "
                f"{recorded.get(key)!r}")


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


def _run_trials(search, trials, max_concurrent, signals):
    """Starts a thread per trial as slots free up (the trials to run again
    first, then new ones, each configured by the sampler when its slot
    frees, so that it learns from every trial that ended before) and waits
    for them, acting on the signals received meanwhile."""
    at_once = f"{max_concurrent} at a time"
    again = [t for t in trials if t.status == "pending"]
    done = len(trials) - len(again)
    resumed = f" ({done} finished before, {len(again)} to run again)" if trials else ""
    search.status.say(f"tune: {search.sampler.total} trials{resumed}, {at_once}, metric "
                      f"{search.metric} ({search.mode}), {search.sampler.label}"
                      f"{scheduler_label(search.scheduler)}")
    slots = threading.Semaphore(max_concurrent)
    threads = []

    def body(trial):
        try:
            search.run_trial(trial)
        except CancelledError:
            trial.status = "not started"
        except Exception as e:  # noqa: BLE001 - the search goes on without it
            # A bug of the search's own: no trial process outlives it.
            with search.lock:
                handle = search.running.pop(trial.id, None)
            if handle is not None:
                handle.kill()
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
