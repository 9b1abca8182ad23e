"""deepnex-central's job records: `deepnex run --central` registers its job,
`deepnex jobs` / `deepnex job show` / `deepnex job cancel` read and stop it,
and the history outlives a kill -9 of central and is pruned by count.

Jobs run as `python3 -m deepnex run` subprocesses (test_job's jobs fixture) on
this host's node of a deepnex-central on 127.0.0.1, process backend.
"""

import os
import re
import signal
import socket
import subprocess
import time

import pytest

import deepnex
from _central import CENTRAL_BIN, run_cli, start_central, stop_central
from _wait import wait_for
from test_job import jobs  # noqa: F401 - the fixture that runs and sweeps `deepnex run`

HOST = socket.gethostname()


@pytest.fixture
def central(tmp_path, jobs):  # noqa: F811 - test_job's fixture
    """Start deepnex-central (state in tmp_path/state) on this host's node;
    each call returns its address; .run(address, args, command) runs a job
    through it. Stopped at the end."""
    procs = []

    def start(*extra):
        proc, address = start_central(tmp_path, "--state-dir", str(tmp_path / "state"), *extra,
                                      cpus=8, memory="16GiB", node=HOST)
        procs.append(proc)
        return address

    def run(address, args, command, token="alicetok"):
        env = {k: v for k, v in os.environ.items() if k != "DEEPNEX_TOKEN"}
        env.update(DEEPNEX_CENTRAL=address, DEEPNEX_TOKEN=token)
        return jobs(["--mode", "allreduce", "--memory", "64MiB"] + args, command, env=env)

    start.run = run
    start.procs = procs
    yield start
    for proc in procs:
        if proc.poll() is None:
            stop_central(proc)


def test_a_signal_stops_a_job_at_once_and_its_record_says_cancelled_by_it(central, tmp_path):
    """SIGTERM waited while every line a worker had printed went out (76 s
    for 11 MB, its GPUs held meanwhile), and the job's record said failed,
    exit 1, as a crash would."""
    address = central()
    mark = tmp_path / "printed"
    j = central.run(address, ["--workers", "1"],
                    ["sh", "-c", f"seq 1 3000000; touch {mark}; sleep 600"])
    wait_for(mark.exists, "the worker to print 3000000 lines")
    j.proc.send_signal(signal.SIGTERM)
    assert j.wait(60) == 143, j.output()[-2000:]
    c = clients(address)
    assert c["alice"].allocations() == []
    done = c["alice"].job(j.name)
    assert (done["state"], done["exit_code"], done["message"]) == (
        "cancelled", 143, "stopped by SIGTERM")


def gated(gate):
    return ["sh", "-c", f"echo up; while [ ! -e {gate} ]; do sleep 0.05; done"]


def holding_both_gpus(central, address, gate):
    """A job of alice's running on both of the node's GPUs until `gate` exists."""
    holder = central.run(address, ["--workers", "1", "--gpus-per-worker", "2"], gated(gate))
    holder.await_line(r"^\[worker 0\] up")
    return holder


def clients(address):
    return {name: deepnex.gpu.CentralClient(address, token=f"{name}tok", timeout=10)
            for name in ("alice", "bob", "admin")}


def record(client, name):
    """The job's record, or {} before its runner registered it."""
    try:
        return client.job(name)
    except deepnex.NotFoundError:
        return {}


def state_of(client, name):
    return record(client, name).get("state")


def test_a_job_is_listed_with_its_nodes_then_kept_with_its_exit_code_and_gpu_hours(
        central, tmp_path):
    address = central()
    c = clients(address)
    gate = tmp_path / "gate"
    j = central.run(address, ["--workers", "2", "--gpus-per-worker", "1"], gated(gate))
    j.await_line(r"^\[worker 1\] up")
    wait_for(lambda: state_of(c["alice"], j.name) == "running", "the job to run")
    [listed] = c["alice"].jobs()
    assert (listed["name"], listed["user"], listed["state"], listed["nodes"], listed["workers"],
            listed["mode"]) == (j.name, "alice", "running", [HOST], 2, "allreduce")
    assert sorted(a["gpus"] for a in listed["allocations"]) == [1, 1]
    # Its allocations carry its name.
    assert [a.job for a in c["alice"].allocations()] == [j.name, j.name]
    out = run_cli("jobs", "--central", address)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()
    assert header.split() == ["NAME", "USER", "STATE", "NODES", "WORKERS", "ELAPSED", "GPU-H",
                              "CPU-H", "PEAK-MEM", "EXIT", "LAST", "REPORT"]
    assert row.split()[:5] == [j.name, "alice", "running", HOST, "2"]
    assert row.split()[-2:] == ["-", "-"]  # no exit code, no report
    shown = wait_for(lambda: [c for c in c["alice"].job(j.name)["containers"]
                              if c["state"] == "running"], "its containers reported")
    assert sorted(x["name"] for x in shown) == [f"{j.name}-worker0", f"{j.name}-worker1"]
    out = run_cli("job", "show", j.name, "--central", address)
    assert out.returncode == 0, out.stderr
    assert f"  node {HOST}:" in out.stdout
    assert f"{j.name}-worker1" in out.stdout and "state:       running" in out.stdout

    gate.write_text("")
    assert j.wait(60) == 0, j.output()
    assert c["alice"].jobs() == []  # no longer running
    [done] = c["alice"].jobs(all=True)
    assert (done["state"], done["exit_code"]) == ("completed", 0)
    assert done["ended_ms"] > done["started_ms"] > 0
    elapsed = (done["ended_ms"] - done["started_ms"]) / 1000.0
    assert done["elapsed"] == elapsed
    assert done["gpu_hours"] == 2 * elapsed / 3600.0
    # CPU-hours and peak memory from the containers' usage samples.
    samples = done["containers"]
    assert done["peak_memory"] == max(x["memory_peak"] for x in samples) > 0
    cpu = sum(x["cpu_seconds"] for x in samples)
    # Without samples: the allocations' 2 cores over the run.
    assert done["cpu_hours"] == (cpu / 3600.0 if cpu > 0 else 2 * elapsed / 3600.0)
    assert [x["name"] for x in c["alice"].jobs(state="completed")] == [j.name]
    row = run_cli("jobs", "--all", "--central", address).stdout.splitlines()[1].split()
    assert (row[2], row[-2]) == ("completed", "0")

    failing = central.run(address, ["--workers", "1"], ["sh", "-c", "exit 3"])
    assert failing.wait(60) == 3, failing.output()
    record = c["alice"].job(failing.name)
    assert (record["state"], record["exit_code"]) == ("failed", 3)
    assert [x["name"] for x in c["alice"].jobs(state="failed")] == [failing.name]


def test_another_user_can_neither_see_nor_cancel_it_and_its_owner_cancels_it(
        central, tmp_path):
    address = central()
    c = clients(address)
    j = central.run(address, ["--workers", "2"], gated(tmp_path / "gate"))
    j.await_line(r"^\[worker 1\] up")
    wait_for(lambda: state_of(c["alice"], j.name) == "running", "the job to run")
    assert c["bob"].jobs(all=True) == []
    with pytest.raises(deepnex.NotFoundError, match=f'job "{j.name}" not found'):
        c["bob"].job(j.name)
    with pytest.raises(deepnex.NotFoundError, match=f'job "{j.name}" not found'):
        c["bob"].cancel_job(j.name)
    out = run_cli("job", "cancel", j.name, "--central", address, token="bobtok")
    assert out.returncode == 1
    assert out.stderr == f'deepnex: job "{j.name}" not found\n'
    out = run_cli("jobs", "--user", "alice", "--central", address, token="bobtok")
    assert "user bob cannot list the jobs of alice" in out.stderr
    assert [x["name"] for x in c["admin"].jobs()] == [j.name]  # admins see everyone's

    out = run_cli("job", "cancel", j.name, "--central", address)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"job {j.name} cancelled; its allocations are released\n"
    # The runner stops everything and says why.
    assert j.wait(60) == 1, j.output()
    assert f"job {j.name} was cancelled by alice through deepnex-central" in j.output()
    assert c["alice"].allocations() == []
    record = c["alice"].job(j.name)
    assert (record["state"], record["cancelled_by"], record["exit_code"]) == (
        "cancelled", "alice", 1)
    with pytest.raises(deepnex.FailedPreconditionError,
                       match=f'job "{j.name}" already ended: cancelled'):
        c["alice"].cancel_job(j.name)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_a_job_waiting_in_the_queue_and_withdraws_its_request(
        central, tmp_path, signum):
    """`deepnex run --central` ignored Ctrl-C and SIGTERM while its request
    waited in central's queue (the start held the main thread until a grant)
    and printed nothing meanwhile."""
    address = central()
    c = clients(address)
    holder = holding_both_gpus(central, address, tmp_path / "gate")
    waiting = central.run(address, ["--workers", "2", "--gpus-per-worker", "1"], ["echo", "ran"])
    waiting.await_line(rf"^deepnex run: job {waiting.name}: queued at position 1: waiting for "
                       r"1 exclusive GPU")
    waiting.proc.send_signal(signum)
    assert waiting.wait(60) == 128 + signum, waiting.output()
    assert (f"deepnex run: job {waiting.name} stopped by {signal.Signals(signum).name}; "
            "everything released") in waiting.lines, waiting.output()
    assert not any("ran" in line for line in waiting.lines)
    assert c["alice"].pending() == []
    done = c["alice"].job(waiting.name)
    assert (done["state"], done["exit_code"], done["message"]) == (
        "cancelled", 128 + signum, f"stopped by {signal.Signals(signum).name}")
    # What it withdrew is not granted later: the holder's GPUs go back free.
    (tmp_path / "gate").write_text("")
    assert holder.wait(60) == 0, holder.output()
    assert c["alice"].allocations() == []


def test_a_waiting_job_is_pending_and_cancelling_it_withdraws_its_request(central, tmp_path):
    address = central()
    c = clients(address)
    holder = holding_both_gpus(central, address, tmp_path / "gate")
    waiting = central.run(address, ["--workers", "1", "--gpus-per-worker", "1"], ["echo", "ran"])
    wait_for(lambda: [x["name"] for x in c["alice"].jobs(state="pending")] == [waiting.name],
             "the second job to wait")
    # The runner registers its job before it asks for the allocation.
    wait_for(lambda: len(c["alice"].pending()) == 1, "the second job's request in the queue")
    row = run_cli("jobs", "--state", "pending", "--central", address).stdout.splitlines()[1]
    assert row.split()[:4] == [waiting.name, "alice", "pending", "-"]
    assert run_cli("job", "cancel", waiting.name, "--central", address).returncode == 0
    assert waiting.wait(60) == 1, waiting.output()
    assert f"job {waiting.name} was cancelled by alice through deepnex-central" in (
        waiting.output())
    assert not any("ran" in line for line in waiting.lines)
    assert c["alice"].pending() == []
    assert state_of(c["alice"], waiting.name) == "cancelled"
    assert state_of(c["alice"], holder.name) == "running"


def test_a_waiting_job_rides_out_a_central_restart(central):
    """Central keeps its queue in memory: a restart dropped a waiting job's
    request, and its `deepnex run` died with "Socket closed"."""
    address = central()
    alice = clients(address)["alice"]
    held = alice.allocate(deepnex.gpu.Request(user="alice", gpus=2, cpus=1, memory="64MiB"))
    waiting = central.run(address, ["--workers", "1", "--gpus-per-worker", "1"], ["echo", "ran"])
    wait_for(lambda: len(alice.pending()) == 1, "the job's request in the queue")
    killed = central.procs[-1]
    killed.kill()
    killed.wait()
    assert central("--listen", address) == address
    alice = clients(address)["alice"]
    alice.release(held.id)  # kept across the restart, as every grant
    assert waiting.wait(120) == 0, waiting.output()
    assert "[worker 0] ran" in waiting.output()
    assert state_of(alice, waiting.name) == "completed"
    assert alice.allocations() == []


def test_a_worker_restart_is_in_the_record(central, tmp_path):
    address = central()
    alice = clients(address)["alice"]
    marker = tmp_path / "failed-once"
    j = central.run(address, ["--workers", "1", "--restart", "on-failure:1"],
                    ["sh", "-c", f"[ -e {marker} ] || {{ touch {marker}; exit 5; }}; "
                                 f"while [ ! -e {tmp_path / 'gate'} ]; do sleep 0.05; done"])
    wait_for(lambda: record(alice, j.name).get("restarts") == 1, "the restart reported")
    [worker] = alice.job(j.name)["containers"]
    assert (worker["restarts"], worker["last_exit"]) == (1, "exited(5)")
    (tmp_path / "gate").write_text("")
    assert j.wait(60) == 0, j.output()
    assert alice.job(j.name)["state"] == "completed"


def test_a_job_whose_runner_dies_fails_as_lost_and_a_waiting_one_stays_pending(
        central, tmp_path):
    # Runners report every 2 s: a timeout of 5 s leaves a loaded machine room
    # (with 1 s every waiting job would turn lost between its reports).
    address = central("--job-runner-timeout", "5")
    alice = clients(address)["alice"]
    holder = holding_both_gpus(central, address, tmp_path / "gate")
    waiting = central.run(address, ["--workers", "1", "--gpus-per-worker", "1"], ["true"])
    wait_for(lambda: state_of(alice, waiting.name) == "pending", "the second job to wait")
    holder.proc.send_signal(signal.SIGKILL)
    wait_for(lambda: state_of(alice, holder.name) == "failed", "the job to fail as lost")
    record = alice.job(holder.name)
    assert (record["lost"], record["exit_code"], record["message"]) == (
        True, 1, "lost: its runner did not report for 5 s")
    # The waiting one's runner keeps saying it waits.
    submitted = alice.job(waiting.name)["submitted_ms"] / 1000.0
    wait_for(lambda: time.time() > submitted + 11, "two timeouts past the waiting job's submission",
             timeout=60)
    record = alice.job(waiting.name)
    assert (record["state"], record["lost"]) == ("pending", False)


def test_central_killed_mid_job_keeps_its_record_and_the_history(central, tmp_path):
    address = central()
    c = clients(address)
    first = central.run(address, ["--workers", "1"], ["true"])
    assert first.wait(60) == 0, first.output()
    gate = tmp_path / "gate"
    j = central.run(address, ["--workers", "1", "--gpus-per-worker", "2"], gated(gate))
    j.await_line(r"^\[worker 0\] up")
    wait_for(lambda: state_of(c["alice"], j.name) == "running", "the job to run")
    before = c["alice"].job(j.name)

    central.procs[0].send_signal(signal.SIGKILL)
    central.procs[0].wait()
    # The same port, so that the runner's reports reach the new one.
    port = address.rsplit(":", 1)[1]
    assert central("--listen", f"127.0.0.1:{port}") == address
    c = clients(address)
    kept = c["alice"].job(j.name)
    assert (kept["state"], kept["started_ms"], kept["allocations"]) == (
        "running", before["started_ms"], before["allocations"])
    assert c["alice"].job(first.name)["state"] == "completed"

    gate.write_text("")
    assert j.wait(60) == 0, j.output()
    done = wait_for(lambda: [x for x in c["alice"].jobs(all=True)
                             if x["name"] == j.name and x["state"] == "completed"],
                    "the job's end recorded")[0]
    elapsed = (done["ended_ms"] - done["started_ms"]) / 1000.0
    assert done["gpu_hours"] == 2 * elapsed / 3600.0
    assert c["alice"].allocations() == []


def test_history_keeps_the_newest_by_count(central):
    address = central("--job-history-count", "2")
    c = clients(address)
    names = []
    for _ in range(3):
        j = central.run(address, ["--workers", "1"], ["true"])
        assert j.wait(60) == 0, j.output()
        names.append(j.name)
    assert [x["name"] for x in c["alice"].jobs(all=True)] == names[1:]


def test_bad_filters_and_names_are_named(central):
    address = central()
    out = run_cli("jobs", "--state", "done", "--central", address)
    assert (out.returncode, out.stderr) == (
        1, "deepnex: --state 'done' is not one of pending, running, completed, failed, "
           "cancelled\n")
    # inf and 1e16 were tracebacks (an OverflowError, a pybind mismatch).
    for bad in ("yesterday", "inf", "nan", "1e16", "-5", "0"):
        out = run_cli("jobs", "--since", bad, "--central", address)
        assert (out.returncode, out.stderr) == (
            1, f"deepnex: --since '{bad}': expected a time (YYYY-MM-DD[THH:MM[:SS]] or seconds "
               "since the epoch, before the year 10000) or an age (30m, 2h, 7d)\n")
    out = run_cli("job", "show", "nosuch", "--central", address)
    assert (out.returncode, out.stderr) == (1, 'deepnex: job "nosuch" not found\n')
    alice = clients(address)["alice"]
    with pytest.raises(deepnex.InvalidArgumentError,
                       match='state: "done" is not pending, running, completed, failed or '
                             'cancelled'):
        alice.jobs(state="done")
    for bad in (-1, float("inf"), 1e16, True):
        with pytest.raises(deepnex.InvalidArgumentError,
                           match=re.escape(f"since: {bad!r} is not a datetime")):
            alice.jobs(since=bad)
    assert run_cli("jobs", "--since", "2h", "--central", address).returncode == 0
    bad = subprocess.run([CENTRAL_BIN, "--job-history-count", "-1"], capture_output=True,
                         text=True, timeout=30)
    assert (bad.returncode, bad.stderr) == (
        2, "deepnex-central: --job-history-count: -1 is below 0 (see --help)\n")
    # Past an int it is out of range; it said "not an integer".
    bad = subprocess.run([CENTRAL_BIN, "--job-history-count", "99999999999"],
                         capture_output=True, text=True, timeout=30)
    assert (bad.returncode, bad.stderr) == (
        2, "deepnex-central: --job-history-count: 99999999999 is out of range (see --help)\n")
    bad = subprocess.run([CENTRAL_BIN, "--job-history-bytes", "lots"], capture_output=True,
                         text=True, timeout=30)
    assert (bad.returncode, bad.stderr) == (
        2, 'deepnex-central: --job-history-bytes: "lots" is not a byte size (no number; write '
           'e.g. "8GiB", "512M" or "4096") (see --help)\n')
