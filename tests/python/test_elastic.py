"""Elastic jobs on this machine (`deepnex run --workers MIN:MAX`), the runner's
side: through a deepnex-central on 127.0.0.1 whose one node is this host, a
job starts with MIN workers, asks for the rest at priority -1 and grows when
another user's allocation is released, drops a killed worker and grows back
with a new worker id; each membership is in the job's store as the elastic
contract says (elastic/members/<G>, then elastic/generation), and each resize
is a "resized" job event in central's record and in a notification. Bad
--workers values are named.

The workers are a tiny script that prints its generation and every membership
it reads from the store."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

import deepnex
from _central import start_central, stop_central
from _wait import wait_for
from test_job import DIGITS, jobs  # noqa: F401 - the fixture that runs and sweeps `deepnex run`
from test_notify import Receiver

# Says who and where it is, then every membership from its own generation
# on, as it reads them from the store, until the gate (argv[1]) opens.
# test_elastic_hosts runs it too.
WORKER = r"""
import os, socket, sys, time
from deepnex.collective import StoreClient
me = os.environ["DEEPNEX_WORKER_ID"]
gen = int(os.environ["DEEPNEX_ELASTIC_GENERATION"])
print(f"{me} pid {os.getpid()} on {socket.gethostname()} rank {os.environ['DEEPNEX_RANK']}/"
      f"{os.environ['DEEPNEX_WORLD_SIZE']} gen {gen} elastic {os.environ['DEEPNEX_ELASTIC']}",
      flush=True)
store = StoreClient(os.environ["DEEPNEX_STORE_ADDR"], token=os.environ["DEEPNEX_TOKEN"])
seen = gen - 1
while not os.path.exists(sys.argv[1]):
    latest = int(store.get("elastic/generation"))
    for g in range(seen + 1, latest + 1):
        print(f"{me} sees {g}: {store.get(f'elastic/members/{g}').decode()}", flush=True)
    seen = max(seen, latest)
    time.sleep(0.05)
"""


@pytest.fixture
def central(tmp_path):
    """deepnex-central whose one node is this host with room for two
    1-core workers; its address."""
    # --notify-allow-private: a job's URL may reach a receiver on 127.0.0.1.
    proc, address = start_central(tmp_path, "--state-dir", str(tmp_path / "state"),
                                  "--notify-allow-private", cpus=2, memory="16GiB",
                                  node=socket.gethostname())
    yield address
    stop_central(proc)


def run_elastic(jobs, central, workers, gate, *flags):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if k != "DEEPNEX_TOKEN"}
    env.update(DEEPNEX_CENTRAL=central, DEEPNEX_TOKEN="alicetok")
    return jobs(["--workers", workers, "--mode", "allreduce", "--cpus", "1", "--memory", "64MiB",
                 *flags], [sys.executable, "-c", WORKER, str(gate)], env=env)


def pid_of(j, worker_id):
    line = next(x for x in j.lines if re.match(rf"^\[worker \d+\] {worker_id} pid ", x))
    return int(line.split()[4])


def test_an_elastic_job_grows_as_capacity_frees_shrinks_and_grows_back(jobs, central,  # noqa: F811
                                                                       tmp_path):
    receiver = Receiver()
    alice = deepnex.gpu.CentralClient(central, token="alicetok", timeout=10)
    bob = deepnex.gpu.CentralClient(central, token="bobtok", timeout=10)
    held = bob.allocate(deepnex.gpu.Request(user="bob", cpus=1, memory="64MiB"))
    gate = tmp_path / "gate"
    host = socket.gethostname()
    try:
        j = run_elastic(jobs, central, "1:2", gate, "--notify", receiver.url)
        j.await_line(r"^\[worker 0\] w0 pid \d+ on \S+ rank 0/1 gen 1 elastic 1:2$")
        j.await_line(r"^\[worker 0\] w0 sees 1: w0$")
        # The rest waits in central's queue below everyone's normal work.
        wait_for(lambda: [(p["user"], p["priority"]) for p in alice.pending()] == [("alice", -1)],
                 lambda: f"alice's growth queued at -1: {alice.pending()}")
        bob.release(held.id)
        j.await_line(r"^\[worker 1\] w1 pid \d+ on \S+ rank 1/2 gen 2 elastic 1:2$")
        j.await_line(r"^\[worker 0\] w0 sees 2: w0,w1$")
        j.await_line(r"^\[worker 1\] w1 sees 2: w0,w1$")
        record = wait_for(lambda: (lambda r: r if r["workers"] == 2 else None)(alice.job(j.name)),
                          "the record's 2 workers")
        assert (record["min_workers"], record["max_workers"]) == (1, 2)

        os.kill(pid_of(j, "w1"), signal.SIGKILL)
        j.await_line(r"^\[worker 0\] w0 sees 3: w0$")
        # Capacity is free again: a new worker, a new id.
        j.await_line(r"^\[worker 2\] w2 pid \d+ on \S+ rank 1/2 gen 4 elastic 1:2$")
        j.await_line(r"^\[worker 0\] w0 sees 4: w0,w2$")
        gate.write_text("")
        assert j.wait(120) == 0, j.output()
        # Its members' allocations went back with it (they were left held).
        assert alice.allocations() == []
    finally:
        receiver.close()
    resized = [line for line in j.lines if "job resized" in line]
    assert resized == [
        f'deepnex run: job resized from 1 to 2 workers (generation 2): worker w1 joined on node '
        f'"{host}"',
        "deepnex run: job resized from 2 to 1 workers (generation 3): worker w1 "
        "signaled(SIGKILL)",
        f'deepnex run: job resized from 1 to 2 workers (generation 4): worker w2 joined on node '
        f'"{host}"'], j.output()
    done = alice.job(j.name)
    assert (done["state"], done["resizes"]) == ("completed", 3)
    assert done["last_resize"] == f'resized from 1 to 2: worker w2 joined on node "{host}"'
    from deepnex._cli_jobs import show_text
    assert ("mode:        allreduce, 2 workers (elastic 1:2, 3 resizes: resized from 1 to 2: "
            f'worker w2 joined on node "{host}"), 0 parameter servers') in show_text(done)
    # Each resize central heard of went out as a job.resized notification:
    # the growth to 2 at least (resizes between two reports are told as one).
    events = wait_for(lambda: [e for _, _, e in receiver.events() if e["kind"] == "job.resized"],
                      lambda: f"a job.resized notification: {[e for _, _, e in receiver.events()]}")
    first = events[0]["data"]
    assert (first["from"], first["workers"]) == (1, 2)
    assert first["why"].startswith("resized from 1 to 2: worker w1 joined"), first


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_an_elastic_job_and_releases_what_it_held(jobs, central,  # noqa: F811
                                                                 tmp_path, signum):
    """A stopped elastic `deepnex run` waited for ever (its membership never
    ended), and its allocations stayed held in central (probe)."""
    alice = deepnex.gpu.CentralClient(central, token="alicetok", timeout=10)
    j = run_elastic(jobs, central, "1:2", tmp_path / "gate")
    j.await_line(r"^\[worker 1\] w1 sees 2: w0,w1$")
    j.proc.send_signal(signum)
    assert j.wait(60) == 128 + signum, j.output()
    assert j.lines[-1] == (f"deepnex run: job {j.name} stopped by {signal.Signals(signum).name}; "
                           "everything released"), j.output()
    assert not [line for line in j.lines if "from outside the job" in line], j.output()
    assert alice.allocations() == [] and alice.pending() == []


def test_below_min_the_job_fails_with_the_workers_code(jobs, central, tmp_path):  # noqa: F811
    # Room for two: MIN 2 start, the third waits; one killed leaves one.
    j = run_elastic(jobs, central, "2:3", tmp_path / "gate")
    j.await_line(r"^\[worker 1\] w1 sees 1: w0,w1$")
    os.kill(pid_of(j, "w1"), signal.SIGKILL)
    assert j.wait(120) == 128 + signal.SIGKILL, j.output()
    assert not [line for line in j.lines if "resized" in line], j.output()


def worker_pid(job_name, worker_id):
    """The pid of elastic worker `worker_id` of job `job_name` (a script that
    prints nothing of itself), from its environment."""
    want = {f"DEEPNEX_JOB_ID={job_name}".encode(), f"DEEPNEX_WORKER_ID={worker_id}".encode()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want <= set(f.read().split(b"\0")):
                    return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no process of {worker_id} in job {job_name}")


def test_a_stalled_worker_is_dropped_and_the_job_trains_on_to_090(jobs, central,  # noqa: F811
                                                                   tmp_path):
    """w1 stops (SIGSTOP: alive to the launcher, deaf to its peer) while both
    train: w0's allreduce times out (DEEPNEX_ELASTIC_TIMEOUT 10 s), it
    reports and waits; the runner stops and drops w1, which reported nothing
    within 10 s, and the job trains on to its accuracy. (A joiner slower to
    start than the timeout would be dropped too, before it formed
    generation 2: 10 s leaves a loaded machine room.) Before, w0 waited for a
    generation that never came and exited 1, and the runner dropped healthy
    w0 and kept the stalled w1 (probe)."""
    pytest.importorskip("sklearn")
    env = {k: v for k, v in os.environ.items() if k != "DEEPNEX_TOKEN"}
    env.update(DEEPNEX_CENTRAL=central, DEEPNEX_TOKEN="alicetok", DEEPNEX_ELASTIC_TIMEOUT="10")
    j = jobs(["--workers", "1:2", "--mode", "allreduce", "--cpus", "1", "--memory", "512MiB"],
             [sys.executable, DIGITS, "--epochs", "300", "--min-accuracy", "0.9"], env=env)
    j.await_line(r"^\[worker 1\] deepnex.elastic: worker w1 is rank 1 of 2 in generation 2$")
    stalled = worker_pid(j.name, "w1")
    os.kill(stalled, signal.SIGSTOP)
    try:
        j.await_line(r"^\[worker 0\] deepnex.elastic: worker w0: a collective failed in "
                     r"generation 2 \(.*\); back to the last commit, waiting for generation 3$")
        j.await_line(r"^deepnex run: job resized from 2 to 1 workers \(generation 3\): worker w1 "
                     r"stalled: no failed collective reported within 10 s of w0's in generation 2$")
        assert j.wait(180) == 0, j.output()
    finally:
        # Stopped by the runner (a stopped process takes SIGKILL); not left
        # stopped whatever failed.
        with contextlib.suppress(ProcessLookupError):
            os.kill(stalled, signal.SIGCONT)
    summary = re.search(r"^\[worker 0\] summary: .* test_accuracy=([0-9.]+)", j.output(), re.M)
    assert summary and float(summary.group(1)) >= 0.9, j.output()


@pytest.mark.parametrize("text, parsed", [("3", (0, 3)), ("2:2", (0, 2)), ("1:4", (1, 4))])
def test_workers_min_max_is_elastic_only_below_max(text, parsed):
    from deepnex._cli_job import parse_workers
    assert parse_workers(text) == parsed


@pytest.mark.parametrize("workers, message", [
    ("3:2", "--workers: '3:2': MIN 3 is above MAX 2"),
    ("0:2", "--workers: '0:2': MIN 0 is below 1"),
    ("0", "workers: 0 is below 1"),
    ("a:b", "--workers: 'a:b' is not N or MIN:MAX (e.g. 2 or 1:4)"),
    ("1:2:3", "--workers: '1:2:3' is not N or MIN:MAX (e.g. 2 or 1:4)"),
    # int() took these, and the job echoed them as its size.
    (" 1:2", "--workers: ' 1:2' is not N or MIN:MAX (e.g. 2 or 1:4)"),
    ("1:+2", "--workers: '1:+2' is not N or MIN:MAX (e.g. 2 or 1:4)"),
    ("\u0661:2", "--workers: '\u0661:2' is not N or MIN:MAX (e.g. 2 or 1:4)"),
    ("1_0", "--workers: '1_0' is not N or MIN:MAX (e.g. 2 or 1:4)"),
    # Past the C++ int: named, not a pybind11 traceback.
    ("4611686018427387904",
     "workers=4611686018427387904: not a value of this option's type, or out of its range"),
    ("1:4611686018427387904",
     "workers=4611686018427387904: not a value of this option's type, or out of its range"),
])
def test_bad_workers_are_named(workers, message):
    out = subprocess.run([sys.executable, "-m", "deepnex", "run", "--workers", workers, "--",
                          "true"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert out.stderr == f"deepnex run: {message}\n", out


def test_min_workers_in_python_is_checked():
    with pytest.raises(deepnex.InvalidArgumentError,
                       match=r"^min_workers: 3 is more than workers \(the most\): 2$"):
        deepnex.job.Job(["true"], workers=2, min_workers=3)
