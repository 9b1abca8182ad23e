"""The search methods of deepnex.tune: which configuration a new trial gets
(random, grid, or Optuna's tpe and cmaes by ask and tell)."""

import itertools
import json
import math

from ._tune_space import (_Choice, _Domain, _Grid, _LogUniform, _RandInt, _Uniform, _describe,
                          check_names, check_search_size, generate_configs)
from .errors import InvalidArgumentError


SEARCHES = ("random", "grid", "tpe", "cmaes")


def default_search():
    """"tpe" where Optuna is importable, "random" otherwise."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        return "random"
    return "tpe"


class _Sampler:
    """Picks the configurations of a search: num_samples for each point of
    the grid() dimensions. random: generate_configs (the i-th trial gets the
    i-th configuration of the seed, however trials interleave). grid: every
    choice() dimension is a grid dimension too. tpe, cmaes: Optuna's sampler
    proposes the sampled dimensions from the trials that ended so far (ask
    and tell); deepnex runs the trials and decides on stopping them. They
    run with Optuna's defaults, as a study of Optuna's own would (TPE: 10
    random start-up trials, no constant liar; trials still running are not
    in the model), seeded with `seed`."""

    def __init__(self, space, num_samples, seed, search):
        if search not in SEARCHES:
            raise InvalidArgumentError(f'search: "{search}" is not one of '
                                       f'{", ".join(SEARCHES)}')
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
        check_names(space)
        check_search_size(space, num_samples)
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
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            # Optuna's samplers seed NumPy, which takes these only.
            raise InvalidArgumentError(f"seed (--seed): {seed!r} is not a whole number in "
                                       f"0..{2**32 - 1}, which {search} needs")
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
        """What `trial` came to (it ended for good), for the model, as
        Optuna's study records it when the peer runs the trial itself: its
        reports as intermediate values (trial.report(value, step) each);
        completed: COMPLETE with its last value; stopped by the scheduler:
        PRUNED (Optuna takes the last intermediate value as its value, and
        TPE ranks it by its last step, then that value); a NaN or infinite
        metric: PRUNED with NaN at that step (what Optuna's pruners make of
        a NaN: TPE ranks it last among the trials that reached the step);
        failed: FAIL. `sign`: 1 when the metric is maximized, -1 when
        minimized (the study maximizes)."""
        if self._study is None or not self._dists:
            return
        optuna = self._optuna
        State = optuna.trial.TrialState
        steps = {}
        for r in trial.results:
            v, step = r.get(metric), r.get("step")
            # Optuna's report() takes steps from 0 (ints, by its docs).
            if isinstance(v, (int, float)) and isinstance(step, int) and step >= 0:
                steps[step] = sign * v if math.isfinite(v) else math.nan
        last = steps[max(steps)] if steps else math.nan
        if trial.status == "completed" and math.isfinite(last) and not trial.nonfinite:
            state, value = State.COMPLETE, last
        elif (trial.status == "stopped" and math.isfinite(last)) or trial.nonfinite:
            state, value = State.PRUNED, None
        else:
            state, value = State.FAIL, None
        asked = self._asked.pop(trial.id, None)
        if asked is not None:
            for step, v in sorted(steps.items()):
                asked.report(v, step)
            self._study.tell(asked, value, state=state)
            return
        # A trial from before a resume: its history, as the live tell()
        # above leaves it in the study (a pruned trial's value its last
        # intermediate one, where finite).
        if state == State.PRUNED and math.isfinite(last):
            value = last
        params = {k: _asked_value(d, trial.config[k]) for k, d in self._dists.items()}
        self._study.add_trial(optuna.trial.create_trial(
            params=params, distributions=self._dists, value=value, state=state,
            intermediate_values=steps))


def _asked_value(distribution, value):
    """A journalled configuration value as Optuna asked it: the journal's
    JSON has made a choice()'s tuple a list, which is none of the
    distribution's choices."""
    choices = getattr(distribution, "choices", None)
    if choices is None or value in choices:
        return value
    for choice in choices:
        if json.loads(json.dumps(choice)) == value:
            return choice
    return value


def _distribution(optuna, domain):
    d = optuna.distributions
    if isinstance(domain, _Uniform):
        return d.FloatDistribution(domain.low, domain.high)
    if isinstance(domain, _LogUniform):
        return d.FloatDistribution(domain.low, domain.high, log=True)
    if isinstance(domain, _RandInt):
        if max(abs(domain.low), abs(domain.high)) > 2**53:
            # Optuna's samplers draw through floats: past 2^53, always low.
            raise InvalidArgumentError(
                f"randint({domain.low}, {domain.high}): tpe and cmaes draw ints exactly only "
                "within +-2^53; use search=\"random\" or \"grid\"")
        return d.IntDistribution(domain.low, domain.high - 1)
    return d.CategoricalDistribution(domain.values)
