"""deepnex.tune: search spaces, ASHA's promotions (exact), searches with
stand-in trials, and a search on the digits example reaching 0.95."""

import csv
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from _wait import wait_for
from deepnex import tune

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
    with pytest.raises(ValueError, match="num_samples: 0"):
        tune.generate_configs({"a": 1}, 0)


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


def test_job_runner_waits_for_cores_and_fails_what_never_fits(trial_script, tmp_path):
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
    results = tune.run(trial_script, {"x": 1.0}, metric="score", out_dir=str(tmp_path / "b"),
                       runner=tune.job_runner(workers=1, cpus=cores + 1))
    status = results.trials[0].status
    assert status.startswith(f"failed (a trial needs {cores + 1} cores and 0 GPUs; "
                             f"this machine has {cores} cores"), status


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
            if "trial 0 step 1" in line:
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


def test_report_outside_a_search_is_a_no_op(monkeypatch):
    monkeypatch.delenv("DEEPNEX_TUNE_STORE", raising=False)
    assert tune.report(step=1, accuracy=0.5) is False
    assert tune.get_config() == {}


def test_cli_parses_a_search(tmp_path, trial_script):
    from deepnex.__main__ import main
    code = main(["tune", "--space", "x=grid([1.0, 2.0])", "--samples", "1", "--metric", "score",
                 "--out", str(tmp_path / "cli"), "--", *trial_script])
    assert code == 0
    with open(tmp_path / "cli" / "results.csv") as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["completed", "completed"]


# ---- digits

def test_cli_trials_as_two_worker_ps_jobs(tmp_path):
    """deepnex tune --workers-per-trial 2 --job-mode sync: each trial a job
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
                 "--samples", "1", "--workers-per-trial", "2", "--job-mode", "sync",
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
