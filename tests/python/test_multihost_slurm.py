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
