"""deepnex run / deepnex.job: a real job on this machine (local allocator,
process backend, deepnex-ps servers), its faults and its signals.

Each job runs as a `python3 -m deepnex run` subprocess with a private
DEEPNEX_RUN_DIR; processes are found through /proc by the job's variables.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

import deepnex
from _central import start_central, stop_central
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

    def __init__(self, tmp_path, args, command, name=None, env=None, cli=("-m", "deepnex")):
        self.name = name or "t" + uuid.uuid4().hex[:10]
        env = dict(os.environ if env is None else env, DEEPNEX_RUN_DIR=str(tmp_path / "run"),
                   PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, *cli, "run", "--name", self.name] + args + ["--"] + command,
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

    def start(args, command, **kwargs):
        j = RunningJob(tmp_path, args, command, **kwargs)
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


def test_the_servers_get_the_lr_given_exactly_and_an_lr_of_0(jobs):
    """The servers' --lr was cut to six digits (0.0012345678 became
    0.00123457), and `deepnex run` refused an lr of 0 that deepnex-ps takes.
    Without --lr the servers take their optimizer's own (adam's 0.001: it
    was sgd's 0.01 for every optimizer)."""
    for flags, lr in ((["--lr", "0.0012345678"], b"0.0012345678"), (["--lr", "0"], b"0"),
                      (["--optimizer", "adam"], None)):
        j = jobs(["--workers", "1", "--mode", "sync", *flags], ["sleep", "60"])
        wait_for(lambda: ps_server_pids(j.name), "the job's parameter server")
        command = _cmdline(ps_server_pids(j.name)[0])
        assert (command[command.index(b"--lr") + 1] if b"--lr" in command else None) == lr, \
            command
        j.proc.send_signal(signal.SIGINT)
        j.wait(60)


def test_the_job_exit_code_is_the_failing_workers(jobs):
    j = jobs(["--workers", "2", "--mode", "allreduce"],
             ["sh", "-c", 'if [ "$DEEPNEX_RANK" = 1 ]; then exit 7; fi; sleep 60'])
    assert j.wait(60) == 7, j.output()
    # The workers' other processes were killed, not waited for: they vanish
    # a moment later.
    wait_for(lambda: job_processes(j.name) == [], "the job's processes to end")


def test_long_lines_of_two_workers_into_a_pipe_read_late_stay_whole(tmp_path):
    """Two workers' 3 MB lines into a pipe that was read late (`deepnex run
    ... | tee log` behind a slow disk) came out in 32 KiB pieces, most of them
    without their "[worker N]": the job's threads' writes interleaved (probe)."""
    name = "t" + uuid.uuid4().hex[:10]
    worker = ("import os, sys; r = os.environ['RANK']; sys.stdout.write(r * 3000000 + '\\n'); "
              f"sys.stdout.flush(); open(os.path.join({str(tmp_path)!r}, 'done' + r), 'w')")
    p = subprocess.Popen(
        [sys.executable, "-m", "deepnex", "run", "--name", name, "--workers", "2", "--mode",
         "allreduce", "--", sys.executable, "-c", worker],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path),
        env=dict(os.environ, DEEPNEX_RUN_DIR=str(tmp_path / "run")))
    try:
        # Nothing is read until both have written: the job's writes of both
        # lines wait on the full pipe together.
        wait_for(lambda: (tmp_path / "done0").exists() and (tmp_path / "done1").exists(),
                 "both workers' lines written")
        time.sleep(1)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        with deepnex.launch.Launcher("process") as sweeper:
            sweeper.cleanup(name)
    assert p.returncode == 0, out[-2000:]
    lines = out.splitlines()
    pieces = [line for line in lines if not line.startswith("deepnex run: ")]
    # Shown in pieces of at most 1 MiB, each with its worker's prefix.
    bad = [line[:40] for line in pieces if not re.fullmatch(r"\[worker (0\] 0+|1\] 1+)", line)]
    assert not bad, bad
    assert [sum(len(line) - 11 for line in pieces if line.startswith(f"[worker {r}]"))
            for r in "01"] == [3000000, 3000000]


# SIGHUP: a closed terminal left the job running (probe).
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
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
    assert j.lines[-1] == (f"deepnex run: job {j.name} stopped by {signal.Signals(signum).name}; "
                           "everything released"), j.output()
    # Its own stop is no worker "stopped from outside the job" (probe).
    assert not [line for line in j.lines if "from outside the job" in line], j.output()
    wait_for(lambda: job_processes(j.name) == [], "the job's processes to end")
    assert not os.path.exists(tmp_path / "run" / j.name)


def test_a_killed_run_leaves_nothing_behind(jobs, tmp_path):
    """A `deepnex run` killed by SIGKILL (or the OOM killer) left its workers,
    a daemon of theirs and its parameter server running for ever, outside
    any allocation, and a new run of its name failed on their cgroups (probe)."""
    j = jobs(["--workers", "2", "--mode", "sync"],
             ["sh", "-c", "echo up; setsid sleep 600 </dev/null >/dev/null 2>&1 & sleep 600"])
    j.await_line(r"^\[worker 1\] up")
    wait_for(lambda: len(job_processes(j.name)) >= 5,  # ps0, 2 x (sh + 2 sleeps)
             lambda: f"5 processes of the job, saw {job_processes(j.name)}")
    j.proc.kill()
    assert j.wait(60) == -signal.SIGKILL
    wait_for(lambda: job_processes(j.name) == [], "the killed run's processes to end")
    again = jobs(["--workers", "1", "--mode", "allreduce"], ["echo", "again"], name=j.name)
    assert again.wait(60) == 0, again.output()
    assert "[worker 0] again" in again.lines, again.output()


def test_a_second_signal_after_the_stop_keeps_the_first_ones_code(jobs):
    """A Ctrl-C just after a SIGTERM's stop, once deepnex run had put the old
    handlers back, took its default action: exit 130, where the run had said
    "stopped by SIGTERM" (probe). Here it comes as the run returns."""
    j = jobs(["--workers", "1", "--mode", "allreduce"], ["sh", "-c", "echo up; sleep 600"],
             cli=("-c", "import os, signal, sys; from deepnex.__main__ import main; "
                        "code = main(sys.argv[1:]); os.kill(os.getpid(), signal.SIGINT); "
                        "sys.exit(code)"))
    j.await_line(r"^\[worker 0\] up")
    j.proc.send_signal(signal.SIGTERM)
    assert j.wait(60) == 128 + signal.SIGTERM, j.output()
    assert j.lines[-1] == f"deepnex run: job {j.name} stopped by SIGTERM; everything released"


def test_nohup_keeps_the_job_through_a_hangup(jobs, tmp_path):
    """An ignored SIGHUP (`nohup deepnex run`) stays ignored: the job runs
    on to its own end."""
    j = jobs(["--workers", "1", "--mode", "allreduce"],
             ["sh", "-c", f"echo up; while [ ! -e {tmp_path}/gate ]; do sleep 0.05; done"],
             cli=("-c", "import signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
                        "from deepnex.__main__ import main; sys.exit(main(sys.argv[1:]))"))
    j.await_line(r"^\[worker 0\] up")

    def mask(field):
        with open(f"/proc/{j.proc.pid}/status") as f:
            line = next(x for x in f if x.startswith(field + ":"))
        return int(line.split()[1], 16)
    # Still ignored by the kernel once the job runs, not caught by deepnex run.
    bit = 1 << (signal.SIGHUP - 1)
    assert mask("SigIgn") & bit and not mask("SigCgt") & bit
    j.proc.send_signal(signal.SIGHUP)
    (tmp_path / "gate").write_text("")
    assert j.wait(60) == 0, j.output()
    assert not [line for line in j.lines if "stopped by" in line], j.output()


# `deepnex run` whose first wait for the job first drops a weakref, whose
# callback gets a SIGTERM: its handler runs inside that callback, where Python
# drops what it raises (as threading's own weakref callbacks did in CI).
SIGNAL_IN_A_WEAKREF_CALLBACK = """
import os, signal, sys, weakref
from deepnex import __main__ as cli, job

def signal_myself(_):
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):  # the handler runs at one of these jumps back
        pass

wait = job.Job.wait

def wait_after_a_signal_in_a_callback(self, timeout=None):
    class Thing:
        pass
    thing = Thing()
    ref = weakref.ref(thing, signal_myself)
    del thing
    return wait(self, timeout)

job.Job.wait = wait_after_a_signal_in_a_callback
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_signal_handled_inside_a_callback_still_stops_the_job(jobs, tmp_path):
    """CI: SIGTERM's handler stopped the job and raised KeyboardInterrupt;
    run inside one of threading's weakref callbacks, the exception was
    dropped, and the job ended as if by itself (exit 143 by chance, and no
    "everything released")."""
    j = jobs(["--workers", "1", "--mode", "sync"], ["sleep", "600"],
             cli=("-c", SIGNAL_IN_A_WEAKREF_CALLBACK))
    assert j.wait(60) == 128 + signal.SIGTERM, j.output()
    assert j.lines[-1] == f"deepnex run: job {j.name} stopped by SIGTERM; everything released"
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
    assert "deepnex run: worker 1 signaled(SIGKILL); restarting (1/3) in 1.0s" in j.lines, \
        j.output()
    assert "deepnex run: worker 1: exited(0) after 1 restart" in j.lines, j.output()


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
    # An argument of bytes the locale does not decode (os.fsencode's
    # b"caf\xe9") was "not a value of this option's type".
    j = jobs(["--mode", "allreduce"], ["/bin/echo", "caf\udce9"])
    assert j.wait(60) == 2
    assert "command: 'caf\\udce9' is not UTF-8 text" in j.output(), j.output()
    # Central grants only what is asked: a job without --memory allocated,
    # then failed naming spec.memory (or first waited in the queue).
    j = jobs(["--central", "127.0.0.1:1", "--token", "x"], ["true"])
    assert j.wait(60) == 2
    assert "memory (--memory): required with central" in j.output(), j.output()


def test_a_second_run_of_one_name_says_so(jobs):
    """A new user's two runs of one --name: the second failed naming a
    launcher state directory in use by a pid."""
    first = jobs(["--mode", "allreduce"], ["sh", "-c", "echo up; sleep 60"])
    first.await_line(r"^\[worker 0\] up$")
    second = jobs(["--mode", "allreduce"], ["true"], name=first.name)
    assert second.wait(60) != 0
    assert (f"job {first.name}: another deepnex run of this name is running (launcher "
            "state_dir ") in second.output(), second.output()
    assert "give this one another name" in second.output(), second.output()
    first.proc.terminate()
    first.wait(60)


def test_a_relative_workdir_is_the_current_directorys(jobs, tmp_path):
    """--workdir sub was refused naming spec.working_dir, where
    --checkpoint-dir and --state-dir take relative paths."""
    (tmp_path / "sub").mkdir()  # deepnex run runs in tmp_path
    j = jobs(["--workdir", "sub", "--mode", "allreduce"], ["pwd"])
    assert j.wait(60) == 0, j.output()
    assert f"[worker 0] {tmp_path}/sub\n" in j.output(), j.output()
    j = jobs(["--workdir", "~", "--mode", "allreduce"], ["pwd"])  # the shell's ~, not ./~
    assert j.wait(60) == 0, j.output()
    assert f"[worker 0] {os.path.expanduser('~')}\n" in j.output(), j.output()
    # One that is not there is said by its flag (it read spec.working_dir),
    # before anything starts.
    j = jobs(["--workdir", "missing", "--mode", "allreduce"], ["pwd"])
    assert j.wait(60) == 2, j.output()
    assert j.output() == (f'deepnex run: working_dir (--workdir): "{tmp_path}/missing" is not '
                          "a directory on this host"), j.output()


def test_a_relative_working_dir_in_python_is_the_current_directorys(tmp_path, monkeypatch):
    """deepnex.job took working_dir="sub" and its start then failed naming
    spec.working_dir, "not an absolute path" (probe)."""
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DEEPNEX_RUN_DIR", str(tmp_path / "run"))
    lines = []
    result = deepnex.job.run(["pwd"], mode="allreduce", working_dir="sub",
                             output=lambda who, line: lines.append(line))
    assert (result.exit_code, lines) == (0, [f"{tmp_path}/sub"])


def test_more_workers_than_this_machine_could_ever_hold_are_refused_at_once(jobs):
    """A new user's `deepnex run --workers N` on a machine of fewer cores
    (1 core a worker by default): refused at once, saying how many fit."""
    cpus = deepnex.gpu.local_node().cpus
    j = jobs(["--workers", str(cpus + 1), "--mode", "allreduce"], ["true"])
    assert j.wait(60) == 1
    assert "no set of nodes can ever hold this request (" in j.output(), j.output()
    assert f" asks {cpus + 1} x (0 exclusive GPUs, 1 cpus, " in j.output(), j.output()
    assert f"hold at most {cpus} of its {cpus + 1} parts at once" in j.output(), j.output()


def test_job_run_from_python(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPNEX_RUN_DIR", str(tmp_path / "run"))
    lines = []
    result = deepnex.job.run(["sh", "-c", "echo rank $DEEPNEX_RANK"], workers=2, mode="allreduce",
                             output=lambda who, line: lines.append((who, line)))
    assert result.exit_code == 0
    assert [e.reason for e in result.workers] == ["exited", "exited"]
    assert sorted(lines) == [("worker 0", "rank 0"), ("worker 1", "rank 1")]


def test_restarts_are_told_as_they_happen_and_spelt_as_exit_statuses(jobs, tmp_path):
    # Worker 1's first run is killed, its second exits 1, its third waits
    # for the gate and succeeds.
    gate, killed, failed = (tmp_path / n for n in ("gate", "killed", "failed"))
    script = (f'if [ "$DEEPNEX_RANK" = 0 ]; then exit 0; fi; '
              f'if [ ! -e {killed} ]; then touch {killed}; kill -KILL $$; fi; '
              f'if [ ! -e {failed} ]; then touch {failed}; exit 1; fi; '
              f'while [ ! -e {gate} ]; do sleep 0.05; done')
    j = jobs(["--workers", "2", "--mode", "allreduce", "--restart", "on-failure:3"],
             ["sh", "-c", script])
    j.await_line(r"^deepnex run: worker 1 exited\(1\); restarting \(2/3\) in 2\.0s$")
    assert j.proc.poll() is None  # told while the job runs, not in its summary
    restarts = [line for line in j.lines if "restarting" in line]
    assert restarts == ["deepnex run: worker 1 signaled(SIGKILL); restarting (1/3) in 1.0s",
                        "deepnex run: worker 1 exited(1); restarting (2/3) in 2.0s"]
    gate.write_text("")
    assert j.wait(60) == 0, j.output()
    assert "deepnex run: worker 0: exited(0)" in j.lines, j.output()
    assert "deepnex run: worker 1: exited(0) after 2 restarts" in j.lines, j.output()


def test_a_worker_killed_for_good_is_summarised_by_signal_name(jobs):
    j = jobs(["--mode", "allreduce"], ["sh", "-c", "kill -KILL $$"])
    assert j.wait(60) == 128 + signal.SIGKILL, j.output()
    assert "deepnex run: worker 0: signaled(SIGKILL)" in j.lines, j.output()


def test_a_reused_state_dir_does_not_replay_the_last_runs_logs(jobs, tmp_path):
    state = tmp_path / "state"
    name = "t" + uuid.uuid4().hex[:10]
    first = jobs(["--mode", "sync", "--state-dir", str(state)],
                 ["sh", "-c", "echo first run"], name=name)
    assert first.wait(60) == 0, first.output()
    assert "[worker 0] first run" in first.lines
    # Containers are named by their job.
    assert sorted(os.listdir(state / "containers")) == [f"{name}-ps0", f"{name}-worker0"]
    second = jobs(["--mode", "sync", "--state-dir", str(state)],
                  ["sh", "-c", "echo second run"], name=name)
    assert second.wait(60) == 0, second.output()
    assert "[worker 0] second run" in second.lines
    assert not [line for line in second.lines if "first run" in line], second.output()
    # One deepnex-ps start, this run's.
    assert len([line for line in second.lines if "deepnex-ps listening on" in line]) == 1


def test_torchrun_names_local_world_size_and_omp_threads(jobs):
    show = ["sh", "-c", "echo local=$LOCAL_RANK/$LOCAL_WORLD_SIZE omp=$OMP_NUM_THREADS"]
    unset = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    j = jobs(["--nproc-per-node", "2", "--mode", "allreduce", "--cpus", "1"], show, env=unset)
    assert j.wait(60) == 0, j.output()
    assert sorted(line for line in j.lines if "local=" in line) == [
        "[worker 0] local=0/2 omp=1", "[worker 1] local=1/2 omp=1"]
    # A user's own OMP_NUM_THREADS stays.
    j = jobs(["--workers", "1", "--mode", "allreduce"], show,
             env=dict(os.environ, OMP_NUM_THREADS="3"))
    assert j.wait(60) == 0, j.output()
    assert "[worker 0] local=0/1 omp=3" in j.lines, j.output()
    if (os.cpu_count() or 1) < 2:
        pytest.skip("a worker with 2 cores needs 2 cores")
    j = jobs(["--workers", "1", "--mode", "allreduce", "--cpus", "2"], show, env=unset)
    assert j.wait(60) == 0, j.output()
    assert "[worker 0] local=0/1 omp=2" in j.lines, j.output()


def test_the_elastic_timeout_of_the_callers_environment_reaches_the_workers(jobs):
    """A probe's DEEPNEX_ELASTIC_TIMEOUT=8 (the knob the docs name) was
    dropped with the job's own DEEPNEX_ variables; the job's id was not
    taken from the caller."""
    show = [sys.executable, "-c", "import os; print('timeout', "
            "os.environ.get('DEEPNEX_ELASTIC_TIMEOUT'), os.environ['DEEPNEX_JOB_ID'])"]
    j = jobs(["--workers", "1:2", "--mode", "allreduce"], show,
             env=dict(os.environ, DEEPNEX_ELASTIC_TIMEOUT="8", DEEPNEX_JOB_ID="forged"))
    assert j.wait(60) == 0, j.output()
    assert [line.split()[-2:] for line in j.lines if " timeout " in line] == [["8", j.name]], \
        j.output()


def test_the_ps_token_is_in_its_environment_not_on_its_command_line(jobs, tmp_path):
    gate = tmp_path / "gate"
    j = jobs(["--workers", "1", "--mode", "sync"],
             ["sh", "-c", f"echo up; while [ ! -e {gate} ]; do sleep 0.05; done"])
    j.await_line(r"^\[worker 0\] up")
    workers = job_processes(j.name, DEEPNEX_RANK="0")
    assert workers
    worker_env = _environ(workers[0])
    token = worker_env["DEEPNEX_TOKEN"]
    [ps_pid] = ps_server_pids(j.name)
    cmdline = _cmdline(ps_pid)
    assert not [a for a in cmdline if token.encode() in a or a.startswith(b"--token")], cmdline
    assert _environ(ps_pid)["DEEPNEX_TOKEN"] == token
    # And the server holds to it.
    address = worker_env["DEEPNEX_PS_ADDRS"]
    with pytest.raises(deepnex.UnauthenticatedError):
        deepnex.ps.Client([address], worker_id=-1, timeout=10).stats()
    with deepnex.ps.Client([address], worker_id=-1, token=token, timeout=10) as c:
        c.stats()
    gate.write_text("")
    assert j.wait(60) == 0, j.output()


def _cli_parsers():
    import argparse

    from deepnex import _cli_job
    commands = argparse.ArgumentParser().add_subparsers()
    _cli_job.add_commands(commands)
    return commands.choices


def test_every_flag_of_run_and_top_has_help_and_run_names_its_environment():
    for command, parser in _cli_parsers().items():
        for action in parser._actions:
            assert action.help, f"{command} {action.option_strings or action.dest}: no help"
    run = _cli_parsers()["run"]
    text = run.format_help()
    for needle in ("$DEEPNEX_CENTRAL", "$DEEPNEX_TOKEN", "--token-file", "--nproc-per-node",
                   "--mode", "--user"):
        assert needle in text, needle
    args = run.parse_args(["--nproc-per-node", "3", "--", "true"])
    assert args.workers == 3


def test_top_into_a_pipe_prints_screens_one_after_another(tmp_path):
    """Into a pipe, `deepnex top` wrote a terminal's clear-screen codes
    before every screen (probe, session 26)."""
    proc = subprocess.Popen([sys.executable, "-m", "deepnex", "top", "--interval", "0.05",
                             "--run-dir", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    watchdog = threading.Timer(60, proc.kill)  # a silent top fails, not hangs
    watchdog.start()
    try:
        screens = [proc.stdout.readline() for _ in range(6)]
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait(timeout=30)
    assert screens == ["no deepnex jobs running\n", "\n"] * 3


@pytest.fixture
def central(tmp_path):
    """deepnex-central with a token file: alicetok is user alice. Its node is
    this host, where the process backend runs the job."""
    proc, address = start_central(tmp_path, cpus=8, memory="16GiB", node=socket.gethostname())
    yield address
    stop_central(proc)


def test_run_with_central_allocates_as_the_tokens_user(jobs, central, tmp_path):
    alice = deepnex.gpu.CentralClient(central, token="alicetok", timeout=10)
    token_file = tmp_path / "alice.token"
    token_file.write_text("alicetok\n")
    gate = tmp_path / "gate"
    env = {k: v for k, v in os.environ.items() if k != "DEEPNEX_TOKEN"}
    env["USER"] = "root"  # not alice: the token decides
    j = jobs(["--central", central, "--token-file", str(token_file), "--workers", "2",
              "--mode", "allreduce", "--memory", "64MiB"],
             ["sh", "-c", f"echo up; while [ ! -e {gate} ]; do sleep 0.05; done"], env=env)
    j.await_line(r"^\[worker 1\] up")
    assert sorted((a.user, a.job) for a in alice.allocations()) == [("alice", j.name)] * 2
    gate.write_text("")
    assert j.wait(60) == 0, j.output()
    assert alice.allocations() == []  # released


def test_run_with_central_refuses_a_user_that_is_not_the_tokens(jobs, central):
    # The address and token from the environment, as `deepnex run --help` says.
    env = dict(os.environ, DEEPNEX_CENTRAL=central, DEEPNEX_TOKEN="alicetok")
    j = jobs(["--user", "root", "--mode", "allreduce", "--memory", "64MiB"], ["true"], env=env)
    assert j.wait(60) == 1, j.output()
    # Refused when the job registers with central, before it allocates.
    assert "user alice cannot run a job for user root" in j.output()


def test_nodes_are_checked_and_a_this_host_backend_refuses_to_spread(jobs):
    j = jobs(["--workers", "2", "--nodes", "3", "--mode", "allreduce"], ["true"])
    assert j.wait(60) == 2, j.output()
    assert "nodes: 3 is more than the 2 workers to spread over them" in j.output()
    j = jobs(["--workers", "2", "--nodes", "-1", "--mode", "allreduce"], ["true"])
    assert j.wait(60) == 2, j.output()
    assert "nodes: -1 is below 0" in j.output()
    # -1 is the C++ options' "default"; from the command line it is a bad count.
    j = jobs(["--ps", "-1"], ["true"])
    assert j.wait(60) == 2, j.output()
    assert "deepnex run: ps: -1 is below 0" in j.output()
    j = jobs(["--workers", "2", "--nodes", "2", "--mode", "allreduce"], ["true"])
    assert j.wait(60) == 1, j.output()
    assert ("nodes: 2: the process backend runs every container on this host; spreading over "
            "nodes needs a backend that places on them (slurm)") in j.output()
    j = jobs(["--workers", "2", "--nodes", "1", "--mode", "allreduce"], ["true"])
    assert j.wait(60) == 0, j.output()


REACH = [sys.executable, "-c", """
import os, deepnex
ctx = deepnex.init()
deepnex.collective.StoreClient(ctx.store_addr, token=ctx.token, timeout=10).set("k", "v")
deepnex.ps.Client(ctx.ps_addrs, worker_id=-1, token=ctx.token, timeout=10).stats()
print("reached store", ctx.store_addr, "ps", ",".join(ctx.ps_addrs),
      "master", os.environ["MASTER_ADDR"])
"""]


def test_a_local_job_stays_on_loopback(jobs):
    j = jobs(["--workers", "1", "--mode", "sync"], REACH)
    assert j.wait(60) == 0, j.output()
    [line] = [x for x in j.lines if "reached" in x]
    assert re.fullmatch(r"\[worker 0\] reached store 127\.0\.0\.1:\d+ ps 127\.0\.0\.1:\d+ "
                        r"master 127\.0\.0\.1", line), line


def test_advertise_address_is_what_the_workers_dial(jobs):
    # A name works as well as an address: the workers resolve it with the
    # system resolver.
    j = jobs(["--workers", "1", "--mode", "sync", "--advertise-address", "localhost"], REACH)
    assert j.wait(60) == 0, j.output()
    [line] = [x for x in j.lines if "reached" in x]
    assert re.fullmatch(r"\[worker 0\] reached store localhost:\d+ ps localhost:\d+ "
                        r"master localhost", line), line
    # The server listens on every interface and says where to dial it.
    assert any(re.search(r"^\[ps 0\] deepnex-ps listening on localhost:\d+ ", x)
               for x in j.lines), j.output()
    j = jobs(["--advertise-address", "0.0.0.0", "--mode", "allreduce"], ["true"])
    assert j.wait(60) == 2, j.output()
    assert 'advertise_address "0.0.0.0": peers cannot dial a wildcard address' in j.output()


def test_run_with_central_refuses_a_node_that_is_not_this_host(jobs, tmp_path):
    proc, address = start_central(tmp_path, cpus=8, memory="16GiB", node="n1")
    try:
        env = dict(os.environ, DEEPNEX_CENTRAL=address, DEEPNEX_TOKEN="alicetok")
        j = jobs(["--workers", "2", "--mode", "allreduce", "--memory", "64MiB"], ["echo", "ran"],
                 env=env)
        assert j.wait(60) == 1, j.output()
        assert re.search(
            r'worker 0: allocation \S+ is on node "n1", not on this host \("'
            + re.escape(socket.gethostname()) + r'"\), and the process backend runs containers '
            r"on this host only; use a backend that places on nodes \(slurm\) or "
            r"run deepnex run on that node", j.output()), j.output()
        assert not any("ran" in x for x in j.lines), j.output()
        # Nothing held.
        alice = deepnex.gpu.CentralClient(address, token="alicetok", timeout=10)
        assert alice.allocations() == []
    finally:
        stop_central(proc)


def test_nodes_and_advertise_address_from_python(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPNEX_RUN_DIR", str(tmp_path / "run"))
    lines = []
    result = deepnex.job.run(["sh", "-c", "echo $DEEPNEX_STORE_ADDR $MASTER_ADDR"], workers=1,
                             nodes=1, mode="allreduce", advertise_address="localhost",
                             output=lambda who, line: lines.append(line))
    assert result.exit_code == 0
    [line] = lines
    assert re.fullmatch(r"localhost:\d+ localhost", line), line
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        deepnex.job.run(["true"], workers=2, nodes=2, mode="allreduce")
    assert str(e.value).startswith("nodes: 2: the process backend runs every container on this "
                                   "host"), str(e.value)
