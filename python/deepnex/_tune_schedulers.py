"""The schedulers of deepnex.tune: which trials stop early (ASHA,
Hyperband), and scheduler= as run() and deepnex tune take it."""

from fractions import Fraction

from .errors import InvalidArgumentError

# The names scheduler= takes (run()'s, and deepnex tune --scheduler's).
SCHEDULERS = ("asha", "hyperband", "none")


class ASHA:
    """Asynchronous successive halving (Li et al., 2020), as early stopping.

    Rungs sit at t = min_t * eta^k below max_t. When a trial first reports a
    step t at or past a rung above the ones it has been judged at, its value
    is recorded at the highest such rung; the trial goes on only if it is
    among the top max(1, floor(n/eta)) of the n values recorded at that rung
    so far (itself included; ties go on), so early trials are promoted
    optimistically and later ones must beat the rung's record. A trial that
    reaches max_t is done.

    metric and mode: run()'s where None (run() refuses others; used alone,
    mode None is "max").
    """

    def __init__(self, metric=None, mode=None, min_t=1, max_t=100, eta=3):
        _check(mode, min_t, max_t, eta)
        self.metric, self.mode = metric, mode
        self.min_t, self.max_t, self.eta = min_t, max_t, eta
        self.rungs = []
        t = min_t
        while t < max_t:
            self.rungs.append(t)
            t *= eta
        self._recorded = {r: {} for r in self.rungs}

    def spec(self):
        """What the journal keeps of it (a resume must use the same)."""
        return {"name": "asha", "min_t": self.min_t, "max_t": self.max_t, "eta": self.eta}

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
            sign = -1 if self.mode == "min" else 1
            better = sum(1 for v in values.values() if sign * v > sign * value)
            if better >= max(1, len(values) // self.eta):
                return "stop"
            break
        return "continue"


class Hyperband:
    """Asynchronous Hyperband (Li et al., 2018 and 2020; as Optuna's
    HyperbandPruner and Ray's HyperBandScheduler): brackets of successive
    halving that stop trials more or less early, since how early a poor
    trial shows is not known in advance.

    Bracket k (k = 0 .. s_max, s_max the largest s with min_t * eta^s <=
    max_t) is an ASHA whose first rung is min_t * eta^k: bracket 0 is
    ASHA(min_t, max_t, eta), the last judges trials latest (not at all when
    max_t is a power of eta times min_t). Each trial belongs to one bracket
    and is judged against that bracket's trials only. Of every
    sum(budgets) trials (a Hyperband iteration, by trial id), bracket k
    gets budgets[k] = ceil((s_max + 1) * eta^s / (s + 1)), s = s_max - k
    (the paper's n for that bracket), spread evenly over the iteration:
    bracket k's j-th trial sits at (j + 1/2) / budgets[k] of it (ties go to
    the lower bracket). A trial's bracket is a function of its id, so a
    resumed search puts it in the same one. metric and mode as ASHA's.
    """

    def __init__(self, metric=None, mode=None, min_t=1, max_t=100, eta=3):
        _check(mode, min_t, max_t, eta)
        self.metric, self.mode = metric, mode
        self.min_t, self.max_t, self.eta = min_t, max_t, eta
        s_max = 0
        while min_t * eta ** (s_max + 1) <= max_t:
            s_max += 1
        self.budgets = [-(-(s_max + 1) * eta ** (s_max - k) // (s_max - k + 1))
                        for k in range(s_max + 1)]
        # Each trial of an iteration is placed below, up front.
        if sum(self.budgets) > _MAX_ITERATION:
            raise InvalidArgumentError(
                f"min_t={min_t}, max_t={max_t}, eta={eta}: a Hyperband iteration of "
                f"{sum(self.budgets)} trials; at most {_MAX_ITERATION} (raise min_t or eta, "
                "or lower max_t)")
        self.brackets = [ASHA(metric, mode, min_t * eta ** k, max_t, eta)
                         for k in range(s_max + 1)]
        # Exact fractions: the ties fall to the lower bracket on any machine.
        spots = sorted((Fraction(2 * j + 1, 2 * n), k) for k, n in enumerate(self.budgets)
                       for j in range(n))
        self._iteration = [k for _, k in spots]

    def spec(self):
        """What the journal keeps of it (a resume must use the same)."""
        return {"name": "hyperband", "min_t": self.min_t, "max_t": self.max_t,
                "eta": self.eta}

    def bracket(self, trial):
        """The bracket (an index into brackets) of the trial with id `trial`."""
        return self._iteration[trial % len(self._iteration)]

    def on_result(self, trial, t, value):
        """"continue" or "stop" for trial (its id) reporting `value` at step `t`."""
        return self.brackets[self.bracket(trial)].on_result(trial, t, value)


# The most trials in a Hyperband iteration: past any search's, and placed
# in about a second.
_MAX_ITERATION = 100_000


def _check(mode, min_t, max_t, eta):
    if mode not in ("max", "min", None):
        raise InvalidArgumentError(f'mode: "{mode}" is not max or min')
    for name, value in (("min_t", min_t), ("max_t", max_t), ("eta", eta)):
        # Steps are whole: a float's rungs would never end for inf.
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"{name}: {value!r} is not an integer")
    if min_t < 1 or max_t < min_t:
        raise InvalidArgumentError(f"min_t={min_t}, max_t={max_t}: need 1 <= min_t <= max_t")
    if eta < 2:
        raise InvalidArgumentError(f"eta: {eta} must be at least 2")


def adopt(scheduler, metric, mode):
    """Gives run()'s metric and mode to `scheduler` (an ASHA or Hyperband)
    where it has none. One it was given that differs is refused: judging
    the other way, it would stop the best trials."""
    for field, wanted in (("metric", metric), ("mode", mode)):
        given = getattr(scheduler, field, None)
        if given is not None and given != wanted:
            raise InvalidArgumentError(
                f'scheduler: its {field} is "{given}", the search\'s "{wanted}" (leave it '
                f"out of {type(scheduler).__name__}(...) to use the search's)")
    for s in [scheduler] + list(getattr(scheduler, "brackets", [])):
        s.metric, s.mode = metric, mode


def make_scheduler(name, metric, mode, max_t, min_t=1, eta=3):
    """The scheduler that scheduler=`name` (one of SCHEDULERS) means."""
    if name not in SCHEDULERS:
        raise InvalidArgumentError(f'scheduler: "{name}" is not one of {", ".join(SCHEDULERS)}')
    if name == "none":
        return None
    cls = ASHA if name == "asha" else Hyperband
    return cls(metric=metric, mode=mode, min_t=min_t, max_t=max_t, eta=eta)


def scheduler_spec(scheduler):
    """The journal's record of a scheduler: None, its spec(), or for one
    of the caller's own, its class name."""
    if scheduler is None:
        return None
    spec = getattr(scheduler, "spec", None)
    return spec() if spec is not None else {"name": type(scheduler).__name__}


def scheduler_label(scheduler):
    """The scheduler, in the search's first line: "" for none."""
    spec = scheduler_spec(scheduler)
    if spec is None:
        return ""
    if "eta" not in spec:
        return f", scheduler {spec['name']}"
    brackets = getattr(scheduler, "brackets", None)
    return (f", {spec['name']} (steps {spec['min_t']} to {spec['max_t']}, eta {spec['eta']}"
            + (f", {len(brackets)} brackets)" if brackets is not None else ")"))
