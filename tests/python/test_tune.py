"""deepnex.tune: search spaces, ASHA's promotions (exact), searches with
stand-in trials, and a search on the digits example reaching 0.95."""

import argparse
import csv
import fcntl
import io
import json
import math
import os
import random
import re
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time

import pytest

from _wait import wait_for
from deepnex import tune
from deepnex.errors import (DataLossError, FailedPreconditionError, InvalidArgumentError,
                            NotFoundError, ResourceExhaustedError)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- spaces

def test_domains_sample_in_range():
    rng = random.Random(1)
    for _ in range(200):
        assert 2.0 <= tune.uniform(2, 3).sample(rng) < 3.0
        assert 1e-3 <= tune.loguniform(1e-3, 1e-1).sample(rng) < 1e-1
        assert tune.randint(5, 8).sample(rng) in (5, 6, 7)
        assert tune.choice(["a", "b"]).sample(rng) in ("a", "b")
    logs = [tune.loguniform(1e-4, 1).sample(rng) for _ in range(2000)]
    below = sum(1 for v in logs if v < 1e-2)   # half of the log range
    assert 850 < below < 1150


def test_bad_domains_raise():
    with pytest.raises(ValueError, match=r"uniform\(3, 2\)"):
        tune.uniform(3, 2)
    with pytest.raises(ValueError, match="low must be positive"):
        tune.loguniform(0, 1)
    with pytest.raises(ValueError, match=r"choice\(\[\]\)"):
        tune.choice([])
    with pytest.raises(ValueError, match=r"^num_samples \(--samples\): 0 must be a whole "):
        tune.generate_configs({"a": 1}, 0)
    # Bounds that sample nothing sensible: inf gave inf, (-inf, inf) nan,
    # and randint(0.5, 3.7) drew 0, below its low.
    for make, message in [(lambda: tune.uniform(0, math.inf), r"^uniform\(0, inf\): low and "
                           "high must be finite numbers$"),
                          (lambda: tune.loguniform(1, math.inf), r"^loguniform\(1, inf\)"),
                          (lambda: tune.uniform("a", "b"), r"^uniform\('a', 'b'\)"),
                          (lambda: tune.randint(0.5, 3.7), r"^randint\(0.5, 3.7\): low and "
                           "high must be whole numbers$")]:
        with pytest.raises(InvalidArgumentError, match=message):
            make()
    assert tune.randint(1.0, 3).sample(random.Random(0)) in (1, 2)


def test_a_search_too_big_to_expand_is_refused_before_it_is():
    # 10^9 configurations were made up front, and the OOM killer ended it.
    space = {"a": tune.grid(range(1000)), "b": tune.grid(range(1000)),
             "c": tune.grid(range(1000)), "lr": tune.uniform(0, 1)}
    message = (r"^the search has 1000000000 trials \(grid a: 1000 x b: 1000 x c: 1000, "
               r"num_samples 1\); at most 100000$")
    with pytest.raises(InvalidArgumentError, match=message):
        tune.generate_configs(space)
    for search in ("random", "grid"):
        with pytest.raises(InvalidArgumentError, match=message):
            tune._Sampler({k: v for k, v in space.items() if k != "lr"}, 1, 0, search)
    with pytest.raises(InvalidArgumentError, match=r"has 100001 trials \(num_samples 100001\)"):
        tune.generate_configs({"lr": tune.uniform(0, 1)}, 100_001)
    assert len(tune.generate_configs({"a": tune.grid(range(1000))}, 100)) == 100_000


def test_grid_expands_and_random_dims_are_drawn_per_sample():
    space = {"lr": tune.uniform(0, 1), "h": tune.grid([32, 64]), "opt": tune.grid(["a", "b"]),
             "epochs": 3}
    configs = tune.generate_configs(space, num_samples=2, seed=7)
    assert [(c["h"], c["opt"]) for c in configs] == [
        (32, "a"), (32, "a"), (32, "b"), (32, "b"), (64, "a"), (64, "a"), (64, "b"), (64, "b")]
    assert all(c["epochs"] == 3 for c in configs)
    assert len({c["lr"] for c in configs}) == 8
    assert configs == tune.generate_configs(space, num_samples=2, seed=7)
    assert configs != tune.generate_configs(space, num_samples=2, seed=8)


def test_parse_space():
    space = tune.parse_space(["lr=loguniform(1e-3, 0.5)", "hidden=grid([32, 64])",
                              "act=choice(['relu', 'tanh'])", "n=randint(1, 4)", "epochs=5"])
    assert space == {"lr": tune.loguniform(1e-3, 0.5), "hidden": tune.grid([32, 64]),
                     "act": tune.choice(["relu", "tanh"]), "n": tune.randint(1, 4),
                     "epochs": 5}
    with pytest.raises(ValueError, match='space: "lr"'):
        tune.parse_space(["lr"])
    with pytest.raises(ValueError, match="unknown function normal"):
        tune.parse_space(["lr=normal(0, 1)"])
    with pytest.raises(ValueError, match="__import__"):
        tune.parse_space(["x=__import__('os')"])
    hint = (" (use a literal, uniform(a, b), loguniform(a, b), randint(a, b), choice([...]) "
            "or grid([...]))")
    # What a new user types: each names the --space and what is wrong with it.
    for spec, message in (
            ("opt=adam", "adam is no literal (a string is quoted: 'adam')" + hint),
            ("x=choice(values=[1, 2])", "choice() takes its arguments by position only" + hint),
            ("lr=uniform(0.1, 1e-3)", "uniform(0.1, 0.001): low must be below high"),
            ("s={1, 2}", "s: {1, 2} is not a JSON value (a trial gets its configuration as "
                         "JSON)"),
            ("x=[1,", "'[' was never closed" + hint),
            # Was "malformed node or string on line 1: <ast.Name object at 0x...>".
            ("lr=uniform(0, inf)", "inf is not a literal (a number, a quoted string, or a list "
                                   "or tuple of them)" + hint),
            ("x=[1, a + b]", "[1, a + b] is not a literal (a number, a quoted string, or a list "
                             "or tuple of them)" + hint)):
        with pytest.raises(InvalidArgumentError) as info:
            tune.parse_space(["a=1", spec])
        assert str(info.value) == f'space: "{spec}": {message}'
    with pytest.raises(InvalidArgumentError) as info:
        tune.parse_space(["x="])
    assert str(info.value) == 'space: "x=" is not name=expression'


def test_a_space_takes_numpy_values_and_refuses_what_json_cannot_carry():
    """np.arange in a grid ended in "Object of type int64 is not JSON
    serializable"; uniform(-1.7e308, 1.7e308) drew inf every time; tpe drew
    randint(2^62, 2^62 + 3)'s low every time."""
    np = pytest.importorskip("numpy")
    g = tune.grid(np.arange(16, 64, 16))
    assert g.values == (16, 32, 48) and all(type(v) is int for v in g.values)
    assert tune.choice(np.array([0.5])).values == (0.5,)
    with pytest.raises(InvalidArgumentError) as info:
        tune.grid([object])
    assert str(info.value) == ("grid: <class 'object'> is not a JSON value (a trial gets its "
                               "configuration as JSON)")
    with pytest.raises(InvalidArgumentError) as info:
        tune.uniform(-1.7e308, 1.7e308)
    assert str(info.value) == "uniform(-1.7e+308, 1.7e+308): high - low is past a float's range"
    pytest.importorskip("optuna")
    with pytest.raises(InvalidArgumentError) as info:
        tune._Sampler({"n": tune.randint(2**62, 2**62 + 3)}, 1, 0, "tpe")
    assert str(info.value) == ("randint(4611686018427387904, 4611686018427387907): tpe and "
                               "cmaes draw ints exactly only within +-2^53; use "
                               'search="random" or "grid"')


# ---- ASHA

def test_asha_rungs():
    assert tune.ASHA(min_t=1, max_t=100, eta=3).rungs == [1, 3, 9, 27, 81]
    assert tune.ASHA(min_t=2, max_t=8, eta=2).rungs == [2, 4]
    with pytest.raises(ValueError, match="eta: 1"):
        tune.ASHA(eta=1)


def test_asha_promotes_the_top_third_of_each_rung():
    a = tune.ASHA(metric="acc", mode="max", min_t=1, max_t=9, eta=3)
    steps = [
        (0, 1, 0.50, "continue"),  # first at rung 1: promoted optimistically
        (1, 1, 0.40, "stop"),      # 2 at the rung, keep max(1, 0) = 1: 0.5 is better
        (2, 1, 0.60, "continue"),  # the rung's best
        (3, 1, 0.55, "stop"),      # 4 recorded, keep 1: 0.6 is better
        (0, 2, 0.10, "continue"),  # no rung at 2: goes on whatever the value
        (0, 3, 0.70, "continue"),  # first at rung 3
        (2, 3, 0.65, "stop"),      # 2 at rung 3, 0.7 is better
        (4, 1, 0.30, "stop"),      # 5 recorded, keep 1
        (5, 1, 0.58, "continue"),  # 6 recorded, keep 2: only 0.6 is better
        (6, 1, 0.60, "continue"),  # a tie with the best goes on
        (0, 9, 0.90, "stop"),      # max_t: done
    ]
    for trial, t, value, expected in steps:
        assert a.on_result(trial, t, value) == expected, (trial, t, value)
    assert a.recorded(1) == {0: 0.5, 1: 0.4, 2: 0.6, 3: 0.55, 4: 0.3, 5: 0.58, 6: 0.6}
    assert a.recorded(3) == {0: 0.7, 2: 0.65}


def test_asha_min_mode_and_skipped_rungs():
    a = tune.ASHA(mode="min", min_t=1, max_t=27, eta=3)
    assert a.on_result("a", 1, 2.0) == "continue"
    assert a.on_result("b", 1, 1.0) == "continue"   # lower is better
    assert a.on_result("c", 1, 3.0) == "stop"
    # A first report at t=4 counts at rung 3 only.
    assert a.on_result("d", 4, 5.0) == "continue"
    assert "d" not in a.recorded(1) and a.recorded(3) == {"d": 5.0}
    assert a.on_result("e", 5, 6.0) == "stop"
    assert a.on_result("d", 4, 99.0) == "continue"  # rung 3 already recorded for d


def test_hyperband_brackets_and_their_share_of_the_trials():
    h = tune.Hyperband(min_t=1, max_t=9, eta=3)
    # s_max = 2: the paper's n per bracket, ceil(3 * 3^s / (s + 1)) for s = 2, 1, 0.
    assert h.budgets == [9, 5, 3]
    assert [b.rungs for b in h.brackets] == [[1, 3], [3], []]
    assert [h.bracket(i) for i in range(17)] == [0, 1, 0, 2, 0, 1, 0, 0, 1, 2, 0, 1, 0, 0, 2,
                                                 1, 0]
    assert [h.bracket(i) for i in range(17, 21)] == [0, 1, 0, 2]   # the next iteration
    h = tune.Hyperband(min_t=1, max_t=12, eta=3)
    assert h.budgets == [9, 5, 3] and [b.rungs for b in h.brackets] == [[1, 3, 9], [3, 9], [9]]
    # 243 = 3^5: six brackets (a floating-point log would say 4.999... and five).
    h = tune.Hyperband(min_t=1, max_t=243, eta=3)
    assert len(h.brackets) == 6 and h.brackets[5].rungs == []
    assert tune.Hyperband(min_t=2, max_t=8, eta=2).budgets == [4, 3, 3]
    with pytest.raises(InvalidArgumentError, match="eta: 1"):
        tune.Hyperband(eta=1)
    with pytest.raises(InvalidArgumentError, match="min_t=5, max_t=4"):
        tune.Hyperband(min_t=5, max_t=4)


def test_scheduler_steps_are_integers_and_an_iteration_is_bounded():
    """ASHA(max_t=inf) never returned (its rungs grew without end), and a
    Hyperband to max_t=10^9 built its iteration for minutes, gigabytes."""
    for cls in (tune.ASHA, tune.Hyperband):
        with pytest.raises(InvalidArgumentError) as info:
            cls(max_t=float("inf"))
        assert str(info.value) == "max_t: inf is not an integer"
        with pytest.raises(InvalidArgumentError) as info:
            cls(max_t="12")
        assert str(info.value) == "max_t: '12' is not an integer"
    with pytest.raises(InvalidArgumentError) as info:
        tune.Hyperband(max_t=10**9, eta=2)
    message = str(info.value)
    assert message.startswith("min_t=1, max_t=1000000000, eta=2: a Hyperband iteration of ")
    assert message.endswith(" trials; at most 100000 (raise min_t or eta, or lower max_t)")
    assert sum(tune.Hyperband(max_t=3**9).budgets) == 31439  # ten brackets: kept


def test_a_scheduler_takes_the_searchs_metric_and_mode_or_is_refused(tmp_path):
    """A scheduler built without mode= judged "max" in a mode="min" search,
    stopping every trial better than the first."""
    from deepnex import _tune_schedulers
    h = tune.Hyperband(min_t=1, max_t=9, eta=3)
    _tune_schedulers.adopt(h, "loss", "min")
    assert {(s.metric, s.mode) for s in [h] + h.brackets} == {("loss", "min")}
    for given, message in (
            (tune.ASHA(mode="max"), 'scheduler: its mode is "max", the search\'s "min" (leave it '
                                    "out of ASHA(...) to use the search's)"),
            (tune.Hyperband(metric="acc"), 'scheduler: its metric is "acc", the search\'s '
                                           '"loss" (leave it out of Hyperband(...) to use the '
                                           "search's)")):
        with pytest.raises(InvalidArgumentError) as info:
            tune.run(["true"], {"x": 1}, metric="loss", mode="min", scheduler=given,
                     out_dir=str(tmp_path / "refused"))
        assert str(info.value) == message
    assert not (tmp_path / "refused").exists()


def _stops(scheduler, values, max_t):
    """{trial: the step it stopped at}, each trial reporting its value at
    steps 1, 2, ... until told to stop."""
    stops = {}
    for trial, value in enumerate(values):
        for t in range(1, max_t + 1):
            if scheduler.on_result(trial, t, value) == "stop":
                stops[trial] = t
                break
    return stops


# Trials 0..6 are in brackets 0, 1, 0, 2, 0, 1, 0 of Hyperband(1, 9, 3).
_HYPERBAND_VALUES = [0.5, 0.4, 0.3, 0.1, 0.6, 0.2, 0.45]


def test_hyperband_judges_each_trial_in_its_bracket_only():
    h = tune.Hyperband(metric="score", mode="max", min_t=1, max_t=9, eta=3)
    assert _stops(h, _HYPERBAND_VALUES, 9) == {
        0: 9,   # bracket 0: first at rungs 1 and 3, runs to max_t
        1: 9,   # bracket 1: first at its rung 3
        2: 1,   # bracket 0, rung 1: 0.5 is better
        3: 9,   # bracket 2 has no rung: the worst trial runs to max_t
        4: 9,   # bracket 0: best at rungs 1 and 3
        5: 3,   # bracket 1, rung 3: 0.4 is better (ASHA would have stopped it at 1)
        6: 1}   # bracket 0, rung 1: 4 values, keep 1
    assert h.brackets[0].recorded(1) == {0: 0.5, 2: 0.3, 4: 0.6, 6: 0.45}
    assert h.brackets[0].recorded(3) == {0: 0.5, 4: 0.6}
    assert h.brackets[1].recorded(3) == {1: 0.4, 5: 0.2}
    # The same trials under ASHA: every one judged at step 1 against all.
    assert _stops(tune.ASHA(min_t=1, max_t=9, eta=3), _HYPERBAND_VALUES, 9) == {
        0: 9, 1: 1, 2: 1, 3: 1, 4: 9, 5: 1, 6: 1}
    # min: lower is better; trial 3 (bracket 2) still runs to the end.
    low = tune.Hyperband(mode="min", min_t=1, max_t=9, eta=3)
    assert _stops(low, _HYPERBAND_VALUES, 9) == {0: 9, 1: 9, 2: 9, 3: 9, 4: 1, 5: 9, 6: 1}


# ---- searches with stand-in trials

TRIAL = textwrap.dedent("""
    import argparse, os, sys, time
    from deepnex import tune
    ap = argparse.ArgumentParser()
    ap.add_argument("--x", type=float)
    ap.add_argument("--fail-at", type=float, default=-1)
    ap.add_argument("--barrier-dir", default="")
    ap.add_argument("--barrier-wait", type=float, default=30)
    args = ap.parse_args()
    assert tune.get_config()["x"] == args.x
    trial = os.environ["DEEPNEX_TUNE_TRIAL"]
    if args.barrier_dir:
        open(os.path.join(args.barrier_dir, trial), "w").close()
        deadline = time.monotonic() + args.barrier_wait
        # Trials 0 and 1 wait for each other; `running` is what ended the wait.
        while True:
            running = len([f for f in os.listdir(args.barrier_dir) if f.isdigit()])
            if int(trial) >= 2 or running >= 2 or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if running >= 2:
            open(os.path.join(args.barrier_dir, "saw" + trial), "w").close()
    if args.x == args.fail_at:
        sys.exit(3)
    for step in range(1, 10):
        metrics = {"score": args.x * step}
        if args.barrier_dir:
            metrics["running"] = running
        if tune.report(step=step, **metrics):
            print("told to stop at", step)
            break
    if args.barrier_dir:
        # One that saw its peer stays until the peer saw it too: a trial that
        # came second and finished at once would be gone before the first looked.
        peer = os.path.join(args.barrier_dir, "saw" + str(1 - int(trial)))
        while (int(trial) < 2 and running >= 2 and not os.path.exists(peer)
               and time.monotonic() < deadline + args.barrier_wait):
            time.sleep(0.02)
        os.remove(os.path.join(args.barrier_dir, trial))
""")


@pytest.fixture
def trial_script(tmp_path):
    path = tmp_path / "trial.py"
    path.write_text(TRIAL)
    return [sys.executable, str(path)]


def test_search_with_asha_stops_poor_trials(trial_script, tmp_path, capsys):
    out = tmp_path / "out"
    results = tune.run(trial_script, {"x": tune.grid([4.0, 3.0, 2.0, 1.0]),
                                      "fail_at": 2.0},
                       metric="score", mode="max", max_concurrent=1,
                       scheduler=tune.ASHA(metric="score", min_t=1, max_t=9, eta=3),
                       out_dir=str(out))
    statuses = [(t.config["x"], t.status, t.last.get("step")) for t in results.trials]
    assert statuses == [(4.0, "completed", 9), (3.0, "stopped", 1),
                        (2.0, "failed (exit 3)", None), (1.0, "stopped", 1)]
    assert results.best.id == 0 and results.best.last["score"] == 36.0
    with open(out / "results.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["trial", "status", "steps", "x", "fail_at", "score"]
    assert rows[1] == ["0", "completed", "9", "4", "2", "36"]
    assert rows[2] == ["1", "stopped", "1", "3", "2", "3"]
    assert rows[3] == ["2", "failed (exit 3)", "", "2", "2", ""]
    assert json.loads((out / "best.json").read_text())["config"] == {"x": 4.0, "fail_at": 2.0}
    assert "told to stop at 1" in (out / "trial_1.log").read_text()
    printed = capsys.readouterr().out
    assert "best: trial 0 score=36.0000 config: x=4 fail_at=2" in printed


def test_a_scheduler_without_a_mode_judges_as_the_search(trial_script, tmp_path):
    # score = x * step; with mode "min" each trial here beats those before.
    results = tune.run(trial_script, {"x": tune.grid([4.0, 3.0, 2.0, 1.0])},
                       metric="score", mode="min", max_concurrent=1,
                       scheduler=tune.ASHA(min_t=1, max_t=9, eta=3), out_dir=str(tmp_path))
    assert [(t.config["x"], t.status, t.last["step"]) for t in results.trials] == [
        (4.0, "completed", 9), (3.0, "completed", 9), (2.0, "completed", 9),
        (1.0, "completed", 9)]
    assert results.best.config["x"] == 1.0


def test_trials_run_in_parallel_up_to_capacity(trial_script, tmp_path):
    barrier = tmp_path / "running"
    barrier.mkdir()
    results = tune.run(trial_script, {"x": tune.grid([1.0, 2.0, 3.0]),
                                      "barrier_dir": str(barrier)},
                       metric="score", max_concurrent=2, out_dir=str(tmp_path / "out"),
                       runner=tune.subprocess_runner)
    assert [t.status for t in results.trials] == ["completed"] * 3
    running = [t.last["running"] for t in results.trials]
    assert running[:2] == [2.0, 2.0] and max(running) <= 2


# ---- trials as jobs

def _cores():
    from deepnex import gpu
    return gpu.local_node().cpus


def test_job_runner_runs_trials_up_to_the_machines_cores(trial_script, tmp_path):
    """The default runner: each trial a job of one 1-core worker; as many
    at once as the machine has cores, the rest wait for a finished one."""
    cores = _cores()
    barrier = tmp_path / "running"
    barrier.mkdir()
    # Trials 0 and 1 wait (up to 30 s) for each other, so where two fit
    # they overlap; the third waits for a core.
    results = tune.run(trial_script, {"x": tune.grid([1.0, 2.0, 3.0]),
                                      "barrier_dir": str(barrier)},
                       metric="score", out_dir=str(tmp_path / "out"))
    assert [t.status for t in results.trials] == ["completed"] * 3
    running = [t.last["running"] for t in results.trials]
    assert max(running) <= min(cores, 3)
    if cores >= 2:
        assert running[:2] == [2.0, 2.0]


def test_job_runner_waits_for_cores_and_refuses_what_never_fits(trial_script, tmp_path):
    cores = _cores()
    barrier = tmp_path / "running"
    barrier.mkdir()
    # Each trial takes every core: they run one at a time instead of failing
    # (each waits 2 s for a peer that does not come).
    results = tune.run(trial_script, {"x": tune.grid([1.0, 2.0]), "barrier_dir": str(barrier),
                                      "barrier_wait": 2.0},
                       metric="score", out_dir=str(tmp_path / "a"),
                       runner=tune.job_runner(workers=1, cpus=cores))
    assert [t.status for t in results.trials] == ["completed"] * 2
    assert [t.last["running"] for t in results.trials] == [1.0, 1.0]
    # A trial that could never fit fails the search before it starts, as
    # bad job options do, rather than each of its trials.
    with pytest.raises(ResourceExhaustedError,
                       match=f"^a trial needs {cores + 1} cores and 0 GPUs; "
                             f"this machine has {cores} cores and "):
        tune.job_runner(workers=1, cpus=cores + 1)
    for options, message in [({"workers": 0}, "workers: 0 is below 1"),
                             ({"cpus": -1}, "cpus: -1 is not a finite number >= 0"),
                             ({"mode": "sync", "ps": -3}, "ps: -3 is below 0"),
                             # A ValueError and an OverflowError from math.ceil.
                             ({"cpus": math.nan}, "cpus: nan is not a finite number >= 0"),
                             ({"cpus": math.inf}, "cpus: inf is not a finite number >= 0")]:
        with pytest.raises(InvalidArgumentError, match=f"^{message}$"):
            tune.job_runner(**options)


def _run_within(timeout, **kwargs):
    """tune.run(**kwargs)'s results; fails if it has not ended in `timeout` s."""
    out = {}
    t = threading.Thread(target=lambda: out.update(results=tune.run(**kwargs)), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"tune.run did not end in {timeout} s"
    return out["results"]


def test_job_runner_on_central_fails_what_no_node_could_hold_and_waits_out_a_quota(
        trial_script, tmp_path):
    """A new user's trials asking more GPUs than any of central's nodes has,
    or than the user's whole quota, fail at once, saying so, instead of
    retrying for ever; trials refused by the user's quota, which the
    search's own trials fill, start in turn."""
    import socket
    from _central import start_central, stop_central
    from deepnex import gpu
    proc, address = start_central(tmp_path, cpus=8, memory="16GiB", node=socket.gethostname())

    def statuses(within, name, **runner):
        """The statuses of two trials run by a job_runner on central."""
        results = _run_within(within, command=trial_script, space={"x": tune.grid([1.0, 2.0])},
                              metric="score", out_dir=str(tmp_path / name),
                              runner=tune.job_runner(workers=1, central=address,
                                                     central_token="alicetok", memory="64MiB",
                                                     **runner))
        return [t.status for t in results.trials]

    try:
        assert statuses(60, "never", gpus_per_worker=4) == [
            "failed (no node can ever hold this request (alice asks 4 exclusive GPUs, 1 cpus, "
            "64MiB memory per part): 1 node(s) match, none has 4 GPUs (the most on one: "
            "2))"] * 2
        # One trial's GPU at a time: the other's start is refused (quota),
        # retried, and runs once the first has ended.
        gpu.CentralClient(address, token="admintok", timeout=10).set_quota("alice", gpus=1)
        assert statuses(120, "quota", gpus_per_worker=1, retry_interval=0.1) == ["completed"] * 2
        # More GPUs than the whole quota: no trial's end would ever let one in.
        assert statuses(60, "over", gpus_per_worker=2) == [
            "failed (quota of alice: gpus 0 in use + 2 requested > quota 1 (the request alone "
            "is over the quota: no grant can ever hold this request until the quota is "
            "raised))"] * 2
    finally:
        stop_central(proc)


def _central_with_one_free_gpu(tmp_path):
    """deepnex-central of one node (this host, 2 GPUs), bob holding one GPU
    of it: (its process, its address)."""
    import socket
    from _central import start_central
    from deepnex import gpu
    proc, address = start_central(tmp_path, cpus=8, memory="16GiB", node=socket.gethostname())
    bob = gpu.CentralClient(address, token="bobtok", timeout=10)
    bob.allocate(gpu.Request(user="bob", gpus=1, cpus=1, memory="64MiB"))
    return proc, address


def test_warm_trials_on_central_take_an_idle_slot_rather_than_wait_in_its_queue(
        trial_script, tmp_path):
    """Two warm trials at once on central's one free GPU: the second's new
    slot waits in central's queue. The first's slot, idle once its trial
    ended, held that GPU until the search's end, which waited for the
    second trial: the search never ended. Now the waiting trial takes the
    idle slot."""
    from _central import stop_central
    proc, address = _central_with_one_free_gpu(tmp_path)
    try:
        results = _run_within(120, command=trial_script, space={"x": tune.grid([1.0, 2.0, 3.0])},
                              metric="score", out_dir=str(tmp_path / "out"), max_concurrent=2,
                              out=io.StringIO(),
                              runner=tune.job_runner(central=address, central_token="alicetok",
                                                     memory="64MiB", gpus_per_worker=1))
        assert [t.status for t in results.trials] == ["completed"] * 3
    finally:
        stop_central(proc)


@pytest.mark.parametrize("warm", [True, False])
def test_sigint_ends_a_search_whose_trials_wait_in_centrals_queue(trial_script, tmp_path,
                                                                   warm):
    """Ctrl-C of a search whose trials' jobs wait in central's queue (the
    GPU they need is another user's): the search ends at once, the trials
    not started and their requests withdrawn. Their starts waited on and
    the search with them, until central granted them."""
    from _central import stop_central
    from deepnex import gpu
    proc, address = _central_with_one_free_gpu(tmp_path)
    alice = gpu.CentralClient(address, token="alicetok", timeout=10)
    try:
        alice.allocate(gpu.Request(user="alice", gpus=1, cpus=1, memory="64MiB"))
        ended = threading.Event()

        def interrupt():
            _wait_for(lambda: alice.pending(), "the trials to queue")
            os.kill(os.getpid(), signal.SIGINT)
            # A second SIGINT stops the search's wait for its trials, so
            # that one that still waits fails rather than hangs.
            if not ended.wait(30):
                os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=interrupt, daemon=True).start()
        started = time.monotonic()
        try:
            with pytest.raises(tune.Interrupted) as info:
                tune.run(trial_script, {"x": tune.grid([1.0, 2.0])}, metric="score",
                         out_dir=str(tmp_path / "out"), out=io.StringIO(), warm=warm,
                         runner=tune.job_runner(central=address, central_token="alicetok",
                                                memory="64MiB", gpus_per_worker=1))
        finally:
            ended.set()
        assert time.monotonic() - started < 30
        assert [t.status for t in info.value.results.trials] == ["not started"] * 2
        _wait_for(lambda: not alice.pending(), "the trials' requests to be withdrawn")
    finally:
        stop_central(proc)


def test_a_trial_whose_job_name_central_has_already_takes_another(trial_script, tmp_path,
                                                                   monkeypatch):
    """Job names are central-wide (another user's, ended, too) and a
    trial's job is named trial-ID-<6 hex digits>: a trial that drew the name
    of one that bob ran failed ("job ... exists"). It now takes another."""
    import secrets
    import socket
    from _central import start_central, stop_central
    from deepnex import job
    proc, address = start_central(tmp_path, cpus=8, memory="16GiB", node=socket.gethostname())
    try:
        # One path (a cold trial's job; a warm one's slot is named and
        # retried the same way): each job on central here is one more
        # exposure to the store's rare bad_weak_ptr in Job.wait.
        job.Job(["true"], name="trial-0-aaaaaa", central=address, central_token="bobtok",
                memory="64MiB", output=lambda who, line: None,
                on_event=lambda message: None).start().wait()
        real = secrets.token_hex
        drawn = []

        def token_hex(n=None):
            drawn.append(n)
            return "aaaaaa" if n == 3 and drawn.count(3) == 1 else real(n)
        monkeypatch.setattr(secrets, "token_hex", token_hex)
        results = _run_within(60, command=trial_script, space={"x": tune.grid([1.0])},
                              metric="score", out_dir=str(tmp_path / "out"), out=io.StringIO(),
                              warm=False,
                              runner=tune.job_runner(central=address, central_token="alicetok",
                                                     memory="64MiB"))
        assert [t.status for t in results.trials] == ["completed"]
        assert drawn.count(3) == 2
    finally:
        stop_central(proc)


def test_resume_cancels_the_jobs_that_a_killed_search_left_on_central(tmp_path):
    """A search killed (SIGKILL) while its trial's job held alice's whole
    GPU quota on central: its resume waited for that allocation, which
    central holds for a lost runner for 11 minutes (its runner timeout,
    then --job-lost-release-after). The resume now cancels the jobs the
    journal names that central still runs, and its trials start at once."""
    import socket
    from _central import start_central, stop_central
    from deepnex import gpu
    proc, address = start_central(tmp_path, cpus=8, memory="16GiB", node=socket.gethostname())
    script, slow = tmp_path / "trial.py", tmp_path / "slow"
    script.write_text(textwrap.dedent(f"""
        import os, time
        from deepnex import tune
        tune.report(step=1, score=1.0)
        while os.path.exists({str(slow)!r}):
            time.sleep(0.1)
    """))
    slow.touch()
    out = tmp_path / "out"
    env = dict(os.environ, DEEPNEX_TOKEN="alicetok")
    try:
        gpu.CentralClient(address, token="admintok", timeout=10).set_quota("alice", gpus=1)
        driver = subprocess.Popen(
            [sys.executable, "-m", "deepnex", "tune", "--central", address, "--memory", "64MiB",
             "--gpus-per-worker", "1", "--search", "random", "--samples", "2", "--metric",
             "score", "--no-asha", "--space", "x=uniform(0, 1)", "--out", str(out), "--",
             sys.executable, str(script)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for(lambda: '"report"' in _read_or_empty(out / "journal.jsonl"),
                      "trial 0 to report")
        finally:
            driver.kill()
            driver.wait()
        slow.unlink()
        resumed = subprocess.run([sys.executable, "-m", "deepnex", "tune", "--resume", str(out)],
                                 env=env, capture_output=True, text=True, timeout=60)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert "tune: cancelled 1 job(s) on central that the search's last run left: " \
            in resumed.stdout
        assert [t.status for t in tune.load(str(out)).trials] == ["completed"] * 2
    finally:
        stop_central(proc)


def _read_or_empty(path):
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def test_job_runner_exit_code_stop_and_worker_prefix(trial_script, tmp_path):
    results = tune.run(trial_script, {"x": tune.grid([4.0, 3.0, 2.0]), "fail_at": 2.0},
                       metric="score", max_concurrent=1,
                       scheduler=tune.ASHA(metric="score", min_t=1, max_t=9, eta=3),
                       out_dir=str(tmp_path), runner=tune.job_runner(workers=1))
    assert [(t.status, t.last.get("step")) for t in results.trials] == [
        ("completed", 9), ("stopped", 1), ("failed (exit 3)", None)]
    assert "[worker 0] told to stop at 1" in (tmp_path / "trial_1.log").read_text()


HANG = textwrap.dedent("""
    import time
    from deepnex import tune
    tune.report(step=1, score=1.0)
    time.sleep(600)
""")


class StopAll:
    """A scheduler that stops every trial at its first report."""

    def on_result(self, trial, t, value):
        return "stop"


def test_job_runner_kills_a_trial_that_ignores_stop(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    start = time.monotonic()
    results = tune.run([sys.executable, str(script)], {"x": 1.0}, metric="score",
                       stop_grace=1.0, scheduler=StopAll(), out_dir=str(tmp_path),
                       runner=tune.job_runner())
    assert time.monotonic() - start < 60
    trial = results.trials[0]
    assert (trial.status, trial.exit_code) == ("stopped", -signal.SIGTERM)


def _processes_with(marker):
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            pass
    return pids


def test_ctrl_c_ends_the_running_trial_jobs(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    marker = f"TUNE_TEST_MARK=m{os.getpid()}x{time.monotonic_ns()}"
    driver = (f"import sys; from deepnex import tune; "
              f"tune.run([sys.executable, {str(script)!r}], {{'x': 1.0}}, metric='score', "
              f"out_dir={str(tmp_path)!r})")
    env = dict(os.environ, **dict([marker.split("=", 1)]))
    p = subprocess.Popen([sys.executable, "-c", driver], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        for line in p.stdout:
            if line.startswith("trial 0 running"):
                break
        trial_pids = [q for q in _processes_with(marker) if q != p.pid]
        assert trial_pids, "the trial's worker should be running"
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) != 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    wait_for(lambda: _processes_with(marker) == [],
             lambda: f"the trial's processes to end, left: {_processes_with(marker)}")


def _wait_for(condition, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _processes_running(needle):
    """Pids whose command line contains `needle` (zombies excluded)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle.encode() in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


# A stand-in trial's start: its --x, the directory of its --marks, its id.
MARKS_PREAMBLE = textwrap.dedent("""
    import argparse, os, signal, time
    from deepnex import tune
    ap = argparse.ArgumentParser()
    ap.add_argument("--x", type=float)
    ap.add_argument("--marks")
    args = ap.parse_args()
    trial = os.environ["DEEPNEX_TUNE_TRIAL"]
""")

MARKED = MARKS_PREAMBLE + textwrap.dedent("""
    if args.x >= 3:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # only SIGKILL ends it
    steps = 2 if args.x == 1 else 10 ** 6
    for step in range(1, steps + 1):
        tune.report(step=step, score=args.x * step)
        open(os.path.join(args.marks, f"reported-{trial}"), "a").close()
        time.sleep(0.05 if args.x == 1 else 0.2)
""")


def _spawn_on_a_terminal(argv, env):
    """argv in a session of its own whose controlling terminal is a new
    pty; returns (process, master fd, output chunks read by a thread)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))

    def controlling_terminal():
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    p = subprocess.Popen(argv, env=env, stdin=slave, stdout=slave, stderr=slave,
                         start_new_session=True, preexec_fn=controlling_terminal)
    os.close(slave)
    chunks = []

    def drain():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:   # EIO: every holder of the slave has closed it
                return
            if not data:
                return
            chunks.append(data)
    threading.Thread(target=drain, daemon=True).start()
    return p, master, chunks


@pytest.mark.parametrize("how, code", [("ctrl-c", 130), ("sigterm", 143)])
def test_interrupt_stops_the_search_cleanly(tmp_path, how, code):
    """deepnex tune on a terminal, 4 slow trials, 2 at a time; once trial 0
    has finished and trials 1 and 2 run: Ctrl-C (typed at the terminal) or
    SIGTERM. Trial 2 ignores SIGTERM, so only the grace period's SIGKILL
    ends it."""
    script = tmp_path / "marked_trial.py"
    script.write_text(MARKED)
    marks, out, run_dir = tmp_path / "marks", tmp_path / "out", tmp_path / "run"
    marks.mkdir()
    env = dict(os.environ, DEEPNEX_RUN_DIR=str(run_dir))
    argv = [sys.executable, "-m", "deepnex", "tune", "--space", "x=grid([1.0, 2.0, 3.0, 4.0])",
            "--space", f"marks={str(marks)!r}", "--samples", "1", "--metric", "score",
            "--no-asha", "--max-concurrent", "2", "--out", str(out), "--", sys.executable,
            str(script)]
    p, master, chunks = _spawn_on_a_terminal(argv, env)
    try:
        _wait_for(lambda: (marks / "reported-1").exists() and (marks / "reported-2").exists()
                  or p.poll() is not None, "trials 1 and 2 to report")
        assert p.poll() is None, b"".join(chunks).decode(errors="replace")
        if how == "ctrl-c":
            os.write(master, b"\x03")   # the terminal sends SIGINT to its foreground group
        else:
            p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == code
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
    printed = b"".join(chunks).decode(errors="replace")
    name = "SIGINT" if how == "ctrl-c" else "SIGTERM"
    assert "Traceback" not in printed, printed
    assert f"tune: {name}: stopping 2 running trials; 1 not started" in printed, printed
    assert f"tune: interrupted by {name}: 1 of 4 trials finished" in printed, printed
    with open(out / "results.csv") as f:
        rows = [(r["trial"], r["status"], r["x"]) for r in csv.DictReader(f)]
    assert rows == [("0", "completed", "1"), ("1", "interrupted", "2"),
                    ("2", "interrupted", "3")]
    best = json.loads((out / "best.json").read_text())
    assert (best["trial"], best["result"]) == (0, {"step": 2, "score": 2.0})
    # The trials' job directories went with their jobs, and no trial
    # process outlives the grace period.
    assert [d for d in os.listdir(run_dir) if d.startswith("trial-")] == []
    _wait_for(lambda: _processes_running(str(script)) == [], "the trial processes to end",
              timeout=15)


def test_a_signal_during_a_report_ends_the_trial_interrupted_not_stopped(tmp_path, monkeypatch):
    """The signal lands after a trial's thread checked for one and before it
    answers the report it was reading: the trial still ends "interrupted"
    (not finished), never "stopped" as if the scheduler had stopped it."""
    from deepnex import collective
    script = tmp_path / "trial.py"
    script.write_text(SLEEPER)
    searches = []
    real_init = tune._Search.__init__

    def remember(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        searches.append(self)

    class SignalledWhileReading(collective.StoreClient):
        def get(self, key, *args, **kwargs):
            value = super().get(key, *args, **kwargs)
            searches[0].interrupt(signal.SIGINT)
            return value

    monkeypatch.setattr(tune._Search, "__init__", remember)
    monkeypatch.setattr(collective, "StoreClient", SignalledWhileReading)
    with pytest.raises(tune.Interrupted) as e:
        tune.run([sys.executable, str(script), "--marks", str(tmp_path)],
                 {"x": tune.grid([1.0])}, metric="score", out_dir=str(tmp_path / "out"),
                 runner=tune.subprocess_runner, stop_grace=2.0, out=io.StringIO())
    assert [t.status for t in e.value.results.trials] == ["interrupted"]
    assert "0 of 1 trials finished" in str(e.value)


SLEEPER = textwrap.dedent("""
    import argparse, os, time
    from deepnex import tune
    ap = argparse.ArgumentParser()
    ap.add_argument("--x", type=float)
    ap.add_argument("--marks")
    args = ap.parse_args()
    tune.report(step=1, score=args.x)
    open(os.path.join(args.marks, os.environ["DEEPNEX_TUNE_TRIAL"]), "w").close()
    time.sleep(600)
""")


def test_sigint_cancels_the_start_of_a_trial_waiting_for_cores(tmp_path, monkeypatch):
    """In-process tune.run: trial 0 takes every core, trial 1 waits for
    them; SIGINT ends trial 0 and cancels trial 1's wait, and run() raises
    Interrupted after writing the results."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    marks, run_dir = tmp_path / "marks", tmp_path / "run"
    marks.mkdir()
    monkeypatch.setenv("DEEPNEX_RUN_DIR", str(run_dir))
    handler = signal.getsignal(signal.SIGINT)

    def interrupt():
        _wait_for(lambda: (marks / "0").exists(), "trial 0 to report")
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    out = io.StringIO()
    with pytest.raises(tune.Interrupted) as info:
        tune.run([sys.executable, str(script)], {"x": tune.grid([1.0, 2.0]),
                                                 "marks": str(marks)},
                 metric="score", out_dir=str(tmp_path / "out"), out=out,
                 runner=tune.job_runner(cpus=_cores()))
    assert (info.value.signal, info.value.exit_code) == (signal.SIGINT, 130)
    results = info.value.results
    assert [t.status for t in results.trials] == ["interrupted", "not started"]
    assert (results.interrupted, results.best) == ("SIGINT", None)
    with open(tmp_path / "out" / "results.csv") as f:
        assert [(r["trial"], r["status"]) for r in csv.DictReader(f)] == [("0", "interrupted")]
    assert not (tmp_path / "out" / "best.json").exists()
    assert [d for d in os.listdir(run_dir) if d.startswith("trial-")] == []
    assert "tune: SIGINT: stopping 1 running trial; 1 not started" in out.getvalue()
    # The search's handler is gone with it.
    assert signal.getsignal(signal.SIGINT) is handler


REPORTS_200 = textwrap.dedent("""
    import os, sys, time
    from deepnex import tune
    flag = sys.argv[sys.argv.index("--flag") + 1] if "--flag" in sys.argv else None
    for step in range(1, 201):
        tune.report(step=step, score=float(step))
        if flag and step == 1:
            # Until the terminal has shown this trial running.
            deadline = time.monotonic() + 60
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.01)
""")


# How a search that was given no search method says which it uses.
_DEFAULT_SEARCH = ("search tpe (the default)" if tune.default_search() == "tpe"
                   else "search random (the default: Optuna is not importable)")


def test_status_off_a_terminal_is_a_line_per_state_change(tmp_path):
    script = tmp_path / "reports.py"
    script.write_text(REPORTS_200)
    out = io.StringIO()
    tune.run([sys.executable, str(script)], {"x": 1.0}, metric="score",
             out_dir=str(tmp_path), runner=tune.subprocess_runner, out=out)
    assert out.getvalue().splitlines() == [
        f"tune: 1 trials, {os.cpu_count()} at a time, metric score (max), {_DEFAULT_SEARCH}",
        "trial 0 running: x=1",
        "trial 0 completed at step 200: score=200",
        "",
        "trial  status     steps  x  score",
        "0      completed  200    1  200",
        "",
        "best: trial 0 score=200.0000 config: x=1",
        f"results: {tmp_path}/results.csv"]


class _Terminal(io.StringIO):
    """An output that says it is a terminal; creates `flag` once a table
    showing a trial running has been drawn."""

    def __init__(self, flag):
        super().__init__()
        self.flag = flag

    def isatty(self):
        return True

    def write(self, text):
        if "\n0      running" in text:
            open(self.flag, "w").close()
        return super().write(text)


def test_status_on_a_terminal_is_a_table_redrawn_in_place(tmp_path):
    script = tmp_path / "reports.py"
    script.write_text(REPORTS_200)
    flag = tmp_path / "shown"
    out = _Terminal(flag)
    tune.run([sys.executable, str(script)], {"flag": str(flag)}, metric="score",
             out_dir=str(tmp_path / "out"), runner=tune.subprocess_runner, out=out)
    text = out.getvalue()
    assert flag.exists()
    assert text.startswith(f"tune: 1 trials, {os.cpu_count()} at a time, metric score (max), "
                           f"{_DEFAULT_SEARCH}\n"
                           "tune: 1 running\ntrial  state    step  score  parameters\n"
                           "0      running  ")
    # Each redraw and the end take the table off the screen (cursor up to its
    # first line, clear below); what stays is the results table.
    frames = text.split("\x1b[3F\x1b[J")
    assert len(frames) >= 2
    assert frames[-1].splitlines()[:3] == ["", "trial  status     steps  flag" + " " * (
        len(str(flag)) - 4) + "  score", f"0      completed  200    {flag}  200"]


KEEPS_REPORTING = textwrap.dedent("""
    import sys
    from deepnex import tune
    print("reporting", flush=True)
    step = 0
    while True:
        step += 1
        tune.report(step=step, score=1.0)
""")


def test_report_fails_within_5s_once_the_search_is_gone(tmp_path):
    from deepnex.collective import Store, StoreClient
    script = tmp_path / "keeps_reporting.py"
    script.write_text(KEEPS_REPORTING)
    store = Store("127.0.0.1:0")
    env = dict(os.environ, DEEPNEX_TUNE_STORE=store.address, DEEPNEX_TUNE_TRIAL="0",
               DEEPNEX_TUNE_CONFIG="{}")

    def start():
        p = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "reporting\n"
        return p

    def ends_within_5s(p):
        gone = time.monotonic()
        try:
            p.wait(timeout=20)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        took = time.monotonic() - gone
        err = p.stderr.read()
        assert p.returncode == 1, err
        assert took < 5.0, took
        return err

    # The search goes while the trial waits for the answer to a report.
    p = start()
    client = StoreClient(store.address, prefix="tune/0/0")   # trial 0, attempt 0
    for k in range(3):
        record = json.loads(client.get(f"report/{k}", timeout=60))
        client.set(f"decision/{record['step']}", "continue")
    client.get("report/3", timeout=60)
    store.stop()
    err = ends_within_5s(p)
    assert (f"tune.report(step=4): the search at {store.address} that runs trial 0 "
            "does not answer") in err, err
    # The search is gone before the trial's first report.
    err = ends_within_5s(start())
    assert (f"tune.report(step=1): the search at {store.address} that runs trial 0 "
            "does not answer") in err, err


def test_import_deepnex_makes_tune_available_without_torch():
    code = ("import sys, deepnex; assert callable(deepnex.tune.run); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr


def test_report_outside_a_search_is_a_no_op(monkeypatch):
    monkeypatch.delenv("DEEPNEX_TUNE_STORE", raising=False)
    assert tune.report(step=1, accuracy=0.5) is False
    assert tune.get_config() == {}


def test_cli_parses_a_search(tmp_path, trial_script):
    from deepnex.__main__ import main
    code = main(["tune", "--space", "x=grid([1.0, 2.0])", "--samples", "1", "--metric", "score",
                 "--no-asha", "--out", str(tmp_path / "cli"), "--", *trial_script])
    assert code == 0
    with open(tmp_path / "cli" / "results.csv") as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["completed", "completed"]


def test_a_resume_warns_of_old_spellings_typed_now_only(tmp_path, trial_script, capsys):
    """It warned of the recorded --mode min on every resume, typed or not
    (probe)."""
    from deepnex.__main__ import main
    out = str(tmp_path / "old")
    assert main(["tune", "--space", "x=grid([1.0])", "--samples", "1", "--metric", "score",
                 "--mode", "min", "--no-asha", "--plain", "--out", out,
                 "--", *trial_script]) == 0
    warning = ("deepnex tune: --mode min is deprecated for the metric's direction: use "
               "--direction min (--mode is now the trials' training mode)\n")
    assert capsys.readouterr().err == warning
    assert main(["tune", "--resume", out]) == 0
    assert capsys.readouterr().err == ""
    assert main(["tune", "--resume", out, "--mode", "min"]) == 0
    assert capsys.readouterr().err == warning


def _tune_cli(monkeypatch, argv):
    """Runs `deepnex tune argv -- true` with tune.run and tune.job_runner
    replaced; returns (code, run's kwargs, job_runner's kwargs)."""
    from deepnex.__main__ import main
    seen = {}

    def fake_runner(**kwargs):
        seen["job_runner"] = kwargs
        return "runner"

    def fake_run(command, space, **kwargs):
        seen["run"] = kwargs
        return tune.Results([], kwargs["metric"], kwargs["mode"], "x.csv")
    monkeypatch.setattr(tune, "job_runner", fake_runner)
    monkeypatch.setattr(tune, "run", fake_run)
    code = main(["tune", "--space", "x=1", *argv, "--", "true"])
    return code, seen.get("run"), seen.get("job_runner")


def test_cli_mode_is_the_training_mode_and_direction_the_metrics(monkeypatch, capsys):
    code, run, runner = _tune_cli(monkeypatch, ["--mode", "ssp:2", "--direction", "min"])
    assert (code, run["mode"], runner["mode"]) == (1, "min", "ssp:2")
    assert capsys.readouterr().err == ""
    _, run, runner = _tune_cli(monkeypatch, [])
    assert (run["mode"], runner["mode"]) == ("max", "allreduce")
    # The old spellings still work, with a one-line warning each.
    _, run, runner = _tune_cli(monkeypatch, ["--mode", "min"])
    assert (run["mode"], runner["mode"]) == ("min", "allreduce")
    assert capsys.readouterr().err == (
        "deepnex tune: --mode min is deprecated for the metric's direction: use --direction "
        "min (--mode is now the trials' training mode)\n")
    _, run, runner = _tune_cli(monkeypatch, ["--job-mode", "async"])
    assert (run["mode"], runner["mode"]) == ("max", "async")
    assert capsys.readouterr().err == "deepnex tune: --job-mode is deprecated: use --mode async\n"
    for argv, message in [
            (["--mode", "max", "--direction", "min"],
             "deepnex tune: --mode max and --direction min disagree"),
            (["--mode", "sync", "--job-mode", "async"],
             "deepnex tune: --mode sync and --job-mode async disagree"),
            (["--token", "t", "--token-file", "f"],
             "deepnex tune: --token and --token-file f were both given; give one")]:
        with pytest.raises(SystemExit) as info:
            _tune_cli(monkeypatch, argv)
        assert str(info.value) == message
    from deepnex.__main__ import main
    monkeypatch.undo()   # the real job_runner checks the mode
    with pytest.raises(SystemExit) as info:
        main(["tune", "--mode", "fast", "--", "true"])
    assert str(info.value) == ('deepnex tune: mode: "fast" is not sync, ssp:S (S >= 0), async '
                               'or allreduce')


def test_cli_token_or_token_file_for_central(monkeypatch, tmp_path):
    monkeypatch.delenv("DEEPNEX_TOKEN", raising=False)
    _, _, runner = _tune_cli(monkeypatch, ["--central", "h:1", "--token-file", "tok"])
    assert (runner["central"], runner["central_token_file"]) == ("h:1", "tok")
    assert "central_token" not in runner
    _, _, runner = _tune_cli(monkeypatch, ["--central", "h:1", "--token", "s3cret"])
    assert (runner["central_token"], "central_token_file" in runner) == ("s3cret", False)
    monkeypatch.setenv("DEEPNEX_TOKEN", "from-env")
    _, _, runner = _tune_cli(monkeypatch, ["--central", "h:1"])
    assert runner["central_token"] == "from-env"


def test_cli_central_from_env_unless_the_flag_is_given(monkeypatch):
    monkeypatch.setenv("DEEPNEX_CENTRAL", "env-host:7")
    monkeypatch.setenv("DEEPNEX_TOKEN", "env-token")
    _, _, runner = _tune_cli(monkeypatch, [])
    assert (runner["central"], runner["central_token"]) == ("env-host:7", "env-token")
    _, _, runner = _tune_cli(monkeypatch, ["--central", "h:1", "--token-file", "tok"])
    assert (runner["central"], runner["central_token_file"]) == ("h:1", "tok")
    assert "central_token" not in runner
    monkeypatch.delenv("DEEPNEX_CENTRAL")
    _, _, runner = _tune_cli(monkeypatch, [])
    assert "central" not in runner and "central_token" not in runner


def test_every_tune_flag_has_help():
    from deepnex.__main__ import build_parser
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    parser = commands.choices["tune"]
    assert [a.option_strings or a.dest for a in parser._actions if not a.help] == []
    assert "deprecated" in next(a.help for a in parser._actions
                                if "--job-mode" in a.option_strings)


# ---- digits

def test_cli_trials_as_two_worker_ps_jobs(tmp_path):
    """deepnex tune --workers-per-trial 2 --mode sync: each trial a job
    with a parameter server that applies the configuration's lr."""
    pytest.importorskip("sklearn")
    from deepnex import job
    if job._ps_binary() is None:
        pytest.skip("deepnex-ps not found (set DEEPNEX_BUILD_DIR)")
    if _cores() < 2:
        pytest.skip("a 2-worker trial needs 2 cores")
    from deepnex.__main__ import main
    script = os.path.join(ROOT, "examples", "digits", "mlp_numpy.py")
    out = tmp_path / "ps"
    code = main(["tune", "--space", "lr=grid([0.2])", "--space", "momentum=0.9",
                 "--samples", "1", "--workers-per-trial", "2", "--mode", "sync",
                 "--cpus", "0", "--out", str(out), "--", sys.executable, script, "--epochs", "4"])
    assert code == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["status"], r["steps"]) for r in rows] == [("completed", "4")]
    assert float(rows[0]["accuracy"]) >= 0.9
    log = (out / "trial_0.log").read_text()
    assert "mode sync, 2 workers, sgd(lr=0.2, momentum=0.9" in log, log
    assert "summary: digits mlp_numpy mode=ps workers=2 epochs=4" in log, log


def test_search_on_digits_reaches_095(tmp_path):
    pytest.importorskip("sklearn")
    script = os.path.join(ROOT, "examples", "digits", "mlp_numpy.py")
    results = tune.run(
        [sys.executable, script, "--mode", "allreduce", "--workers", "1", "--epochs", "8"],
        {"lr": tune.loguniform(0.03, 0.3), "hidden": tune.choice([32, 64, 128])},
        metric="accuracy", num_samples=4, max_concurrent=2, seed=0,
        scheduler=tune.ASHA(min_t=2, max_t=8, eta=2), out_dir=str(tmp_path))
    best = results.best
    assert best is not None and best.last["accuracy"] >= 0.95, [t.last for t in results.trials]


# ---- checks that save a user's budget

def test_parameters_pass_at_full_precision(trial_script, tmp_path):
    assert tune._config_args({"lr": 0.12345678901234, "n": 3}) == [
        "--lr", "0.12345678901234", "--n", "3"]
    # The trial script asserts that its --x is get_config()'s x exactly.
    results = tune.run(trial_script, {"x": 1 / 3}, metric="score", out_dir=str(tmp_path),
                       runner=tune.subprocess_runner, out=io.StringIO())
    assert results.trials[0].status == "completed"
    assert results.trials[0].last["score"] == 9 * (1 / 3)


SCORES = textwrap.dedent("""
    import argparse, math, sys
    from deepnex import tune
    ap = argparse.ArgumentParser()
    ap.add_argument("--x", type=float)
    args = ap.parse_args()
    for step in range(1, 4):
        if tune.report(step=step, score=float(args.x) * step):
            break
""")


def test_a_nan_or_infinite_metric_fails_the_trial_and_is_never_best(tmp_path):
    script = tmp_path / "scores.py"
    script.write_text(SCORES)
    out = io.StringIO()
    results = tune.run([sys.executable, str(script)],
                       {"x": tune.grid([1.0, float("nan"), float("inf"), 2.0])},
                       metric="score", max_concurrent=1, search="random",
                       scheduler=tune.ASHA(metric="score", min_t=1, max_t=3, eta=3),
                       out_dir=str(tmp_path / "out"), runner=tune.subprocess_runner, out=out)
    assert [(t.status, t.last.get("step")) for t in results.trials] == [
        ("completed", 3), ("failed (score=nan)", 1), ("failed (score=inf)", 1),
        ("completed", 3)]
    assert results.best.id == 3
    # A NaN or inf would be the best of every comparison; only the finite count.
    assert tune.Results([results.trials[1]], "score", "max", "x.csv").best is None


BAD_STEP = textwrap.dedent("""
    import json, os, time
    from deepnex import tune
    from deepnex.collective import StoreClient
    from deepnex.errors import InvalidArgumentError
    try:
        tune.report(step="1", score=1.0)
    except InvalidArgumentError as e:
        print(e, flush=True)
    # Past report(): a step the scheduler cannot compare.
    trial = os.environ["DEEPNEX_TUNE_TRIAL"]
    StoreClient(os.environ["DEEPNEX_TUNE_STORE"], prefix=f"tune/{trial}/0",
                token=os.environ["DEEPNEX_TUNE_STORE_TOKEN"]).set(
        "report/0", json.dumps({"step": "1", "score": 1.0}))
    time.sleep(600)
""")


def test_a_report_whose_step_is_no_integer_fails_its_trial_and_is_journalled(tmp_path):
    """A string step crashed the trial's thread in the search: the trial
    ran on unwaited, and its journal had no end, so a resume ran it again."""
    script = tmp_path / "bad_step.py"
    script.write_text(BAD_STEP)
    out = tmp_path / "out"
    results = tune.run([sys.executable, str(script)], {"x": 1.0}, metric="score",
                       scheduler=tune.ASHA(min_t=1, max_t=3, eta=3), out_dir=str(out),
                       runner=tune.subprocess_runner, stop_grace=1.0, out=io.StringIO())
    status = "failed (report 0: step='1' is not an integer)"
    assert [t.status for t in results.trials] == [status]
    assert [t.status for t in tune.load(str(out)).trials] == [status]
    assert (out / "trial_0.log").read_text().startswith(
        "deepnex.report: step='1' is not an integer\n")


def test_a_misspelt_metric_stops_the_search_at_the_first_report(trial_script, tmp_path):
    out = io.StringIO()
    with pytest.raises(FailedPreconditionError) as info:
        tune.run(trial_script, {"x": tune.grid([1.0, 2.0, 3.0])}, metric="acc",
                 max_concurrent=1, scheduler=tune.ASHA(metric="acc", max_t=9),
                 out_dir=str(tmp_path), runner=tune.subprocess_runner, out=out)
    assert str(info.value) == ('metric: trial 0 reported score at step 1, not "acc"; the '
                               'search stopped (pass --metric one of them)')
    results = tune.load(str(tmp_path))
    assert [(t.id, t.status, len(t.results)) for t in results.trials] == [
        (0, "interrupted", 1)]
    with open(tmp_path / "results.csv") as f:
        assert [(r["trial"], r["status"]) for r in csv.DictReader(f)] == [("0", "interrupted")]
    assert "tune: check failed: stopping 1 running trial; 2 not started" in out.getvalue()


def test_the_same_start_up_failure_in_the_first_3_trials_stops_the_search(trial_script,
                                                                          tmp_path, capsys):
    from deepnex.__main__ import main
    with pytest.raises(SystemExit) as info:
        main(["tune", "--space", "x=uniform(0, 1)", "--space", "unknown=1", "--samples", "10",
              "--metric", "score", "--plain", "--max-concurrent", "1", "--search", "random",
              "--out", str(tmp_path), "--", *trial_script])
    message = str(info.value)
    assert message.startswith(
        "deepnex tune: the first 3 trials all failed with exit code 2 before reporting; the "
        f"last lines of {tmp_path}/trial_2.log:\n"), message
    assert message.endswith("error: unrecognized arguments: --unknown 1"), message
    results = tune.load(str(tmp_path))
    assert [t.status for t in results.trials] == ["failed (exit 2)"] * 3


def test_fewer_trials_than_stop_a_search_early_say_why_they_failed(trial_script, tmp_path,
                                                                     capsys):
    """A new user's 2 trials both failed: tune printed "no finished trial
    reported" and nothing of why, nor where to look."""
    from deepnex.__main__ import main
    code = main(["tune", "--space", "x=uniform(0, 1)", "--space", "unknown=1", "--samples", "2",
                 "--metric", "score", "--plain", "--max-concurrent", "1", "--search", "random",
                 "--out", str(tmp_path), "--", *trial_script])
    assert code == 1
    out = capsys.readouterr().out
    assert (f"\nno finished trial reported score\n2 trial(s) failed; the last lines of "
            f"{tmp_path}/trial_1.log:\n") in out, out
    assert "  trial.py: error: unrecognized arguments: --unknown 1\nresults: " in out, out


def test_plain_trials_run_at_most_as_many_at_once_as_there_are_cores(
        trial_script, tmp_path, monkeypatch):
    """--plain without --max-concurrent: the local cores (1 here) bound the
    trials at once; trials 0 and 1 would wait 1 s for each other."""
    from deepnex.__main__ import main
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    barrier = tmp_path / "running"
    barrier.mkdir()
    code = main(["tune", "--space", "x=grid([1.0, 2.0, 3.0])", "--space",
                 f"barrier_dir={str(barrier)!r}", "--space", "barrier_wait=1.0", "--samples",
                 "1", "--metric", "score", "--no-asha", "--plain", "--out",
                 str(tmp_path / "out"), "--", *trial_script])
    assert code == 0
    results = tune.load(str(tmp_path / "out"))
    assert [t.last["running"] for t in results.trials] == [1.0, 1.0, 1.0]


def test_cli_errors_are_one_line(tmp_path, capsys):
    from deepnex.__main__ import main
    with pytest.raises(SystemExit) as info:
        main(["tune", "--space", "lr=logunif(1, 2)", "--", "true"])
    assert str(info.value) == (
        'deepnex tune: space: "lr=logunif(1, 2)": unknown function logunif (use a literal, '
        'uniform(a, b), loguniform(a, b), randint(a, b), choice([...]) or grid([...]))')
    with pytest.raises(SystemExit) as info:
        main(["tune", "--space", "lr=uniform(0.1, 1)", "--search", "grid", "--", "true"])
    assert str(info.value) == (
        "deepnex tune: space: lr is uniform(0.1, 1.0), which search grid cannot enumerate "
        "(use grid([...]) or choice([...]), or search random or tpe)")
    with pytest.raises(SystemExit) as info:
        main(["tune", "--space", "x=1", "--workers-per-trial", "0", "--out",
              str(tmp_path / "w"), "--", "true"])
    assert str(info.value) == "deepnex tune: workers: 0 is below 1"
    assert not (tmp_path / "w").exists()
    (tmp_path / "journal.jsonl").write_text("")
    with pytest.raises(SystemExit) as info:
        main(["tune", "--space", "x=1", "--out", str(tmp_path), "--", "true"])
    assert str(info.value) == (
        f"deepnex tune: out_dir: {tmp_path} holds a search already ({tmp_path}/journal.jsonl): "
        f"resume it (deepnex tune --resume {tmp_path}) or choose another out_dir")


def test_cli_asha_is_on_by_default_with_max_t_from_the_commands_epochs(monkeypatch):
    from deepnex.__main__ import main
    seen = {}

    def fake_run(command, space, **kwargs):
        seen.update(kwargs)
        return tune.Results([], kwargs["metric"], kwargs["mode"], "x.csv")
    monkeypatch.setattr(tune, "run", fake_run)
    main(["tune", "--space", "x=1", "--", "python3", "train.py", "--epochs", "12"])
    assert (seen["scheduler"].max_t, seen["scheduler"].rungs) == (12, [1, 3, 9])
    main(["tune", "--space", "x=1", "--", "python3", "train.py", "--epochs=7"])
    assert seen["scheduler"].max_t == 7
    main(["tune", "--space", "x=1", "--max-t", "5", "--", "train", "--epochs", "12"])
    assert seen["scheduler"].max_t == 5
    main(["tune", "--space", "x=1", "--", "train"])
    assert seen["scheduler"].max_t == 100
    main(["tune", "--space", "x=1", "--no-asha", "--", "train"])
    assert seen["scheduler"] is None


def test_the_summary_is_at_most_20_lines(tmp_path):
    trials = [tune.Trial(i, {"x": float(i)}, "completed", [{"step": 3, "score": float(i)}])
              for i in range(60)]
    results = tune.Results(trials, "score", "max", str(tmp_path / "results.csv"))
    out = io.StringIO()
    tune._write_results(results, str(tmp_path), out)
    lines = out.getvalue().splitlines()
    assert len(lines) <= 20, lines
    assert lines[1:4] == ["trial  status     steps  x   score", "50     completed  3      50  50",
                          "51     completed  3      51  51"]
    assert lines[12] == (f"... and 50 more (60 completed in all; every trial in "
                         f"{tmp_path}/results.csv)")
    assert "best: trial 59 score=59.0000 config: x=59" in lines
    with open(tmp_path / "results.csv") as f:
        assert len(list(csv.reader(f))) == 61


# ---- model-based search

def test_tpe_proposes_the_same_configurations_for_the_same_seed():
    pytest.importorskip("optuna")
    space = {"lr": tune.loguniform(1e-3, 1.0), "hidden": tune.choice([16, 32, 64]),
             "layers": tune.randint(1, 4), "fixed": 7, "opt": tune.grid(["sgd", "adam"])}

    def search(seed):
        sampler = tune._Sampler(space, 8, seed, "tpe")
        configs = []
        for i in range(sampler.total):   # one at a time: each told before the next
            config = sampler.config(i)
            configs.append(config)
            trial = tune.Trial(i, config, "completed",
                               [{"step": 1, "score": -abs(math.log10(config["lr"]) + 1)}])
            sampler.tell(trial, "score", 1)
        return configs
    first = search(5)
    assert first == search(5)
    assert first != search(6)
    assert [c["opt"] for c in first] == ["sgd"] * 8 + ["adam"] * 8
    assert all(c["fixed"] == 7 and c["hidden"] in (16, 32, 64) and 1 <= c["layers"] <= 3
               and 1e-3 <= c["lr"] <= 1.0 for c in first)
    # Having learnt that lr near 0.1 scores best, the model proposes more of it.
    late = [abs(math.log10(c["lr"]) + 1) for c in first[10:]]
    early = [abs(math.log10(c["lr"]) + 1) for c in first[:10]]
    assert sum(late) / len(late) < sum(early) / len(early)


def _scripted(i, config):
    """Trial i's reports and its end, on the rules of _tell_pins: (status,
    [(step, value)]) as deepnex records it."""
    v = -abs(math.log10(config["lr"]) + 1) + config["hidden"] / 1000
    if i == 7:
        return "failed (score=nan)", [(1, v), (2, math.nan)]
    kind = ["completed", "stopped", "failed (exit 3)", "completed"][i % 4]
    return kind, [(step, v * step / 3) for step in range(1, {"stopped": 2}.get(kind, 4))]


def _study_record(study):
    # repr: NaN compares equal to NaN.
    return [(t.number, t.state.name, repr(t.values), repr(sorted(t.intermediate_values.items())),
             t.params) for t in study.trials]


def test_tpe_gets_what_optunas_own_tpe_gets_from_the_same_trials():
    """What the sampler is told of each trial, against an Optuna study that
    runs the same trials itself (the benchmark's peer: trial.report() each
    step, TrialPruned when stopped, an exception when failed, a NaN pruned):
    the same states, values and intermediate values, so with the same seed
    and n_startup_trials TPE proposes the same configurations."""
    optuna = pytest.importorskip("optuna")
    space = {"lr": tune.loguniform(1e-3, 1.0), "hidden": tune.choice([16, 32, 64])}
    sampler = tune._Sampler(space, 15, 3, "tpe")
    ours = []
    for i in range(14):
        config = sampler.config(i)
        status, reports = _scripted(i, config)
        trial = tune.Trial(i, config, status, [{"step": s, "score": v} for s, v in reports],
                           nonfinite=status == "failed (score=nan)")
        sampler.tell(trial, "score", 1)
        ours.append(trial)

    peer = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=3))

    def objective(t):
        config = {"lr": t.suggest_float("lr", 1e-3, 1.0, log=True),
                  "hidden": t.suggest_categorical("hidden", [16, 32, 64])}
        status, reports = _scripted(t.number, config)
        for step, value in reports:
            t.report(value, step)
        if status == "stopped" or math.isnan(reports[-1][1]):
            raise optuna.TrialPruned()
        if status.startswith("failed"):
            raise RuntimeError(status)
        return reports[-1][1]
    peer.optimize(objective, n_trials=14, catch=(RuntimeError,))
    assert _study_record(sampler._study) == _study_record(peer)
    # Trials 0-13 cover every end; 10 start-up trials, then TPE's proposals.
    assert [t.state.name for t in peer.trials[:8]] == [
        "COMPLETE", "PRUNED", "FAIL", "COMPLETE", "COMPLETE", "PRUNED", "FAIL", "PRUNED"]
    assert peer.trials[1].values == [peer.trials[1].intermediate_values[1]]
    assert [t.config for t in ours] == [t.params for t in peer.trials]
    assert sampler.config(14) == peer.ask(sampler._dists).params
    # A resumed search tells its sampler the same history.
    again = tune._Sampler(space, 14, 3, "tpe")
    for trial in ours:
        again.tell(trial, "score", 1)
    assert ([r[1:] for r in _study_record(again._study)]
            == [r[1:] for r in _study_record(peer)[:14]])


def test_cmaes_and_grid_searches():
    pytest.importorskip("optuna")
    pytest.importorskip("cmaes")
    sampler = tune._Sampler({"lr": tune.loguniform(1e-3, 1.0), "n": tune.randint(1, 9)}, 12,
                            0, "cmaes")
    for i in range(12):
        config = sampler.config(i)
        assert 1e-3 <= config["lr"] <= 1.0 and 1 <= config["n"] <= 8, config
        sampler.tell(tune.Trial(i, config, "completed", [{"step": 1, "s": config["lr"]}]),
                     "s", 1)
    grid = tune._Sampler({"a": tune.choice([1, 2]), "b": tune.grid(["x", "y"]), "c": 0}, 1, 0,
                         "grid")
    assert [grid.config(i) for i in range(grid.total)] == [
        {"a": 1, "b": "x", "c": 0}, {"a": 1, "b": "y", "c": 0}, {"a": 2, "b": "x", "c": 0},
        {"a": 2, "b": "y", "c": 0}]


def test_search_must_be_known():
    with pytest.raises(InvalidArgumentError) as info:
        tune._Sampler({"x": 1}, 1, 0, "bayes")
    assert str(info.value) == 'search: "bayes" is not one of random, grid, tpe, cmaes'


# ---- journal and resume

def test_journal_drops_a_torn_tail_and_names_the_offset_of_damage(tmp_path):
    from deepnex import _tune_journal
    path = tmp_path / "journal.jsonl"
    path.write_bytes(b'{"event":"search"}\n{"event":"trial","trial":0}\n{"event":"st')
    records, keep = _tune_journal.read(str(path))
    assert (records, keep) == ([{"event": "search"}, {"event": "trial", "trial": 0}], 47)
    journal = _tune_journal.Journal(str(path), resume=True)
    assert journal.records == records
    with pytest.raises(FailedPreconditionError) as info:  # one driver at a time
        _tune_journal.Journal(str(path), resume=True)
    assert str(info.value) == (f"{path}: another driver is running this search (it holds the "
                               "journal's lock); wait for it to end, or stop it, before resuming")
    with pytest.raises(FailedPreconditionError) as info:
        tune.run(["true"], {"x": 1}, out_dir=str(tmp_path), resume=True)
    assert str(info.value).startswith(f"{path}: another driver is running this search")
    journal.append({"event": "start", "trial": 0})
    journal.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[1:3] == [b'{"event":"trial","trial":0}', b'{"event":"start","trial":0,"time":'
                          + lines[2].split(b'"time":')[1]]
    assert lines[3:] == [b""]
    path.write_bytes(b'{"event":"search"}\n{"event":tri\n{"event":"end"}\n')
    with pytest.raises(DataLossError) as info:
        _tune_journal.read(str(path))
    assert str(info.value).startswith(f"{path}: byte offset 19: damaged record")


COUNTED = MARKS_PREAMBLE + textwrap.dedent("""
    open(os.path.join(args.marks, f"started-{trial}"), "a").close()
    for step in range(1, 4):
        tune.report(step=step, score=args.x * step)
        time.sleep(0.1)
    with open(os.path.join(args.marks, "completed"), "a") as f:
        f.write(trial + "\\n")
""")


def test_kill_9_then_resume_runs_each_trial_to_its_end_once(tmp_path):
    script = tmp_path / "counted.py"
    script.write_text(COUNTED)
    marks, out = tmp_path / "marks", tmp_path / "out"
    marks.mkdir()
    argv = [sys.executable, "-m", "deepnex", "tune", "--space", "x=grid([1.0, 2.0, 3.0, 4.0])",
            "--space", f"marks={str(marks)!r}", "--samples", "1", "--metric", "score",
            "--no-asha", "--plain", "--max-concurrent", "1", "--out", str(out), "--",
            sys.executable, str(script)]
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: (marks / "started-2").exists() or p.poll() is not None,
                  "trial 2 to start")
        p.kill()
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    # Trial 2, left without its search, ends in report() (within 5 s).
    _wait_for(lambda: _processes_running(str(script)) == [], "trial 2 to end", timeout=15)
    assert (marks / "completed").read_text().split() == ["0", "1"]
    done = subprocess.run([sys.executable, "-m", "deepnex", "tune", "--resume", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    # Trial 2 starts again; trial 3 is new.
    assert ("tune: 4 trials (2 finished before, 1 to run again), 1 at a time"
            in done.stdout), done.stdout
    assert sorted((marks / "completed").read_text().split()) == ["0", "1", "2", "3"]
    with open(out / "results.csv") as f:
        assert [(r["trial"], r["status"]) for r in csv.DictReader(f)] == [
            ("0", "completed"), ("1", "completed"), ("2", "completed"), ("3", "completed")]
    assert json.loads((out / "best.json").read_text())["trial"] == 3
    # Resuming a finished search runs nothing, also with its own command line
    # again.
    for again in ([], argv[4:]):
        done = subprocess.run([sys.executable, "-m", "deepnex", "tune", "--resume", str(out),
                               *again], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    assert len((marks / "completed").read_text().split()) == 4
    # What it would leave out is refused: a probe's --samples and --space
    # given with --resume were dropped without a word.
    changed = subprocess.run([sys.executable, "-m", "deepnex", "tune", "--resume", str(out),
                              "--samples", "8", "--space", "x=uniform(5, 6)", "--", "true"],
                             capture_output=True, text=True, timeout=120)
    assert changed.returncode == 1, changed
    assert changed.stderr == (
        f"deepnex tune: --resume {out} continues the search as it was started, and was also "
        f"given --space ['x=uniform(5, 6)'] (the search's: {argv[5:8:2]!r}), --samples 8 "
        "(the search's: 1), another command; leave them "
        "out (only --retries and --max-concurrent may change), or start a new search with "
        "another --out\n"), changed.stderr
    assert len((marks / "completed").read_text().split()) == 4
    # Also a flag given with its default value, or one the search left to
    # its default (probe of 06e3d8e: --samples 4 went unsaid).
    for flags, said in ((["--samples", "4"], "--samples 4 (the search's: 1)"),
                        (["--search", "random"],
                         "--search random (the search was started without it)")):
        changed = subprocess.run([sys.executable, "-m", "deepnex", "tune", "--resume", str(out),
                                  *flags], capture_output=True, text=True, timeout=120)
        assert changed.returncode == 1 and f"was also given {said}; " in changed.stderr, changed
    # What the search resolved for itself may be given (a probe's --direction
    # max, the direction it had, was refused), and a switch is said as typed
    # (it read "--asha True").
    # So may the search method and --max-t it resolved (probe: --search tpe
    # and --max-t 100 were refused as "started without it").
    for flags in (["--direction", "max"], ["--scheduler", "none"], ["--mode", "allreduce"],
                  ["--search", tune.default_search()], ["--max-t", "100"]):
        same = subprocess.run([sys.executable, "-m", "deepnex", "tune", "--resume", str(out),
                               *flags], capture_output=True, text=True, timeout=120)
        assert same.returncode == 0, same
    # A flag that disagrees with the search's own is refused as a change, not
    # as "--scheduler asha and --no-asha disagree" (flags not typed now); one
    # that comes to the same is not listed with a real change; a store_true
    # switch has no --no- form to quote.
    for flags, said in ((["--asha"], "--asha (the search's: --no-asha)"),
                        (["--scheduler", "asha"], "--scheduler asha (the search was started "
                                                  "without it)"),
                        (["--direction", "max", "--mode", "sync"],
                         "--mode sync (the search was started without it)"),
                        (["--cold"], "--cold (the search was started without it)"),
                        (["--max-t", "50"], "--max-t 50 (the search was started without it)"),
                        (["--direction", "min"],
                         "--direction min (the search was started without it)"),
                        # The old spelling of --direction is told as one (it
                        # quoted the search's training mode).
                        (["--mode", "min"], "--mode min (the search's: --direction max)")):
        changed = subprocess.run([sys.executable, "-m", "deepnex", "tune", "--resume", str(out),
                                  *flags], capture_output=True, text=True, timeout=120)
        assert changed.returncode == 1 and f"was also given {said}; " in changed.stderr, changed


RETRIED = textwrap.dedent("""
    import os, sys
    from deepnex import tune
    mark = os.path.join(tune.checkpoint_dir(), "tried")
    if not os.path.exists(mark):
        open(mark, "w").close()
        sys.exit(3)
    tune.report(step=1, score=float(os.environ["DEEPNEX_TUNE_ATTEMPT"]))
""")


def test_a_failed_trial_is_retried_from_its_checkpoint_dir(tmp_path):
    script = tmp_path / "retried.py"
    script.write_text(RETRIED)
    out = io.StringIO()
    results = tune.run([sys.executable, str(script)], {"x": 1}, metric="score", retries=1,
                       out_dir=str(tmp_path / "out"), runner=tune.subprocess_runner, out=out)
    trial = results.trials[0]
    assert (trial.status, trial.attempts, trial.last) == ("completed", 2,
                                                          {"step": 1, "score": 1.0})
    assert (tmp_path / "out" / "checkpoints" / "trial_0" / "tried").exists()
    assert "tune: trial 0 failed (exit 3): retry 1 of 1" in out.getvalue()
    # Without retries it fails; a resume with a retry runs it again.
    results = tune.run([sys.executable, str(script)], {"x": 2}, metric="score",
                       out_dir=str(tmp_path / "b"), runner=tune.subprocess_runner, out=out)
    assert results.trials[0].status == "failed (exit 3)"
    results = tune.run([sys.executable, str(script)], {"x": 2}, metric="score", retries=1,
                       resume=True, out_dir=str(tmp_path / "b"),
                       runner=tune.subprocess_runner, out=out)
    assert (results.trials[0].status, results.trials[0].attempts) == ("completed", 2)


def test_resume_needs_the_same_search(tmp_path):
    with pytest.raises(NotFoundError) as info:
        tune.run(["true"], {"x": 1}, resume=True, out_dir=str(tmp_path), out=io.StringIO())
    assert str(info.value) == (f"out_dir: {tmp_path} has no search to resume "
                               f"({tmp_path}/journal.jsonl)")
    tune.run(["true"], {"x": 1}, out_dir=str(tmp_path), search="random",
             runner=tune.subprocess_runner, out=io.StringIO())
    with pytest.raises(InvalidArgumentError) as info:
        tune.run(["true"], {"x": 2}, resume=True, out_dir=str(tmp_path), search="random",
                 out=io.StringIO())
    assert str(info.value) == (f"resume: space is {{'x': ['value', 2]}}; the search in "
                               f"{tmp_path}/journal.jsonl has {{'x': ['value', 1]}}")


HYPERBAND_TRIAL = textwrap.dedent("""
    import argparse
    from deepnex import tune
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--x", type=float)
    args = ap.parse_args()
    for step in range(1, args.epochs + 1):
        if tune.report(step=step, score=args.x):
            break
""")


def test_a_hyperband_search_stops_trials_by_bracket_and_a_resume_keeps_its_decisions(
        tmp_path):
    script = tmp_path / "hyperband.py"
    script.write_text(HYPERBAND_TRIAL)
    command = [sys.executable, str(script), "--epochs", "9"]
    space = {"x": tune.grid(_HYPERBAND_VALUES)}
    out, text = tmp_path / "out", io.StringIO()
    # By name: max_t from the command's --epochs (9), min_t 1, eta 3.
    results = tune.run(command, space, metric="score", max_concurrent=1, search="random",
                       scheduler="hyperband", runner=tune.subprocess_runner,
                       out_dir=str(out), out=text)
    ended = [(t.id, t.status, t.last["step"]) for t in results.trials]
    assert ended == [(0, "completed", 9), (1, "completed", 9), (2, "stopped", 1),
                     (3, "completed", 9), (4, "completed", 9), (5, "stopped", 3),
                     (6, "stopped", 1)]
    assert text.getvalue().splitlines()[0].endswith(
        ", search random, hyperband (steps 1 to 9, eta 3, 3 brackets)")
    with open(out / "journal.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert records[0]["scheduler"] == {"name": "hyperband", "min_t": 1, "max_t": 9, "eta": 3}
    assert [r["decision"] for r in records if r["event"] == "report" and r["trial"] == 5] == [
        "continue", "continue", "stop"]
    # The driver killed after trial 4 ended: its journal up to there. The
    # resumed search judges trials 5 and 6 against the rung values of
    # trials 0-4 (without them trial 5 would be alone at its rung and go on).
    cut = next(i for i, r in enumerate(records)
               if r["event"] == "end" and r["trial"] == 4) + 1
    again = tmp_path / "again"
    again.mkdir()
    with open(again / "journal.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records[:cut])
    results = tune.run(command, space, metric="score", max_concurrent=1, search="random",
                       scheduler=tune.Hyperband(metric="score", max_t=9), resume=True,
                       runner=tune.subprocess_runner, out_dir=str(again), out=io.StringIO())
    assert [(t.id, t.status, t.last["step"]) for t in results.trials] == ended
    with pytest.raises(InvalidArgumentError) as info:
        tune.run(command, space, metric="score", search="random", scheduler="asha",
                 resume=True, out_dir=str(again), out=io.StringIO())
    assert str(info.value) == (
        "resume: scheduler is {'name': 'asha', 'min_t': 1, 'max_t': 9, 'eta': 3}; the search "
        f"in {again}/journal.jsonl has {{'name': 'hyperband', 'min_t': 1, 'max_t': 9, "
        "'eta': 3}")
    with pytest.raises(InvalidArgumentError) as info:
        tune.run(command, space, scheduler="bohb", out_dir=str(tmp_path / "x"))
    assert str(info.value) == 'scheduler: "bohb" is not one of asha, hyperband, none'


def test_cli_scheduler_flag_and_the_older_asha_flags(monkeypatch, capsys):
    from deepnex.__main__ import main
    seen = {}

    def fake_run(command, space, **kwargs):
        seen.update(kwargs)
        return tune.Results([], kwargs["metric"], kwargs["mode"], "x.csv")
    monkeypatch.setattr(tune, "run", fake_run)
    cmd = ["--", "python3", "train.py", "--epochs", "12"]
    main(["tune", "--space", "x=1", "--scheduler", "hyperband", "--direction", "min"] + cmd)
    h = seen["scheduler"]
    assert type(h) is tune.Hyperband and (h.mode, h.max_t, h.min_t, h.eta) == ("min", 12, 1, 3)
    assert [b.rungs for b in h.brackets] == [[1, 3, 9], [3, 9], [9]]
    main(["tune", "--space", "x=1", "--scheduler", "hyperband", "--eta", "2", "--min-t", "3",
          "--max-t", "12"] + cmd)
    assert [b.rungs for b in seen["scheduler"].brackets] == [[3, 6], [6], []]
    main(["tune", "--space", "x=1", "--scheduler", "asha"] + cmd)
    assert type(seen["scheduler"]) is tune.ASHA and seen["scheduler"].rungs == [1, 3, 9]
    main(["tune", "--space", "x=1", "--asha"] + cmd)
    assert type(seen["scheduler"]) is tune.ASHA
    for flags in (["--scheduler", "none"], ["--no-asha"], ["--scheduler", "none", "--no-asha"]):
        seen.clear()
        main(["tune", "--space", "x=1"] + flags + cmd)
        assert seen["scheduler"] is None, flags
    with pytest.raises(SystemExit) as info:
        main(["tune", "--space", "x=1", "--scheduler", "hyperband", "--no-asha"] + cmd)
    assert str(info.value) == "deepnex tune: --scheduler hyperband and --no-asha disagree"
    with pytest.raises(SystemExit) as info:
        main(["tune", "--space", "x=1", "--scheduler", "none", "--asha"] + cmd)
    assert str(info.value) == "deepnex tune: --scheduler none and --asha disagree"


# ---- seeing it

def test_show_load_and_plot_a_search(trial_script, tmp_path, capsys):
    out = tmp_path / "out"
    tune.run(trial_script, {"x": tune.grid([2.0, 1.0])}, metric="score", max_concurrent=1,
             scheduler=tune.ASHA(metric="score", min_t=1, max_t=9, eta=3), out_dir=str(out),
             runner=tune.subprocess_runner, out=io.StringIO())
    results = tune.load(str(out))
    assert [(t.id, t.status, t.config, t.last) for t in results.trials] == [
        (0, "completed", {"x": 2.0}, {"step": 9, "score": 18.0}),
        (1, "stopped", {"x": 1.0}, {"step": 1, "score": 1.0})]
    assert results.best.id == 0
    from deepnex.__main__ import main
    assert main(["tune", "show", str(out)]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown == [
        "", "trial  status     steps  x  score", "0      completed  9      2  18",
        "1      stopped    1      1  1", "",
        "trial 0 completed: 1:2 2:4 3:6 4:8 5:10 6:12 7:14 8:16 9:18",
        "trial 1 stopped: 1:1", "", "best: trial 0 score=18.0000 config: x=2"]
    pytest.importorskip("matplotlib")
    assert main(["tune", "plot", str(out)]) == 0
    png = (out / "tune.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10000


# ---- warm trials

SHOWS = textwrap.dedent("""
    import json, os, sys
    from deepnex import tune
    ap_x = float(sys.argv[sys.argv.index("--x") + 1])
    env = {k: v for k, v in os.environ.items() if k.startswith(("DEEPNEX_TUNE", "SHOWN_"))}
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": env}))
    print("to stderr", file=sys.stderr, flush=True)
    if ap_x == 2:
        os.abort()     # dies of SIGABRT
    tune.report(step=1, score=ap_x)
    sys.exit(int(ap_x) % 2 * 5)   # x=1: exit 5, x=3: exit 5, x=4: exit 0
""")


def _shown_run(tmp_path, name, warm):
    script = tmp_path / "shows.py"
    script.write_text(SHOWS)
    results = tune.run([sys.executable, str(script)], {"x": tune.grid([1.0, 2.0, 3.0, 4.0])},
                       metric="score", max_concurrent=1, search="random", warm=warm,
                       env={"SHOWN_VAR": "v"},
                       out_dir=str(tmp_path / name), runner=tune.subprocess_runner,
                       out=io.StringIO())
    logs = []
    for t in results.trials:
        lines = open(t.log_path).read().splitlines()
        shown = json.loads(lines[0])
        shown["env"]["DEEPNEX_TUNE_STORE"] = "-"   # each search has its own
        shown["env"]["DEEPNEX_TUNE_STORE_TOKEN"] = "-"
        shown["env"]["DEEPNEX_TUNE_CHECKPOINT_DIR"] = os.path.relpath(
            shown["env"]["DEEPNEX_TUNE_CHECKPOINT_DIR"], tmp_path / name)
        logs.append((t.status, t.exit_code, shown, lines[1:]))
    return logs


def test_warm_trials_match_cold_ones_and_a_crash_spares_the_next(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cold = _shown_run(tmp_path, "cold", warm=False)
    warm = _shown_run(tmp_path, "warm", warm=True)
    assert warm == cold
    assert [(status, code) for status, code, _, _ in warm] == [
        ("failed (exit 5)", 5), (f"failed (exit {-signal.SIGABRT})", -signal.SIGABRT),
        ("failed (exit 5)", 5), ("completed", 0)]
    assert warm[3][2]["cwd"] == str(tmp_path)
    assert warm[3][2]["env"]["SHOWN_VAR"] == "v"
    assert warm[3][3] == ["to stderr"]
    # Warm: each trial forked from the worker, which imported what shows.py imports.
    assert (tmp_path / "warm" / "warm.log").read_text().startswith("warm: ready (")
    assert not (tmp_path / "cold" / "warm.log").exists()


def test_a_warm_trial_is_stopped_through_its_stand_in(tmp_path):
    """kill() signals the trial's stand-in process, which passes the signal
    on to the forked trial: ASHA's stop and a Ctrl-C reach it."""
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    results = tune.run([sys.executable, str(script)], {"x": 1.0}, metric="score",
                       stop_grace=1.0, scheduler=StopAll(), out_dir=str(tmp_path),
                       runner=tune.subprocess_runner, out=io.StringIO())
    trial = results.trials[0]
    assert (trial.status, trial.exit_code) == ("stopped", -signal.SIGTERM)
    assert (tmp_path / "warm.log").exists()
    _wait_for(lambda: _processes_running(str(script)) == [], "the trial to end", timeout=15)


def test_warm_needs_a_python_script():
    with pytest.raises(InvalidArgumentError) as info:
        tune.run(["true"], {"x": 1}, warm=True, out=io.StringIO())
    assert str(info.value) == ("warm: the command ['true'] is not python SCRIPT.py, which "
                               "warm trials need")


SLEEPS = textwrap.dedent("""
    import os, sys, time
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
""")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_warm_trial_ends_with_its_stand_in_or_its_worker(tmp_path):
    """SIGKILL of the stand-in (a job's worker killed after its grace
    period) or of the warm worker (the search's end) ends the forked trial."""
    script = tmp_path / "sleeps.py"
    script.write_text(SLEEPS)
    warm = tune._Warm([sys.executable, str(script)], None, str(tmp_path))
    try:
        stand_ins = []
        for name in ("a", "b"):
            stand_ins.append(subprocess.Popen(warm.wrap([sys.executable, str(script),
                                                         str(tmp_path / name)])))
            wait_for(lambda: (tmp_path / name).exists(), f"trial {name} to start")
        (a, worker), (b, _) = [map(int, (tmp_path / n).read_text().split()) for n in "ab"]
        assert worker != stand_ins[0].pid
        stand_ins[0].kill()
        assert stand_ins[0].wait(timeout=30) == -signal.SIGKILL
        wait_for(lambda: not _alive(a), "trial a to end with its stand-in")
        assert _alive(b)
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: not _alive(b), "trial b to end with the warm worker")
        # Its stand-in learns that the trial was killed.
        assert stand_ins[1].wait(timeout=30) == -signal.SIGKILL
    finally:
        for p in stand_ins:
            if p.poll() is None:
                p.kill()
                p.wait()
        warm.close()


IN_SLOT = textwrap.dedent("""
    import json, os, sys
    from deepnex import tune
    x = float(sys.argv[sys.argv.index("--x") + 1])
    print(json.dumps({"job": os.environ.get("DEEPNEX_JOB_ID"), "worker": os.getppid(),
                      "trial": os.environ["DEEPNEX_TUNE_TRIAL"]}), flush=True)
    if x == 2:
        os.abort()     # dies of SIGABRT: the slot runs the next trial all the same
    tune.report(step=1, score=x)
    print("last line", flush=True)
    sys.exit(int(x) % 2 * 5)
""")


LOADER = textwrap.dedent("""
    import os
    def load(marks, n, scale=1):
        with open(marks, "a") as f:
            f.write(f"{os.getpid()}\\n")
        return [scale * i for i in range(n)]
""")

LOADS = textwrap.dedent("""
    import os, sys
    from deepnex import tune
    from loader import load
    def local():
        return 100
    data = tune.warm(load, {marks!r}, 3, scale=2)
    assert tune.warm(load, {marks!r}, 3, scale=2) is data   # once a process
    x = float(sys.argv[sys.argv.index("--x") + 1])
    print("trial pid", os.getpid())
    tune.report(step=1, score=sum(data) + x + tune.warm(local))
""")


def test_tune_warm_loads_data_once_in_the_warm_worker_not_per_trial(tmp_path):
    marks = tmp_path / "loads"
    (tmp_path / "loader.py").write_text(LOADER)
    script = tmp_path / "loads.py"
    script.write_text(LOADS.format(marks=str(marks)))

    def search(name, warm, runner):
        results = tune.run([sys.executable, str(script)], {"x": tune.grid([1.0, 2.0, 3.0, 4.0])},
                           metric="score", max_concurrent=2, search="random", warm=warm,
                           runner=runner, out_dir=str(tmp_path / name), out=io.StringIO())
        assert [(t.status, t.last["score"]) for t in results.trials] == [
            ("completed", 107.0), ("completed", 108.0), ("completed", 109.0),
            ("completed", 110.0)]
        pids = [open(t.log_path).read().split("trial pid ")[1].split()[0]
                for t in results.trials]
        loads = marks.read_text().split()
        marks.unlink()
        return pids, loads

    # Warm, in job_runner's slots: the worker loads once, before it forks.
    pids, loads = search("warm", None, tune.job_runner())
    assert len(loads) == 1 and loads[0] not in pids
    log = (tmp_path / "warm" / "warm.log").read_text()
    assert "warm: tune.warm(load) at line 7 made in " in log
    assert ("warm: tune.warm(local) at line 11: each trial makes it (the function is not "
            "one the script imports, or an argument is not a literal: name 'local' is not "
            "defined)") in log
    # Cold: each trial loads for itself.
    pids, loads = search("cold", False, tune.subprocess_runner)
    assert sorted(loads) == sorted(pids)
    # Outside a search: once a process for an importable function; a
    # lambda (or a function of __main__'s) is called each time.
    assert tune.warm(json.dumps, [1], indent=2) is tune.warm(json.dumps, [1], indent=2)
    calls = []
    assert [tune.warm(lambda: calls.append(1) or len(calls)) for _ in range(2)] == [1, 2]


def test_a_trial_slot_keeps_its_job_and_warm_worker_across_trials(tmp_path):
    """job_runner's warm trials run one after the other in the same slot:
    the same job (allocation) and warm worker, each trial still with its
    own exit code and complete log; at the end the slot's job is stopped
    and its cores released."""
    script = tmp_path / "in_slot.py"
    script.write_text(IN_SLOT)
    runner = tune.job_runner()
    allocations, slots = [], []

    def recording(trial_id, argv, env, log_path):
        handle = runner(trial_id, argv, env, log_path)
        allocations.append(handle._slot.allocation)
        slots.append(handle._slot)
        return handle
    recording.close = runner.close   # the search closes its runner at the end
    results = tune.run([sys.executable, str(script)], {"x": tune.grid([1.0, 2.0, 3.0, 4.0])},
                       metric="score", max_concurrent=1, search="random", runner=recording,
                       out_dir=str(tmp_path / "out"), out=io.StringIO())
    assert [(t.status, t.exit_code) for t in results.trials] == [
        ("failed (exit 5)", 5), (f"failed (exit {-signal.SIGABRT})", -signal.SIGABRT),
        ("failed (exit 5)", 5), ("completed", 0)]
    shown = []
    for t in results.trials:
        lines = open(t.log_path).read().splitlines()
        shown.append(json.loads(lines[0].split(" ", 2)[2]))
        assert lines[0].startswith("[worker 0] ")
        # The end line of the slot's trial never reaches the log.
        assert lines[1:] == ([] if t.id == 1 else ["[worker 0] last line"])
    assert [s["trial"] for s in shown] == ["0", "1", "2", "3"]
    assert len({s["job"] for s in shown}) == 1 and shown[0]["job"]
    assert len({s["worker"] for s in shown}) == 1
    assert len(set(slots)) == 1
    assert len(allocations[0]) == 1 and allocations == [allocations[0]] * 4
    # The search closed the slot: its job stopped, its cores released.
    assert slots[0].job is None and runner._slots == [] and runner._capacity.used == [0, 0]


# ---- the search's files, its store and its output

def _mode(path):
    return os.lstat(path).st_mode & 0o777


def test_the_token_is_never_journalled_and_the_search_files_are_private(
        tmp_path, trial_script, monkeypatch):
    """--token went into journal.jsonl (0644) in clear (probe). A resume
    takes the token from its own command line."""
    from deepnex.__main__ import main
    monkeypatch.delenv("DEEPNEX_TOKEN", raising=False)
    out = tmp_path / "out"
    assert main(["tune", "--plain", "--token", "SUPERSECRET-1", "--space", "x=grid([1.0])",
                 "--samples", "1", "--metric", "score", "--no-asha", "--out", str(out),
                 "--", *trial_script]) == 0
    assert b"SUPERSECRET" not in (out / "journal.jsonl").read_bytes()
    assert "token" not in tune.load(str(out)).note["cli"]
    for name in ("journal.jsonl", "results.csv", "best.json", "trial_0.log"):
        assert _mode(out / name) == 0o600, name
    assert _mode(out) == 0o700
    # Given again with --resume: taken, not refused as a change, not journalled.
    assert main(["tune", "--resume", str(out), "--token", "SUPERSECRET-2"]) == 0
    assert b"SUPERSECRET" not in (out / "journal.jsonl").read_bytes()


FORGER = textwrap.dedent("""
    import json, os
    from deepnex import tune
    from deepnex.collective import StoreClient
    from deepnex.errors import PermissionDeniedError, UnauthenticatedError
    trial = os.environ["DEEPNEX_TUNE_TRIAL"]
    try:
        StoreClient(os.environ["DEEPNEX_TUNE_STORE"], prefix=f"tune/{trial}/0",
                    timeout=5).set("report/0", json.dumps({"step": 1, "score": 99.0}))
        print("forged", flush=True)
    except (UnauthenticatedError, PermissionDeniedError) as e:
        print("refused", flush=True)
    tune.report(step=1, score=1.0)
""")


def test_the_search_store_refuses_a_client_without_its_token(tmp_path):
    """Any local user could write a trial's reports into the search's store
    (probe): it takes only the trials, which have its token."""
    script = tmp_path / "forger.py"
    script.write_text(FORGER)
    for warm in (False, True):
        out = tmp_path / f"out{warm}"
        results = tune.run([sys.executable, str(script)], {"x": 1.0}, metric="score",
                           search="random", warm=warm, runner=tune.subprocess_runner,
                           out_dir=str(out), out=io.StringIO())
        assert (results.trials[0].status, results.trials[0].results) == (
            "completed", [{"step": 1, "score": 1.0}])
        assert (out / "trial_0.log").read_text().splitlines()[-1] == "refused"


def test_out_files_replace_planted_symlinks_and_never_write_through_them(tmp_path):
    """Another user's symlinks in --out were followed: the search overwrote
    their targets (probe)."""
    out = tmp_path / "out"
    out.mkdir()
    victims = {}
    for name in ("trial_0.log", "results.csv", "best.json", "warm.log"):
        victim = tmp_path / f"victim-{name}"
        victim.write_text("precious\n")
        (out / name).symlink_to(victim)
        victims[name] = victim
    script = tmp_path / "reports.py"
    script.write_text("from deepnex import tune\ntune.report(step=1, score=2.0)\n")
    results = tune.run([sys.executable, str(script)], {"x": 1.0}, metric="score",
                       search="random", warm=True, runner=tune.subprocess_runner,
                       out_dir=str(out), out=io.StringIO())
    assert results.best.last["score"] == 2.0
    for name, victim in victims.items():
        assert victim.read_text() == "precious\n", name
        assert not (out / name).is_symlink() and _mode(out / name) == 0o600, name
    assert json.loads((out / "best.json").read_text())["result"]["score"] == 2.0
    # An out_dir that is a symlink, or another user's, is refused.
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(FailedPreconditionError, match="is a symlink"):
        tune.run([sys.executable, str(script)], {"x": 1.0}, out_dir=str(tmp_path / "link"),
                 runner=tune.subprocess_runner, out=io.StringIO())
    assert os.listdir(tmp_path / "elsewhere") == []
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        with pytest.raises(PermissionError, match="belongs to user 65534"):
            tune.run([sys.executable, str(script)], {"x": 1.0}, out_dir=str(theirs),
                     runner=tune.subprocess_runner, out=io.StringIO())
        # Under a directory of theirs, they could swap in one of their own.
        with pytest.raises(PermissionError, match=f"is in {theirs}, which belongs to user 65534"):
            tune.run([sys.executable, str(script)], {"x": 1.0}, out_dir=str(theirs / "out"),
                     runner=tune.subprocess_runner, out=io.StringIO())
    # Under one anyone may write, likewise, unless it is sticky as /tmp is.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match=rf"is in {shared} \(mode 777\), which anyone may "):
        tune.run([sys.executable, str(script)], {"x": 1.0}, out_dir=str(shared / "out"),
                 runner=tune.subprocess_runner, out=io.StringIO())
    shared.chmod(0o1777)
    tune.run([sys.executable, str(script)], {"x": 1.0}, out_dir=str(shared / "out"),
             metric="score", runner=tune.subprocess_runner, out=io.StringIO())


def test_an_open_out_dir_is_closed_and_another_users_journal_is_not_resumed(tmp_path):
    """A probe's user ran a search with --out made 0777: it stayed so, and
    another user renamed a journal of their own command over the search's;
    --resume ran that command as the search's user."""
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    script = tmp_path / "reports.py"
    script.write_text("from deepnex import tune\ntune.report(step=1, score=2.0)\n")
    run = dict(metric="score", search="random", runner=tune.subprocess_runner,
               out_dir=str(out), out=io.StringIO())
    tune.run([sys.executable, str(script)], {"x": 1.0}, **run)
    assert _mode(out) == 0o700
    if os.geteuid() != 0:
        return  # a journal of another user's needs root to make
    os.chown(out / "journal.jsonl", 65534, 65534)
    with pytest.raises(PermissionError) as e:
        tune.run([sys.executable, str(script)], {"x": 1.0}, resume=True, **run)
    assert str(e.value) == (f"{out / 'journal.jsonl'} belongs to user 65534, not to this one "
                            "(0): its commands are not resumed")


def test_cli_errors_name_the_flag_a_user_typed(tmp_path):
    """--samples 0 said "num_samples: 0", --max-concurrent 0 "max_concurrent:
    0" (names a new user never typed); tune.run(retries=None) or
    max_concurrent="2" raised a TypeError from the comparison (probe)."""
    from deepnex.__main__ import main
    for flag, dest, floor in (("--samples", "num_samples", 1),
                              ("--max-concurrent", "max_concurrent", 1),
                              ("--retries", "retries", 0)):
        with pytest.raises(SystemExit) as info:
            main(["tune", "--plain", "--search", "random", flag, str(floor - 1), "--space",
                  "x=1", "--out", str(tmp_path / dest), "--", "true"])
        assert str(info.value) == (f"deepnex tune: {dest} ({flag}): {floor - 1} must be a whole "
                                   f"number, at least {floor}")
    for kwargs, message in (({"retries": None}, r"^retries \(--retries\): None must be "),
                            ({"max_concurrent": "2"},
                             r"^max_concurrent \(--max-concurrent\): '2' must be ")):
        with pytest.raises(InvalidArgumentError, match=message):
            tune.run(["true"], {"x": 1}, out_dir=str(tmp_path / "api"),
                     runner=tune.subprocess_runner, **kwargs)


def test_cli_plain_refuses_the_flags_of_the_trials_jobs(monkeypatch):
    """--plain --central ADDR ran every trial on this machine, and --plain
    --mode foo, --workers-per-trial 2 or --cpus 2 were as silently ignored
    (probe): a plain trial is no job."""
    with pytest.raises(SystemExit) as info:
        _tune_cli(monkeypatch, ["--plain", "--central", "h:1", "--cpus", "2"])
    assert str(info.value) == ("deepnex tune: --cpus 2.0, --central h:1: --plain runs each "
                               "trial as a plain process on this machine, not as a job; leave "
                               "them out, or --plain")
    for flags in (["--mode", "foo"], ["--workers-per-trial", "2"], ["--memory", "1GiB"]):
        with pytest.raises(SystemExit, match=f"^deepnex tune: {' '.join(flags)}: --plain runs "):
            _tune_cli(monkeypatch, ["--plain", *flags])
    # --mode max is the old --direction max; the credentials may come from
    # the environment, as they do for every command.
    code, run, _ = _tune_cli(monkeypatch, ["--plain", "--mode", "max", "--token", "t"])
    assert (code, run["mode"], run["runner"]) == (1, "max", tune.subprocess_runner)


def test_cli_memory_goes_to_the_trials_jobs_and_is_required_with_central(monkeypatch):
    """deepnex tune --central always failed: it had no --memory (probe)."""
    monkeypatch.delenv("DEEPNEX_TOKEN", raising=False)
    _, _, runner = _tune_cli(monkeypatch, ["--central", "h:1", "--token", "t", "--memory",
                                           "2GiB", "--cpus", "2"])
    assert (runner["central"], runner["memory"], runner["cpus"]) == ("h:1", "2GiB", 2.0)
    monkeypatch.undo()
    monkeypatch.delenv("DEEPNEX_CENTRAL", raising=False)
    from deepnex.__main__ import main
    with pytest.raises(SystemExit) as info:
        main(["tune", "--central", "127.0.0.1:1", "--space", "x=1", "--", "true"])
    assert str(info.value).startswith("deepnex tune: memory (--memory): required with central")


def test_configurations_are_drawn_when_a_trial_can_start(tmp_path):
    """Without max_concurrent every configuration was drawn (and a thread
    started) before any trial ran (probe): the sampler learnt nothing."""
    script = tmp_path / "reports.py"
    script.write_text("import time\nfrom deepnex import tune\ntime.sleep(0.2)\n"
                      "tune.report(step=1, score=tune.get_config()['x'])\n")

    class OneAtATime:
        capacity = 1

        def __call__(self, *args):
            return tune.subprocess_runner(*args)
    out = tmp_path / "out"
    results = tune.run([sys.executable, str(script)], {"x": tune.uniform(0, 1)},
                       metric="score", num_samples=4, runner=OneAtATime(), warm=False,
                       out_dir=str(out), out=io.StringIO())
    assert [t.status for t in results.trials] == ["completed"] * 4
    from deepnex import _tune_journal
    events = [r["event"] for r in _tune_journal.read(str(out / "journal.jsonl"))[0]]
    assert events[:events.index("end")].count("trial") == 1
    # job_runner's capacity: the trials that fit on the machine's cores.
    cores = _cores()
    assert tune.job_runner(cpus=cores).capacity == 1
    assert tune.job_runner().capacity == cores
    assert tune.job_runner(central="h:1", memory="1GiB").capacity is None
    from deepnex._tune_search import default_concurrency
    assert default_concurrency(tune.subprocess_runner) == os.cpu_count()


def test_a_closed_stdout_stops_the_status_not_the_search(tmp_path):
    """`deepnex tune ... | head -1`: the trials' threads died of BrokenPipeError,
    their trials marked failed, plain ones left running (probe)."""
    script = tmp_path / "reports.py"
    script.write_text("from deepnex import tune\ntune.report(step=1, score=2.0)\n")
    r, w = os.pipe()
    os.close(r)
    out = os.fdopen(w, "w")
    try:
        results = tune.run([sys.executable, str(script)], {"x": tune.grid([1.0, 2.0])},
                           metric="score", search="random", runner=tune.subprocess_runner,
                           out_dir=str(tmp_path / "out"), out=out)
    finally:
        out.close()
    assert [t.status for t in results.trials] == ["completed"] * 2
    assert [t.status for t in tune.load(str(tmp_path / "out")).trials] == ["completed"] * 2


def test_a_tpe_search_with_tuple_choices_resumes(tmp_path):
    """The journal makes a choice()'s tuples lists, which the resumed
    sampler did not take back (probe)."""
    pytest.importorskip("optuna")
    script = tmp_path / "reports.py"
    script.write_text("from deepnex import tune\n"
                      "tune.report(step=1, score=tune.get_config()['x'])\n")
    space = {"x": tune.uniform(0, 1), "shape": tune.choice([(1, 2), (3, 4)])}
    kwargs = dict(metric="score", num_samples=2, max_concurrent=1, search="tpe",
                  runner=tune.subprocess_runner, out_dir=str(tmp_path / "out"),
                  out=io.StringIO(), warm=False)
    first = tune.run([sys.executable, str(script)], space, **kwargs)
    again = tune.run([sys.executable, str(script)], space, resume=True, **kwargs)
    # As the journal has them: tuples as lists.
    assert [t.config for t in again.trials] == json.loads(json.dumps(
        [t.config for t in first.trials]))
    assert [t.status for t in again.trials] == ["completed"] * 2


def test_a_trial_whose_runner_raises_ends_failed_in_the_journal_too(tmp_path):
    """It had no end record: show and load said pending, a resume ran it
    again (probe)."""
    calls = []

    def broken(trial_id, argv, env, log_path):
        calls.append(trial_id)
        raise InvalidArgumentError("backend: no such backend")
    kwargs = dict(metric="score", search="random", runner=broken, out_dir=str(tmp_path),
                  out=io.StringIO(), warm=False)
    results = tune.run(["true"], {"x": tune.grid([1.0, 2.0])}, **kwargs)
    failed = ["failed (backend: no such backend)"] * 2
    assert [t.status for t in results.trials] == failed
    assert [t.status for t in tune.load(str(tmp_path)).trials] == failed
    with open(tmp_path / "results.csv") as f:
        assert [r["status"] for r in csv.DictReader(f)] == failed
    calls.clear()
    again = tune.run(["true"], {"x": tune.grid([1.0, 2.0])}, resume=True, **kwargs)
    assert (calls, [t.status for t in again.trials]) == ([], failed)


def test_names_and_values_that_are_no_printable_utf8_are_refused_before_any_trial(
        tmp_path):
    """A --space name or string of command-line bytes that are not UTF-8
    (a surrogate escape) ran every trial, then failed writing results.csv
    with a UnicodeEncodeError traceback; a name with a newline broke the
    status table and the results' lines (probe)."""
    from deepnex.__main__ import main
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        main(["tune", "--plain", "--search", "random", "--space", "\udcff=1", "--out",
              str(out), "--", "true"])
    assert str(info.value) == ("deepnex tune: space: the name '\\udcff' is not printable "
                               "UTF-8 text (it is the trial's --flag and a column of "
                               "results.csv)")
    assert not (out / "journal.jsonl").exists()
    for name in ("a\nb", "", "\t"):
        with pytest.raises(InvalidArgumentError, match=f"^space: the name {re.escape(repr(name))} "
                                                       "is not printable UTF-8 text"):
            tune._Sampler({name: 1}, 1, 0, "random")
    # Values given in Python (parse_space's ast refuses such text itself).
    with pytest.raises(InvalidArgumentError, match=r"^choice: '\\udcff' is not UTF-8 text$"):
        tune.choice(["a", "\udcff"])
    with pytest.raises(InvalidArgumentError, match=r"^grid: \['\\udcff'\] is not UTF-8 text$"):
        tune.grid([["\udcff"]])
    # What a trial's --flag and a column can carry still goes.
    assert tune._Sampler({"a/b": 1, "..": 2, "a b": 3, "é": "ü"}, 1, 0, "random").total == 1


def test_flags_and_spaces_that_were_taken_wrongly_are_refused(monkeypatch):
    """--max-t 0 became 100, a seed past 2**32 - 1 a NumPy traceback, a
    bound past a float an OverflowError, and a name given twice replaced the
    first (probe)."""
    with pytest.raises(SystemExit) as info:
        _tune_cli(monkeypatch, ["--max-t", "0"])
    assert str(info.value) == "deepnex tune: min_t=1, max_t=0: need 1 <= min_t <= max_t"
    big = "1" + "0" * 400
    with pytest.raises(InvalidArgumentError, match="low and high must be finite numbers"):
        tune.parse_space([f"x=uniform(0, {big})"])
    assert tune.parse_space([f"x=randint(0, {big})"])["x"].high == int(big)
    with pytest.raises(InvalidArgumentError, match='^space: "lr=2": lr is given twice$'):
        tune.parse_space(["lr=1", "lr=2"])
    with pytest.raises(InvalidArgumentError,
                       match="^space: lr_a and lr-a both reach the trial as --lr-a; rename one$"):
        tune._Sampler({"lr_a": 1, "lr-a": 2}, 1, 0, "random")
    pytest.importorskip("optuna")
    for seed in (2**32, -1):
        with pytest.raises(InvalidArgumentError, match=r"^seed \(--seed\): "):
            tune._Sampler({"x": tune.uniform(0, 1)}, 1, seed, "tpe")
