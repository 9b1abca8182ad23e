"""deepnex notebook (issue #16): Jupyter in a container on (new) resources,
reached through a local port that deepnex forwards through central. Its REST
API answers with the token and refuses without it, a kernel runs 1+1 over
its websocket channels, and headless chromium renders its page. Skips
without jupyter-notebook (and python3-websocket, chromium where needed)."""

import json
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import zlib

import pytest

from _central import clients
from _wait import wait_for
from deepnex import gpu

PY = sys.executable

if not shutil.which("jupyter-notebook"):
    pytest.skip("no jupyter-notebook (apt-get install jupyter-notebook)", allow_module_level=True)


class Notebook:
    """`deepnex notebook ARGS` as alice, once it printed its URL."""

    def __init__(self, central, *args, timeout=120):
        env = dict(os.environ, DEEPNEX_CENTRAL=central, DEEPNEX_TOKEN="alicetok")
        env.pop("DEEPNEX_STATE_DIR", None)
        self.proc = subprocess.Popen([PY, "-m", "deepnex", "notebook", *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        out = b""
        while b"\n" not in out:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                self.stop()
                raise AssertionError(f"no URL within {timeout} s: {out!r}")
            data = os.read(self.proc.stdout.fileno(), 4096)
            if not data:
                raise AssertionError(f"ended: {out!r} {self.proc.stderr.read()!r}")
            out += data
        self.line = out.decode()
        # "Notebook NAME: http://127.0.0.1:PORT/?token=TOKEN"
        self.url = self.line.split()[2]
        self.port = int(self.url.split(":")[2].split("/")[0])
        self.token = self.url.split("?token=")[1]

    def stop(self):
        """Ctrl-C; (exit code, stderr). A client that does not end in 60 s
        is killed (and the test fails): one left running outlived the test."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        err = self.proc.stderr.read().decode()
        self.proc.stdout.close()
        self.proc.stderr.close()
        return code, err


def call(port, path, token=None, method="GET"):
    """(status, JSON body) of the notebook's REST API."""
    headers = {"Authorization": f"token {token}"} if token else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers,
                                 method=method, data=b"{}" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None


def run_code(port, token, kernel, code, timeout=60):
    """The text/plain of the execute_result of `code` on the kernel's
    websocket channels."""
    import websocket
    ws = websocket.create_connection(
        f"ws://127.0.0.1:{port}/api/kernels/{kernel}/channels?token={token}", timeout=timeout)
    try:
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({
            "header": {"msg_id": msg_id, "username": "alice", "session": uuid.uuid4().hex,
                       "msg_type": "execute_request", "version": "5.3", "date": ""},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": False,
                        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = json.loads(ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "execute_result":
                return msg["content"]["data"]["text/plain"]
            if msg["msg_type"] == "error":
                raise AssertionError(f"{code!r}: {msg['content']}")
        raise AssertionError(f"no execute_result of {code!r} within {timeout} s")
    finally:
        ws.close()


def test_notebook_answers_with_its_token_runs_a_kernel_and_ends_on_ctrl_c(central):
    pytest.importorskip("websocket", reason="no python3-websocket")
    alice, bob = clients(central)
    nb = Notebook(central, "--cpus", "1", "--memory", "1GiB", "--name", "nb")
    try:
        assert nb.line == f"Notebook nb: http://127.0.0.1:{nb.port}/?token={nb.token}\n"
        assert len(nb.token) == 32 and int(nb.token, 16) >= 0
        (info,) = [c for c in alice.containers() if c["name"] == "nb"]
        assert info["state"] == "running"
        assert len(alice.allocations()) == 1
        status, body = call(nb.port, "/api/status", nb.token)
        assert status == 200 and set(body) >= {"started", "kernels", "connections"}
        assert call(nb.port, "/api/status") == (403, None)
        assert call(nb.port, "/api/status", "0" * 32) == (403, None)
        status, kernel = call(nb.port, "/api/kernels", nb.token, method="POST")
        assert status == 201 and kernel["name"] == "python3"
        assert run_code(nb.port, nb.token, kernel["id"], "1+1") == "2"
        # No process shows the token in its arguments, which every user of
        # the host reads in /proc (a process container shares it).
        shown = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if nb.token.encode() in f.read():
                        shown.append(pid)
            except OSError:
                pass
        assert shown == []
        # Only alice reaches her container's port.
        from deepnex import NotFoundError
        from deepnex._session import open_session
        remote = int(alice.container_logs("nb").split("deepnex-notebook: port ")[1].split()[0])
        with pytest.raises(NotFoundError, match='no container "nb" of user bob'):
            open_session(bob._c, "nb", port=remote).read()
    finally:
        code, err = nb.stop()
    assert (code, err) == (0, "")
    # The container stopped and the allocation deepnex made is released.
    assert next(c for c in alice.containers() if c["name"] == "nb")["state"] == "stopped"
    assert alice.allocations() == []


def test_notebook_whose_terminal_closes_still_cleans_up(central):
    """SIGHUP (the terminal closed) ended `deepnex notebook` by its default
    action, with the container running and the allocation held (probe)."""
    alice, _ = clients(central)
    nb = Notebook(central, "--cpus", "1", "--memory", "1GiB", "--name", "nbhup")
    nb.proc.send_signal(signal.SIGHUP)
    try:
        nb.proc.wait(timeout=60)
    finally:
        code, err = nb.stop()
    assert (code, err) == (0, "")
    assert next(c for c in alice.containers() if c["name"] == "nbhup")["state"] == "stopped"
    assert alice.allocations() == []


def test_notebook_ends_when_its_container_does(central):
    """A notebook stopped by `deepnex stop` (or whose jupyter ended) left its
    client forwarding to nothing until Ctrl-C (probe): it ends, saying so,
    and releases the allocation it made."""
    alice, _ = clients(central)
    nb = Notebook(central, "--cpus", "1", "--memory", "1GiB", "--name", "nbgone")
    alice.stop_container("nbgone", grace=1.0)
    try:
        nb.proc.wait(timeout=30)
    finally:
        code, err = nb.stop()
    assert code == 1, err
    assert "notebook nbgone: stopped while forwarding: jupyter ended" in err, err
    assert alice.allocations() == []


def png_pixels(data):
    """(width, height, rows of bytes) of an 8-bit, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and interlace == 0, header
    bpp = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, bpp, rows


def test_notebook_page_in_headless_chromium_and_keep_on_a_given_allocation(central, tmp_path):
    chromium = shutil.which("chromium")
    if not chromium:
        pytest.skip("no chromium (apt-get install chromium)")
    alice, _ = clients(central)
    a = alice.allocate(gpu.Request(user="", gpus=0, cpus=1, memory="1GiB"))
    nb = Notebook(central, "--alloc", a.id, "--keep", "--name", "nbk")
    try:
        keep_checked(alice, nb, a, tmp_path)
    finally:
        # A process container outlives central: stop it here.
        alice.stop_container("nbk", grace=1.0)


def keep_checked(alice, nb, a, tmp_path):
    chromium = shutil.which("chromium")
    try:
        shot = tmp_path / "page.png"
        # The virtual time budget lets the page's scripts draw it before the
        # screenshot (that the load event alone does not wait for).
        r = subprocess.run([chromium, "--headless", "--no-sandbox", f"--screenshot={shot}",
                            "--window-size=1024,768", f"--user-data-dir={tmp_path / 'profile'}",
                            "--virtual-time-budget=10000",
                            nb.url], capture_output=True, timeout=120)
        assert r.returncode == 0 and shot.exists(), r.stderr.decode()[-2000:]
        width, height, bpp, rows = png_pixels(shot.read_bytes())
        assert (width, height) == (1024, 768)
        pixels = {row[i:i + bpp] for row in rows for i in range(0, len(row), bpp)}
        # Not blank: the page's white, its text, the logo's orange and more.
        assert len(pixels) > 10, pixels
    finally:
        code, err = nb.stop()
    assert (code, err) == (0, f"deepnex: kept container nbk on allocation {a.id} "
                              f"(deepnex port-forward nbk {nb_remote(alice)}; "
                              "deepnex stop nbk)\n")
    # Both stay; the local forward is gone.
    assert next(c for c in alice.containers() if c["name"] == "nbk")["state"] == "running"
    assert [x.id for x in alice.allocations()] == [a.id]
    with pytest.raises(OSError):
        call(nb.port, "/api/status", nb.token)
    with alice.port_forward("nbk", nb_remote(alice)) as fwd:
        assert call(fwd.port, "/api/status", nb.token)[0] == 200


def nb_remote(alice, name="nbk"):
    """The port jupyter listens on in container `name`, from its log."""
    return int(alice.container_logs(name).split("deepnex-notebook: port ")[1].split()[0])


def test_notebook_errors(central):
    alice, _ = clients(central)
    env = dict(os.environ, DEEPNEX_CENTRAL=central, DEEPNEX_TOKEN="alicetok")
    env.pop("DEEPNEX_STATE_DIR", None)

    def deepnex(*args):
        return subprocess.run([PY, "-m", "deepnex", "notebook", *args], env=env,
                              capture_output=True, text=True, timeout=60)
    out = deepnex("--alloc", "nosuch")
    assert (out.returncode, out.stdout, out.stderr) == (
        1, "", 'deepnex: allocation "nosuch" does not exist\n')
    out = deepnex("--cpus", "1", "--memory", "256MiB", "--image", "nosuch")
    assert out.returncode == 1 and out.stderr.startswith(
        'deepnex: spec.image: "nosuch" is not an image that user alice may run')
    # The allocation made for it is released.
    assert alice.allocations() == []
    # A local port in use: said, and nothing left behind.
    import socket
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        out = deepnex("--cpus", "1", "--memory", "256MiB", "--name", "busy", "--port", str(port))
    assert (out.returncode, out.stdout, out.stderr) == (
        1, "", f"deepnex: --port {port} on 127.0.0.1: Address already in use\n")
    assert next(c for c in alice.containers() if c["name"] == "busy")["state"] == "stopped"
    assert alice.allocations() == []
    # Jupyter that does not answer in time: stopped, its allocation released.
    # (Its port line may be in the log at the first look, a helper's run
    # found: then it is the answer that the 1 ms runs out on.)
    out = deepnex("--cpus", "1", "--memory", "256MiB", "--name", "slow", "--start-timeout", "0.001")
    assert (out.returncode, out.stdout) == (1, ""), out.stderr
    assert re.fullmatch(r"deepnex: notebook slow: jupyter has not (said its port|answered) "
                        r"within --start-timeout\n", out.stderr), out.stderr
    assert next(c for c in alice.containers() if c["name"] == "slow")["state"] == "stopped"
    assert alice.allocations() == []
