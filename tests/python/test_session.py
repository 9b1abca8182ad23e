"""Sessions with containers on deepnex-central (issue #16): exec (output
streamed, stdin, exit code, as the container's user), a shell on a pseudo-
terminal, and port-forward; locally and through a deepnex-agent on another
simulated host. Another user's container is NotFound."""

import os
import pty
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from _central import AS_ROOT, USER_IDS, clients
from _wait import wait_for
from deepnex import NotFoundError, gpu, launch

PY = sys.executable


def grant(cpus=1, memory="256MiB"):
    return gpu.Request(user="", gpus=1, cpus=cpus, memory=memory)


def start_sleeper(client, name="box", env=None):
    """A running container `name` on a new allocation of the client's."""
    a = client.allocate(grant())
    client.start_container(launch.ContainerSpec(name=name, command=["sleep", "600"],
                                                env=env or {}), a)
    wait_for(lambda: next(c for c in client.containers() if c["name"] == name)["state"]
             == "running", f"{name} running")
    return a


def test_exec_streams_output_takes_stdin_and_returns_the_exit_code(central):
    alice, bob = clients(central)
    start_sleeper(alice, env={"GREETING": "hello"})
    r = alice.exec("box", ["sh", "-c", "echo $GREETING; id -u; cat; echo oops >&2; exit 3"],
                   input=b"from stdin\n")
    assert r == (3, f"hello\n{USER_IDS.split(':')[0]}\nfrom stdin\n".encode(), b"oops\n")
    # Streamed as it comes: the first piece arrives while the command still runs.
    pieces = []
    first = threading.Event()

    def on_output(kind, data):
        pieces.append((kind, data))
        first.set()
    done = []
    t = threading.Thread(target=lambda: done.append(alice.exec(
        "box", ["sh", "-c", "echo one; read x; echo two $x"], input=None, on_output=on_output)))
    # stdin is closed at once: `read` sees EOF.
    t.start()
    assert first.wait(30)
    t.join(30)
    assert done[0].exit_code == 0 and b"".join(d for _, d in pieces) == b"one\ntwo\n"
    # A signal's exit code is 128 + N.
    assert alice.exec("box", ["sh", "-c", "kill -9 $$"]).exit_code == 137


def test_exec_errors(central):
    alice, bob = clients(central)
    start_sleeper(alice)
    with pytest.raises(NotFoundError, match='no container "box" of user bob'):
        bob.exec("box", ["true"])
    with pytest.raises(NotFoundError, match='command "no-such-command"'):
        alice.exec("box", ["no-such-command"])
    from deepnex import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match="command: 'true' is not a non-empty list"):
        alice.exec("box", "true")
