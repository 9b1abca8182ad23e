"""deepnex run on a 2-node Slurm of simulated hosts (the slurm_two_nodes
fixture: slurmctld on head, slurmd on n1 and n2; tests/launch/slurm.sh and
tests/python/_hosts.py). `deepnex run` itself runs on head, as on a login
node; its workers and parameter servers land on n1 and n2 and must reach
each other and head over 10.77.0.0/24. Skips without root, Slurm or munge."""

import os
import re
import subprocess
import sys

import pytest

from _wait import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable


def test_a_step_runs_on_each_node(slurm_two_nodes):
    hosts, env = slurm_two_nodes
    r = hosts.run("head", ["srun", "-N2", "--gres=gpu:2", "sh", "-c",
                           'echo "$(hostname) $CUDA_VISIBLE_DEVICES"'], env=env, timeout=60)
    assert sorted(r.stdout.splitlines()) == ["n1 0,1", "n2 0,1"]


def deepnex_run(hosts, env, *flags, epochs=6, timeout=120):
    """`deepnex run --backend slurm FLAGS -- <digits>` on head, each worker
    first printing its rank and hostname; (exit code, output)."""
    script = os.path.join(ROOT, "examples", "digits", "mlp_numpy.py")
    worker = f'echo "rank $DEEPNEX_RANK on $(hostname)"; exec {PY} {script} --epochs {epochs}'
    p = hosts.popen("head", [PY, "-m", "deepnex", "run", "--backend", "slurm", *flags,
                             "--", "sh", "-c", worker],
                    env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        out, _ = p.communicate(timeout=60)
        pytest.fail(f"deepnex run {' '.join(flags)} hung:\n{out}")
    return p.returncode, out


@pytest.mark.parametrize("mode,ps", [("sync", "1"), ("allreduce", "0")])
def test_digits_trains_with_workers_on_both_nodes(slurm_two_nodes, mode, ps):
    hosts, env = slurm_two_nodes
    code, out = deepnex_run(hosts, env, "--nodes", "2", "--workers", "2", "--ps", ps,
                            "--mode", mode, "--lr", "0.1", "--momentum", "0.9")
    assert code == 0, out
    placed = dict(re.findall(r"^\[worker \d+\] rank (\d+) on (\S+)$", out, re.M))
    assert placed == {"0": "n1", "1": "n2"}, out
    acc = float(re.search(r"summary: .* test_accuracy=([0-9.]+)", out).group(1))
    assert acc >= 0.9, out


LOSABLE = """
import os, socket, sys, time
from deepnex import collective
rank, gate = os.environ["DEEPNEX_RANK"], sys.argv[1]
store = os.environ["DEEPNEX_STORE_ADDR"]
kw = dict(prefix=os.environ["DEEPNEX_JOB_ID"], token=os.environ.get("DEEPNEX_TOKEN"))
print(f"rank {rank} on {socket.gethostname()}", flush=True)
if rank == "1" and not os.path.exists(gate + ".lost"):
    open(gate + ".1", "w").close()       # the test cuts n2 off now
    while not os.path.exists(gate):
        time.sleep(0.01)
    try:
        collective.StoreClient(store, timeout=3, **kw).set("back", "1")
        print("not partitioned", flush=True)
    except (TimeoutError, ConnectionError) as e:
        print(f"lost {type(e).__name__}", flush=True)
    open(gate + ".lost", "w").close()
    sys.exit(1)
c = collective.StoreClient(store, timeout=60, **kw)
if rank == "1":
    c.set("back", "1")
else:
    c.get("back", timeout=90)            # from worker 1 once it is back
print(f"rank {rank} done", flush=True)
"""


def test_a_worker_lost_with_its_host_restarts_there_once_healed(slurm_two_nodes, tmp_path):
    """Worker 1's host n2 is cut off: its calls to the job's store on head
    fail and it exits 1. Once n2 is healed Slurm hears of the exit, and
    --restart on-failure:1 starts worker 1 again on n2, which finishes."""
    hosts, env = slurm_two_nodes
    gate = str(tmp_path / "partitioned")
    p = hosts.popen("head", [PY, "-m", "deepnex", "run", "--backend", "slurm", "--nodes", "2",
                             "--workers", "2", "--ps", "0", "--mode", "allreduce",
                             "--restart", "on-failure:1", "--", PY, "-c", LOSABLE, gate],
                    env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True)
    try:
        wait_for(lambda: os.path.exists(gate + ".1") or p.poll() is not None,
                 "worker 1 at the gate")
        hosts.partition("n2")
        open(gate, "w").close()
        wait_for(lambda: os.path.exists(gate + ".lost") or p.poll() is not None,
                 "worker 1 to give up")
        hosts.heal()
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.terminate()
            p.communicate(timeout=60)
    assert p.returncode == 0, out
    assert re.search(r"^\[worker 1\] lost (DeadlineExceededError|UnavailableError)$", out, re.M), out
    assert "worker 1 exited(1); restarting (1/1)" in out, out
    assert re.findall(r"^\[worker 1\] rank 1 on (\S+)$", out, re.M) == ["n2", "n2"], out
    assert "[worker 0] rank 0 done" in out and "[worker 1] rank 1 done" in out, out


def test_a_worker_slurm_holds_pending_is_told_with_slurms_reason(slurm_two_nodes):
    """Behind a job deepnex did not submit, holding every GPU, worker 0 is
    PENDING: deepnex run says so with Slurm's reason (it said nothing
    while it waited), and the worker runs once the GPUs are free."""
    import threading
    hosts, env = slurm_two_nodes
    # --output: its slurm-N.out went to the checkout's top directory.
    holder = hosts.run("head", ["sbatch", "--parsable", "-N2", "--gres=gpu:2",
                                "--output=/dev/null", "--wrap", "sleep 300"], env=env).stdout.strip().split(";")[0]
    try:
        wait_for(lambda: hosts.run("head", ["squeue", "-h", "-j", holder, "-o", "%T"],
                                   env=env).stdout.strip() == "RUNNING", "the holder to run")
        p = hosts.popen("head", [PY, "-m", "deepnex", "run", "--backend", "slurm",
                                 "--workers", "1", "--ps", "0", "--mode", "allreduce",
                                 "--gpus-per-worker", "1", "--", "sh", "-c", "echo ran"],
                        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True)
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
        reader.start()
        try:
            told = "deepnex run: worker 0 is PENDING in Slurm's queue (Resources)\n"
            wait_for(lambda: told in lines or p.poll() is not None, lambda: "".join(lines))
            assert told in lines, "".join(lines)
            hosts.run("head", ["scancel", holder], env=env)
            assert p.wait(timeout=120) == 0, "".join(lines)
        finally:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=60)
            reader.join(timeout=60)
        out = "".join(lines)
        assert "[worker 0] ran" in out, out
        assert out.count(told) == 1, out
    finally:
        hosts.run("head", ["scancel", holder], env=env, check=False)
