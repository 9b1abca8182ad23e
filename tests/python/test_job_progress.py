"""Progress reports of a central job: a training script in `deepnex run
--central` calls deepnex.report(step=..., **metrics); rank 0's last report
reaches central's record (through the runner), shows in `deepnex jobs` (LAST
REPORT) and `deepnex job show`, and goes out as a signed job.progress event
once when --notify-when first holds, or every --notify-every minutes. Bad
input is named; a report outside a job and a search does nothing, as before.

Jobs run as `python3 -m deepnex run` subprocesses (test_job's jobs fixture)
on this host's node of a deepnex-central on 127.0.0.1, process backend. The
test steps the script with gate files: it reports step i once gate<i> exists.
"""

import os
import re
import socket
import sys
import time

import pytest

import deepnex
from _central import run_cli, start_central, stop_central
from _wait import wait_for
from test_job import jobs  # noqa: F401 - the fixture that runs and sweeps `deepnex run`
from test_notify import SECRETS, Receiver, signature

HOST = socket.gethostname()

# Worker `rank` reports step i (metrics from the JSON list argv[2], one
# dict per step) once <dir>/gate<i> exists; rank 1 reports other values,
# which must not show. Ends once <dir>/end exists.
SCRIPT = r"""
import json, os, sys, time
import deepnex
gates, steps = sys.argv[1], json.loads(sys.argv[2])
rank = int(os.environ["RANK"])
for i, metrics in enumerate(steps, 1):
    while not os.path.exists(os.path.join(gates, f"gate{i}")):
        time.sleep(0.02)
    if rank != 0:
        metrics = {k: -1.0 for k in metrics}
    assert deepnex.report(step=i, **metrics) is False
    print(f"reported {i}", flush=True)
while not os.path.exists(os.path.join(gates, "end")):
    time.sleep(0.02)
"""


@pytest.fixture
def central(tmp_path, jobs):  # noqa: F811 - test_job's fixture
    """deepnex-central signing alice's events; .run(args, steps) runs the
    script as alice's job through it."""
    secrets = tmp_path / "secrets"
    secrets.write_text(SECRETS)
    # The receivers listen on 127.0.0.1, where a job's own URL may not reach
    # unless central allows it.
    proc, address = start_central(tmp_path, "--state-dir", str(tmp_path / "state"),
                                  "--notify-secret-file", str(secrets), "--notify-allow-private",
                                  cpus=8, memory="16GiB", node=HOST)

    class Central:
        pass

    c = Central()
    c.address = address
    c.client = deepnex.gpu.CentralClient(address, token="alicetok", timeout=10)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)

    def run(args, steps):
        import json
        env = {k: v for k, v in os.environ.items() if k != "DEEPNEX_TOKEN"}
        env.update(DEEPNEX_CENTRAL=address, DEEPNEX_TOKEN="alicetok")
        return jobs(["--mode", "allreduce", "--memory", "64MiB", *args],
                    [sys.executable, str(script), str(tmp_path), json.dumps(steps)], env=env)

    c.run = run
    yield c
    stop_central(proc)


def report_of(client, name):
    try:
        return client.job(name)["report"]
    except deepnex.NotFoundError:
        return None


def step(central, tmp_path, j, i):
    """Lets the script report step i; returns the record's report once it
    shows that step."""
    (tmp_path / f"gate{i}").write_text("")
    j.await_line(rf"^\[worker 0\] reported {i}$")
    return wait_for(lambda: (report_of(central.client, j.name) or {}).get("step") == i and
                    report_of(central.client, j.name), f"step {i} in the job's record",
                    timeout=30)


def test_rank_0s_last_report_reaches_deepnex_jobs_and_job_show_exactly(central, tmp_path):
    j = central.run(["--workers", "2"], [{"accuracy": 0.5, "loss": 1.25},
                                         {"accuracy": 0.75, "loss": 0.125}])
    wait_for(lambda: (central.client.jobs() or [{}])[0].get("state") == "running",
             lambda: "the job to run:\n" + j.output(), timeout=60)
    assert central.client.job(j.name)["report"] is None
    out = run_cli("jobs", "--central", central.address)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()
    assert header.endswith("EXIT  LAST REPORT")
    assert row[header.index("LAST REPORT"):] == "-"

    before = time.time() * 1000
    step(central, tmp_path, j, 1)
    report = step(central, tmp_path, j, 2)
    assert report["step"] == 2
    assert report["metrics"] == {"accuracy": 0.75, "loss": 0.125}
    assert before <= report["time_ms"] <= time.time() * 1000
    [listed] = central.client.jobs()
    assert listed["report"] == report
    out = run_cli("jobs", "--central", central.address)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()
    assert row[header.index("LAST REPORT"):] == "step 2 accuracy=0.75 loss=0.125"
    out = run_cli("job", "show", j.name, "--central", central.address)
    assert out.returncode == 0, out.stderr
    assert "last report: step 2 accuracy=0.75 loss=0.125 (at " in out.stdout

    (tmp_path / "end").write_text("")
    assert j.wait(60) == 0, j.output()
    # The history keeps it.
    [done] = central.client.jobs(all=True)
    assert (done["state"], done["report"]) == ("completed", report)


def test_a_threshold_event_arrives_once_signed(central, tmp_path):
    receiver = Receiver()
    try:
        j = central.run(["--workers", "1", "--notify", receiver.url,
                         "--notify-when", "accuracy>=0.9"],
                        [{"accuracy": 0.5}, {"accuracy": 0.95}, {"accuracy": 0.97}])
        for i in (1, 2, 3):
            step(central, tmp_path, j, i)
        (tmp_path / "end").write_text("")
        assert j.wait(60) == 0, j.output()
        kinds = ["job.queued", "job.started", "job.progress", "job.completed"]
        wait_for(lambda: len(receiver.events()) == len(kinds), "the job's 4 events", timeout=30)
        assert [e["kind"] for _, _, e in receiver.events()] == kinds
        for headers, body, event in receiver.events():
            assert headers["X-Deepnex-Signature"] == signature("alicesecret", body)
        progress = receiver.events()[2][2]
        assert (progress["user"], progress["job"]) == ("alice", j.name)
        data = progress["data"]
        assert (data["reason"], data["when"]) == ("when", "accuracy>=0.9")
        assert (data["report"]["step"], data["report"]["metrics"]) == (2, {"accuracy": 0.95})
    finally:
        receiver.close()


def test_progress_every_n_minutes(central, tmp_path):
    receiver = Receiver()
    try:
        # 0.001 minutes: each new report that the runner passes on.
        j = central.run(["--workers", "1", "--notify", receiver.url, "--notify-every", "0.001"],
                        [{"loss": 2.0}, {"loss": 1.0}])
        for i in (1, 2):
            step(central, tmp_path, j, i)
            wait_for(lambda: [e["data"]["report"]["step"] for _, _, e in receiver.events()
                              if e["kind"] == "job.progress"][-1:] == [i],
                     f"job.progress of step {i}", timeout=30)
        (tmp_path / "end").write_text("")
        assert j.wait(60) == 0, j.output()
        progress = [e["data"] for _, _, e in receiver.events() if e["kind"] == "job.progress"]
        assert [(p["reason"], p["report"]["step"], p["report"]["metrics"]) for p in progress] == \
            [("every", 1, {"loss": 2.0}), ("every", 2, {"loss": 1.0})]
    finally:
        receiver.close()


@pytest.mark.parametrize("args, message", [
    (["--central", "127.0.0.1:1", "--notify-when", "accuracy>>0.9"],
     'notify_when: "accuracy>>0.9" is not METRIC OP NUMBER (OP: >=, <=, >, <, ==), '
     'e.g. accuracy>=0.9'),
    (["--central", "127.0.0.1:1", "--notify-when", ">=0.9"],
     'notify_when: ">=0.9" is not METRIC OP NUMBER'),
    (["--central", "127.0.0.1:1", "--notify-when", "accuracy>=high"],
     'notify_when: "accuracy>=high" is not METRIC OP NUMBER'),
    (["--notify-when", "accuracy>=0.9"],
     "notify_every, notify_when: need central (deepnex-central sends job.progress)"),
    (["--central", "127.0.0.1:1", "--notify-every", "soon"],
     "argument --notify-every: invalid float value: 'soon'"),
    (["--central", "127.0.0.1:1", "--notify-every", "-1"],
     "notify_every: -1.0 is not a number of minutes >= 0"),
    (["--central", "127.0.0.1:1", "--notify-every", "1e300"],
     "notify_every: 1e+300 minutes is more than deepnex's longest duration (1e9 s, about 31 "
     "years)"),
])
def test_bad_progress_flags_are_named(tmp_path, jobs, args, message):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if k != "DEEPNEX_CENTRAL"}
    j = jobs(["--memory", "64MiB", *args], ["true"], env=env)
    assert j.wait(60) == 2, j.output()
    assert message in j.output()


def test_a_non_numeric_metric_is_named_in_a_job(monkeypatch):
    monkeypatch.delenv("DEEPNEX_TUNE_STORE", raising=False)
    monkeypatch.setenv("DEEPNEX_JOB_ID", "j1")
    monkeypatch.setenv("DEEPNEX_STORE_ADDR", "127.0.0.1:1")
    monkeypatch.setenv("DEEPNEX_RANK", "0")
    with pytest.raises(deepnex.InvalidArgumentError,
                       match=r"^deepnex.report\(step=3\): metric accuracy='high' is not a "
                             r"number$"):
        deepnex.report(step=3, accuracy="high")
    with pytest.raises(deepnex.InvalidArgumentError,
                       match=r"^deepnex.report\(step=3\): metric loss=nan is not a finite number$"):
        deepnex.report(step=3, loss=float("nan"))
    with pytest.raises(deepnex.InvalidArgumentError,
                       match=r"^deepnex.report: step=1.5 is not an integer$"):
        deepnex.report(step=1.5, loss=1.0)
    # A probe's accuracy=True ranked its trial best; step=-5 "completed at step -5".
    import numpy as np
    import torch
    # float() takes these too (probe): an object array's bool, a complex
    # number's real part, bytes, a duration.
    for flag in (True, np.bool_(False), torch.tensor(True), np.array(True, dtype=object),
                 np.complex64(1 + 2j), torch.tensor(1 + 2j), b"0.5", np.timedelta64(5, "s")):
        with pytest.raises(deepnex.InvalidArgumentError,
                           match=rf"^deepnex.report\(step=3\): metric accuracy="
                                 rf"{re.escape(repr(flag))} is not a number$"):
            deepnex.report(step=3, accuracy=flag)
    # What float() converts is taken, a Decimal too; a number past a
    # float's range is refused naming it (it was a bare OverflowError).
    with pytest.raises(deepnex.InvalidArgumentError,
                       match=r"^deepnex.report\(step=3\): metric huge=1000.* is not a number$"):
        deepnex.report(step=3, huge=10 ** 400)
    with pytest.raises(deepnex.InvalidArgumentError, match=r"^deepnex.report: step=-5 is below 0$"):
        deepnex.report(step=-5, loss=1.0)
    # Other ranks' reports are checked alike, and go nowhere (no store here).
    monkeypatch.setenv("DEEPNEX_RANK", "1")
    assert deepnex.report(step=3, loss=1.0) is False
    from decimal import Decimal
    from fractions import Fraction
    assert deepnex.report(step=3, a=Decimal("0.5"), b=Fraction(1, 2), c=np.float16(0.5),
                          d=torch.tensor([0.5]), e=np.array(2)) is False


def test_a_report_outside_a_job_and_a_search_checks_and_does_nothing(monkeypatch):
    for name in ("DEEPNEX_TUNE_STORE", "DEEPNEX_TUNE_TRIAL", "DEEPNEX_JOB_ID",
                 "DEEPNEX_STORE_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert deepnex.report(step=1, accuracy=0.5) is False
    # Checked as in a search, so that a script tried on its own meets a bad
    # metric at once (a probe's accuracy=True passed here).
    for bad in ("anything", True):
        with pytest.raises(deepnex.InvalidArgumentError, match="is not a number"):
            deepnex.report(step=1, accuracy=bad)
    assert deepnex.report is deepnex.tune.report
