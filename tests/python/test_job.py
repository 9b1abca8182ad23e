"""deepnex run / deepnex.job: a real job on this machine (local allocator,
process backend, deepnex-ps servers), its faults and its signals.

Each job runs as a `python3 -m deepnex run` subprocess with a private
DEEPNEX_RUN_DIR; processes are found through /proc by the job's variables.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

import deepnex
from _wait import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
DIGITS = os.path.join(HERE, "..", "..", "examples", "digits", "mlp_numpy.py")
pytestmark = pytest.mark.skipif(deepnex.job._ps_binary() is None,
                                reason="deepnex-ps not found (set DEEPNEX_BUILD_DIR)")


def _environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def job_processes(name, **match):
    """pids of the live processes of job `name` whose environment holds `match`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        env = _environ(entry)
        if env.get("DEEPNEX_LAUNCHER_ID") != name:
            continue
        if all(env.get(k) == v for k, v in match.items()):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(") ", 1)[1][0] in "ZX":
                        continue
            except OSError:
                continue
            pids.append(int(entry))
    return pids


def ps_server_pids(name):
    return [p for p in job_processes(name)
            if any(a.endswith(b"deepnex-ps") for a in _cmdline(p)[:1])]


class RunningJob:
    """`deepnex run` in a subprocess; its output collected line by line."""

    def __init__(self, tmp_path, args, command):
        self.name = "t" + uuid.uuid4().hex[:10]
        env = dict(os.environ, DEEPNEX_RUN_DIR=str(tmp_path / "run"), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deepnex", "run", "--name", self.name] + args + ["--"] + command,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            cwd=str(tmp_path))
        self.lines = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append(line.rstrip("\n"))
                self._cv.notify_all()

    def await_line(self, pattern, timeout=120):
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cv:
            while not any(rx.search(line) for line in self.lines):
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"no line matching {pattern!r} in:\n" + self.output())
                self._cv.wait(min(left, 0.5))

    def wait(self, timeout=240):
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        return code

    def output(self):
        return "\n".join(self.lines)


@pytest.fixture
def jobs(tmp_path):
    started = []

    def start(args, command):
        j = RunningJob(tmp_path, args, command)
        started.append(j)
        return j
    yield start
    for j in started:
        if j.proc.poll() is None:
            j.proc.kill()
            j.proc.wait()
        # What a `deepnex run` killed by the test above left: processes and
        # cgroups, found by its launcher id (the job's name).
        with deepnex.launch.Launcher("process") as sweeper:
            sweeper.cleanup(j.name)


def digits(*extra):
    return [sys.executable, DIGITS, "--min-accuracy", "0.9", *extra]


SYNC = ["--workers", "2", "--mode", "sync", "--lr", "0.1", "--momentum", "0.9"]


def test_run_trains_digits_to_accuracy_through_sync_ps(jobs):
    j = jobs(SYNC, digits("--epochs", "6"))
    assert j.wait() == 0, j.output()
    summary = [line for line in j.lines if "summary:" in line]
    assert summary and summary[0].startswith("[worker 0] summary: digits mlp_numpy mode=ps")
    accuracy = float(re.search(r"test_accuracy=([0-9.]+)", summary[0]).group(1))
    assert accuracy >= 0.9
    assert "job " + j.name + " exited 0" in j.output()


def test_the_job_exit_code_is_the_failing_workers(jobs):
    j = jobs(["--workers", "2", "--mode", "allreduce"],
             ["sh", "-c", 'if [ "$DEEPNEX_RANK" = 1 ]; then exit 7; fi; sleep 60'])
    assert j.wait(60) == 7, j.output()
    # The workers' other processes were killed, not waited for: they vanish
    # a moment later.
    wait_for(lambda: job_processes(j.name) == [], "the job's processes to end")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_job_and_leaves_nothing_behind(jobs, tmp_path, signum):
    j = jobs(["--workers", "2", "--mode", "sync"],
             ["sh", "-c", "echo up; sleep 600 & sleep 600"])
    j.await_line(r"^\[worker 1\] up")
    # Worker 1's "up" says nothing of worker 0, nor of the sleeps after echo.
    wait_for(lambda: len(job_processes(j.name)) >= 5,  # ps0, 2 x (sh + 2 sleeps)
             lambda: f"5 processes of the job, saw {job_processes(j.name)}")
    record = tmp_path / "run" / j.name / "job.json"
    # Written once every container has started.
    wait_for(record.exists, f"{record}")
    j.proc.send_signal(signum)
    assert j.wait(60) == 128 + signum, j.output()
    assert "everything released" in j.output()
    wait_for(lambda: job_processes(j.name) == [], "the job's processes to end")
    assert not os.path.exists(tmp_path / "run" / j.name)


def test_a_killed_worker_is_restarted_and_the_job_still_reaches_accuracy(jobs):
    j = jobs(SYNC + ["--restart", "on-failure:3"], digits("--epochs", "40"))
    j.await_line(r"^\[worker 0\] epoch +2 ")
    victims = job_processes(j.name, DEEPNEX_RANK="1")
    assert victims
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    assert j.wait() == 0, j.output()
    assert re.search(r"worker 1: exited\(0\), 1 restarts", j.output()), j.output()


def test_a_killed_parameter_server_restarts_from_its_checkpoint(jobs, tmp_path):
    ckpt = tmp_path / "ckpt"
    j = jobs(SYNC + ["--restart", "on-failure:3", "--checkpoint-dir", str(ckpt)],
             digits("--epochs", "30"))
    j.await_line(r"^\[worker 0\] epoch +2 ")
    # Periodic checkpoints come from a background tick, not from the epochs.
    wait_for(lambda: os.path.exists(ckpt / "ps0.ckpt"), f"{ckpt / 'ps0.ckpt'}",
             timeout=120)
    pids = ps_server_pids(j.name)
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    assert j.wait() == 0, j.output()
    # The second deepnex-ps said where it listens: it came back on its port.
    assert len([line for line in j.lines if "deepnex-ps listening on" in line]) == 2, j.output()


def test_bad_options_are_refused_before_anything_starts(jobs):
    j = jobs(["--workers", "0"], ["true"])
    assert j.wait(60) == 2
    assert "workers: 0 is below 1" in j.output()
    j = jobs(["--mode", "ssp:x"], ["true"])
    assert j.wait(60) == 2
    assert 'mode: "ssp:x"' in j.output()


def test_job_run_from_python(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPNEX_RUN_DIR", str(tmp_path / "run"))
    lines = []
    result = deepnex.job.run(["sh", "-c", "echo rank $DEEPNEX_RANK"], workers=2, mode="allreduce",
                             output=lambda who, line: lines.append((who, line)))
    assert result.exit_code == 0
    assert [e.reason for e in result.workers] == ["exited", "exited"]
    assert sorted(lines) == [("worker 0", "rank 0"), ("worker 1", "rank 1")]
