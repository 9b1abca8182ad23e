"""deepnex-central as a subprocess for the tests that need the daemon.

    proc, address = start_central(tmp_path, "--state-dir", str(tmp_path / "state"))
    ...
    stop_central(proc)

Tokens: admintok (root, admin), alicetok (alice), bobtok (bob), and for job
j1 only, j1tok (alice) and j1admintok (root, admin). One node, n1,
with 2 GPUs of 80GiB. Skips the test when the daemon is not built.

start_central_launcher adds a launcher (the central_process and central
fixtures in conftest.py start one); clients and run_cli talk to it.
"""

import os
import subprocess
import sys

import pytest

BUILD_DIR = os.environ.get("DEEPNEX_BUILD_DIR",
                           os.path.join(os.path.dirname(__file__), "..", "..", "build"))
CENTRAL_BIN = os.path.join(BUILD_DIR, "bin", "deepnex-central")
TOKENS = ("admintok root admin\nalicetok alice user\nbobtok bob user\n"
          "j1tok alice user j1\nj1admintok root admin j1\n"
          "librarytok library user\n")


def start_central(tmp_path, *extra, mode="exclusive", cpus=16, memory="64GiB", cwd=None,
                  node="n1", more_tokens=""):
    """deepnex-central listening on 127.0.0.1:0 with `extra` flags and one
    node called `node`, knowing TOKENS and `more_tokens` lines; (its Popen,
    its address)."""
    if not os.path.exists(CENTRAL_BIN):
        pytest.skip(f"{CENTRAL_BIN} not built")
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS + more_tokens)
    nodes = tmp_path / "nodes.json"
    nodes.write_text(f'{{"nodes": [{{"name": "{node}", "cpus": {cpus}, "memory": "{memory}",'
                     f' "mode": "{mode}", "gpus": {{"count": 2, "memory": "80GiB"}}}}]}}')
    proc = subprocess.Popen([os.path.abspath(CENTRAL_BIN), "--listen", "127.0.0.1:0",
                             "--token-file", str(tokens), "--nodes", str(nodes), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    line = proc.stdout.readline()
    if not line.startswith("deepnex-central listening on "):
        proc.kill()
        proc.wait()
        pytest.fail(line + proc.stderr.read())
    return proc, line.split()[3]


def stop_central(proc):
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# The uid:gid that users' containers run as: nobody's when the tests run as
# root (central refuses uid 0), else the tests' own (the only one a
# deepnex-central that is not root can run as).
AS_ROOT = os.geteuid() == 0
USER_IDS = "65534:65534" if AS_ROOT else f"{os.geteuid()}:{os.getegid()}"


def start_central_launcher(tmp_path, *extra, backend="process", state_dir=None, cwd=None,
                           users=("alice", "bob"), more_tokens=""):
    """deepnex-central with a launcher that runs `users`' containers as
    USER_IDS; (process, address)."""
    mappings = [arg for user in users for arg in ("--user", f"{user}={USER_IDS}")]
    return start_central(
        tmp_path, "--launch-backend", backend,
        "--launch-state-dir", state_dir or str(tmp_path / "launch"), *mappings, *extra, cwd=cwd,
        more_tokens=more_tokens)


def clients(address):
    """GPU clients of alice and bob at `address`."""
    from deepnex import gpu
    return (gpu.CentralClient(address, token="alicetok", timeout=10),
            gpu.CentralClient(address, token="bobtok", timeout=10))


def run_cli(*args, token="alicetok"):
    """`python -m deepnex *args` with `token`, outside any launcher state dir."""
    env = dict(os.environ, DEEPNEX_TOKEN=token)
    env.pop("DEEPNEX_STATE_DIR", None)
    return subprocess.run([sys.executable, "-m", "deepnex", *args], env=env, text=True,
                          capture_output=True, timeout=60)
