"""Search spaces of deepnex.tune: the domains (uniform, loguniform, randint,
choice, grid), the configurations they expand into, and the "name=expr"
strings of deepnex tune --space."""

import ast
import itertools
import json
import math
import numbers
import random
from dataclasses import dataclass

from .errors import InvalidArgumentError


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


# The most trials a search expands into: its configurations are made up
# front (the grid's product times num_samples), and a grid of 1000 x 1000 x
# 1000 took the machine's 24 GiB before the OOM killer ended it.
MAX_TRIALS = 100_000


def _check_range(name, low, high, kind=float):
    """low and high as `kind` (float: finite; int: whole), low below high."""
    def number(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        if kind is int:
            # An int is whole however large (float() of one past 1e308
            # overflows).
            return int(v) if isinstance(v, int) or v.is_integer() else None
        try:
            return float(v) if math.isfinite(v) else None
        except OverflowError:   # an int past a float's range: not finite as a float
            return None
    lo, hi = number(low), number(high)
    if lo is None or hi is None:
        what = "whole numbers" if kind is int else "finite numbers"
        raise InvalidArgumentError(f"{name}({low!r}, {high!r}): low and high must be {what}")
    if not lo < hi:
        raise InvalidArgumentError(f"{name}({low}, {high}): low must be below high")
    if kind is float and not math.isfinite(hi - lo):
        # Every draw would be an infinity.
        raise InvalidArgumentError(f"{name}({low}, {high}): high - low is past a float's range")
    return lo, hi


def _plain(name, value):
    """`value` as a trial's JSON configuration carries it: a NumPy scalar as
    its Python number; InvalidArgumentError naming `name` for anything JSON
    cannot carry."""
    if isinstance(value, numbers.Number) and hasattr(value, "item"):
        value = value.item()
    try:
        text = json.dumps(value, allow_nan=True, ensure_ascii=False)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name}: {value!r} is not a JSON value (a trial gets its "
                                   "configuration as JSON)") from None
    if not _utf8(text):
        # A command-line byte that is not UTF-8: results.csv and best.json
        # (UTF-8) could not be written, after every trial had run.
        raise InvalidArgumentError(f"{name}: {value!r} is not UTF-8 text")
    return value


def _utf8(text):
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def uniform(low, high):
    """A float drawn uniformly from [low, high)."""
    return _Uniform(*_check_range("uniform", low, high))


def loguniform(low, high):
    """A float whose logarithm is uniform: as likely in [1e-3, 1e-2) as in
    [1e-2, 1e-1). 0 < low < high."""
    low, high = _check_range("loguniform", low, high)
    if low <= 0:
        raise InvalidArgumentError(f"loguniform({low}, {high}): low must be positive")
    return _LogUniform(low, high)


def randint(low, high):
    """An int n with low <= n < high."""
    return _RandInt(*_check_range("randint", low, high, kind=int))


def choice(values):
    """One of `values`, each equally likely."""
    values = tuple(_plain("choice", v) for v in values)
    if not values:
        raise InvalidArgumentError("choice([]): needs at least one value")
    return _Choice(values)


def grid(values):
    """Every one of `values`: the search runs each (times the other grid
    dimensions' values, times num_samples)."""
    values = tuple(_plain("grid", v) for v in values)
    if not values:
        raise InvalidArgumentError("grid([]): needs at least one value")
    return _Grid(values)


def check_names(space):
    """InvalidArgumentError for a name that is no flag name, and for two
    names that reach a trial as the same --flag (underscores become
    dashes): lr_a and lr-a."""
    flags = {}
    for name in space:
        # A name is the trial's --flag and a column of the status table and
        # results.csv: a newline broke the table, and bytes that are not
        # UTF-8 failed the writing of the results once every trial had run.
        if not isinstance(name, str) or not name or not name.isprintable() or not _utf8(name):
            raise InvalidArgumentError(f"space: the name {name!r} is not printable UTF-8 text "
                                       "(it is the trial's --flag and a column of results.csv)")
        flag = "--" + name.replace("_", "-")
        if flag in flags:
            raise InvalidArgumentError(f"space: {flags[flag]} and {name} both reach the trial "
                                       f"as {flag}; rename one")
        flags[flag] = name


def check_search_size(space, num_samples):
    """InvalidArgumentError unless num_samples >= 1 and the search has at most
    MAX_TRIALS trials (each grid() dimension's values multiplied, times
    num_samples); checked before anything is expanded."""
    if (isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral) or
            num_samples < 1):
        raise InvalidArgumentError(f"num_samples (--samples): {num_samples!r} must be a whole "
                                   "number, at least 1")
    grids = [(k, len(v.values)) for k, v in space.items() if isinstance(v, _Grid)]
    trials = math.prod(n for _, n in grids) * num_samples
    if trials > MAX_TRIALS:
        shape = (f"grid {' x '.join(f'{k}: {n}' for k, n in grids)}, " if grids else "")
        raise InvalidArgumentError(
            f"the search has {trials} trials ({shape}num_samples {num_samples}); "
            f"at most {MAX_TRIALS}")


def generate_configs(space, num_samples=1, seed=0):
    """The configurations of a search: for each combination of the grid()
    dimensions (in the order of `space`), num_samples draws of the others."""
    check_search_size(space, num_samples)
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
        if not sep or not name or not expr:
            raise InvalidArgumentError(f'space: "{spec}" is not name=expression')
        if name in space:
            # The later one would silently replace the first.
            raise InvalidArgumentError(f'space: "{spec}": {name} is given twice')
        try:
            node = ast.parse(expr, mode="eval").body
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id not in _FUNCTIONS:
                    raise ValueError(f"unknown function {node.func.id}")
                if node.keywords:
                    raise ValueError(f"{node.func.id}() takes its arguments by position only")
                args = [_literal(a) for a in node.args]
                space[name] = _FUNCTIONS[node.func.id](*args)
            elif isinstance(node, ast.Name):
                raise ValueError(f"{node.id} is no literal (a string is quoted: '{node.id}')")
            else:
                space[name] = _plain(name, _literal(node))
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f'space: "{spec}": {e}') from None
        except (SyntaxError, ValueError, TypeError) as e:
            reason = e.msg if isinstance(e, SyntaxError) else e
            raise InvalidArgumentError(
                f'space: "{spec}": {reason} (use a literal, uniform(a, b), loguniform(a, b), '
                f'randint(a, b), choice([...]) or grid([...]))') from None
    return space


def _literal(node):
    """ast.literal_eval's value of `node`; a ValueError that shows the
    expression otherwise (its own said "malformed node or string on line 1:
    <ast.Name object at 0x...>" for a probe's uniform(0, inf))."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(f"{ast.unparse(node)} is not a literal (a number, a quoted string, "
                         "or a list or tuple of them)") from None


def _space_json(space):
    """The space as the journal records it (a resume must get the same)."""
    out = {}
    for k, v in space.items():
        if isinstance(v, (_Domain, _Grid)):
            out[k] = [type(v).__name__.lstrip("_").lower(), list(getattr(v, "values", ()))
                      or [v.low, v.high]]
        else:
            out[k] = ["value", _plain(k, v)]
    return json.loads(json.dumps(out))


def _describe(domain):
    if isinstance(domain, _Choice):
        return f"choice({list(domain.values)})"
    return f"{type(domain).__name__.lstrip('_').lower()}({domain.low}, {domain.high})"
