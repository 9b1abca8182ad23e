"""deepnex-central as a subprocess for the tests that need the daemon.

    proc, address = start_central(tmp_path, "--state-dir", str(tmp_path / "state"))
    ...
    stop_central(proc)

Tokens: admintok (root, admin), alicetok (alice), bobtok (bob). One node, n1,
with 2 GPUs of 80GiB. Skips the test when the daemon is not built.
"""

import os
import subprocess

import pytest

BUILD_DIR = os.environ.get("DEEPNEX_BUILD_DIR",
                           os.path.join(os.path.dirname(__file__), "..", "..", "build"))
CENTRAL_BIN = os.path.join(BUILD_DIR, "bin", "deepnex-central")
TOKENS = "admintok root admin\nalicetok alice user\nbobtok bob user\n"


def start_central(tmp_path, *extra, mode="exclusive", cpus=16, memory="64GiB", cwd=None,
                  node="n1"):
    """deepnex-central listening on 127.0.0.1:0 with `extra` flags and one
    node called `node`; (its Popen, its address)."""
    if not os.path.exists(CENTRAL_BIN):
        pytest.skip(f"{CENTRAL_BIN} not built")
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
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
