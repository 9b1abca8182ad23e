"""The schedulers of deepnex.tune: which trials stop early (ASHA)."""

from .errors import InvalidArgumentError


class ASHA:
    """Asynchronous successive halving (Li et al., 2020), as early stopping.

    Rungs sit at t = min_t * eta^k below max_t. When a trial first reports a
    step t at or past a rung above the ones it has been judged at, its value
    is recorded at the highest such rung; the trial goes on only if it is
    among the top max(1, floor(n/eta)) of the n values recorded at that rung
    so far (itself included; ties go on), so early trials are promoted
    optimistically and later ones must beat the rung's record. A trial that
    reaches max_t is done.
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
