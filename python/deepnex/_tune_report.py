"""The trial's side of deepnex.tune: its configuration, its checkpoint
directory and report(), and the environment variables a search gives it.
In a `deepnex run` job that no search runs, report() keeps rank 0's last
report for the job's record on deepnex-central instead."""

import json
import math
import os
import time

from ._convert import is_bool, is_real
from .errors import CancelledError, DeadlineExceededError, InvalidArgumentError, UnavailableError


ENV_STORE = "DEEPNEX_TUNE_STORE"
# The token of the search's store: without it a call is refused, so that
# another local user cannot forge a trial's reports or the search's
# decisions. A trial learns it with the store's address, from its
# environment (which only its own user can read).
ENV_STORE_TOKEN = "DEEPNEX_TUNE_STORE_TOKEN"
ENV_TRIAL = "DEEPNEX_TUNE_TRIAL"
ENV_CONFIG = "DEEPNEX_TUNE_CONFIG"
ENV_CHECKPOINT = "DEEPNEX_TUNE_CHECKPOINT_DIR"
ENV_ATTEMPT = "DEEPNEX_TUNE_ATTEMPT"


_report_state = {"client": None, "count": 0, "job_client": None}

# Where the job's worker keeps rank 0's last report in the job's store; the
# runner reads it for central (src/job/job.cc's kReportKey).
_JOB_REPORT_KEY = "deepnex/report"

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


# warm()'s results, by call (see _warm_key); a warm worker fills it before it
# forks the trials, which find them here.
_warm_results = {}


def warm(fn, *args, **kwargs):
    """fn(*args, **kwargs), e.g. a data set's loading, made once for all
    the warm trials of a search rather than once per trial: the script opts
    in by calling ``tune.warm(load_data)`` where it would call
    ``load_data()``. The warm worker finds such calls in the script (at
    module level or in a function) and makes them after its imports, before
    it forks any trial; each trial then gets the result as the worker made
    it (its memory shared copy-on-write: what a trial changes stays its
    own). The worker makes a call where fn is a function the script imports
    (``from digits_common import load_data``; not one the script defines)
    and the other arguments are literals. Otherwise, in a cold trial and
    outside a search, the process makes the call itself, once: later calls
    return the same object."""
    key = _warm_key(fn, args, kwargs)
    if key is None:
        return fn(*args, **kwargs)
    if key not in _warm_results:
        _warm_results[key] = fn(*args, **kwargs)
    return _warm_results[key]


def _warm_key(fn, args, kwargs):
    """What names a warm() call in any process (None for a function that
    only the script's own run defines: a lambda, one of __main__'s)."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module in (None, "__main__") or "<" in name:
        return None
    return (module, name, repr(args), repr(sorted(kwargs.items())))


def report(step, timeout=600.0, **metrics):
    """Reports `metrics` at `step` to the search running this trial; returns
    True when the trial should stop. Outside a search: False. Workers without
    metrics (ranks other than 0) wait, up to `timeout` seconds, for the
    answer to rank 0's report of the same step. A search that is gone
    (killed, or ended) raises UnavailableError within 5 s, so that the trial
    ends rather than training on for nobody.

    In a `deepnex run` job outside a search: rank 0's report (step, metrics,
    time) becomes the job's last report, which deepnex-central shows in
    `deepnex jobs` and sends in job.progress events; other ranks' are ignored,
    as torchrun's and Horovod's users expect. Returns False. A metric that is
    not a finite number raises InvalidArgumentError naming it."""
    step = _job_step(step)
    address, trial = os.environ.get(ENV_STORE), os.environ.get(ENV_TRIAL)
    if not address or not trial:
        return _report_to_job(step, metrics)
    from .collective import StoreClient
    deadline = time.monotonic() + timeout
    try:
        if _report_state["client"] is None:
            # Connecting is the first contact: a search already gone fails here.
            attempt = os.environ.get(ENV_ATTEMPT, "0")
            _report_state["client"] = StoreClient(address, prefix=f"tune/{trial}/{attempt}",
                                                  timeout=_REACH_TIMEOUT,
                                                  token=os.environ.get(ENV_STORE_TOKEN) or None)
        client = _report_state["client"]
        if metrics:
            record = {"step": step, **{k: _metric(step, k, v) for k, v in metrics.items()}}
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


def _report_to_job(step, metrics):
    """report() in a `deepnex run` job (DEEPNEX_JOB_ID and its store's
    DEEPNEX_STORE_ADDR set); False, doing nothing, anywhere else."""
    address, job = os.environ.get("DEEPNEX_STORE_ADDR"), os.environ.get("DEEPNEX_JOB_ID")
    if not address or not job:
        # Checked as in a search: a script tried on its own meets its bad
        # metric now, not once a search runs it (probe).
        for name, value in metrics.items():
            _metric(step, name, value)
        return False
    record = {"step": step, "metrics": {}, "time_ms": int(time.time() * 1000)}
    for name, value in metrics.items():
        number = _metric(step, name, value)
        if not math.isfinite(number):
            raise InvalidArgumentError(
                f"deepnex.report(step={step}): metric {name}={value!r} is not a finite number")
        record["metrics"][name] = number
    if os.environ.get("DEEPNEX_RANK", "0") != "0":
        return False
    from .collective import StoreClient
    if _report_state["job_client"] is None:
        _report_state["job_client"] = StoreClient(
            address, timeout=_REACH_TIMEOUT, token=os.environ.get("DEEPNEX_TOKEN") or None)
    try:
        _report_state["job_client"].set(_JOB_REPORT_KEY, json.dumps(record))
    except (DeadlineExceededError, UnavailableError) as e:
        raise UnavailableError(
            f"deepnex.report(step={step}): the store of job {job} at {address} does not "
            f"answer ({e})") from None
    return False


def _metric(step, name, value):
    """A metric as a float (NaN and infinities too); InvalidArgumentError
    naming it for a string or anything else that is not a real number."""
    try:
        # A bool is no measure (a probe's accuracy=True ranked its trial
        # best), nor is a complex number, bytes or a duration, all of which
        # float() takes.
        if not is_real(value):
            raise ValueError
        return float(value)
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgumentError(
            f"deepnex.report(step={step}): metric {name}={value!r} is not a number") from None


def _job_step(step):
    try:
        if is_bool(step) or int(step) != step:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgumentError(f"deepnex.report: step={step!r} is not an integer") from None
    if step < 0:
        # The schedulers' rungs count steps from 0 up.
        raise InvalidArgumentError(f"deepnex.report: step={step!r} is below 0")
    return int(step)
