"""Bad and unreachable server addresses fail fast and say why: a malformed
one at once, naming it and the expected form; a closed port within a few
seconds, saying connection refused (the clients and the CLI)."""

import os
import socket
import subprocess
import sys
import time

import pytest

deepnex = pytest.importorskip("deepnex")
from deepnex import _C, collective, gpu, ps  # noqa: E402
from deepnex._convert import options  # noqa: E402

EXPECTED = "expected HOST:PORT (e.g. 127.0.0.1:7070)"
MALFORMED = {
    "http://127.0.0.1:7070": "",
    "127.0.0.1": "no port; ",
    ":70700": "no host; ",
    "127.0.0.1:70700": "port 70700 is not in 1-65535; ",
}
# client name -> (constructor, the field in its errors, the server in its errors)
CLIENTS = {
    "central": (lambda a: gpu.CentralClient(a), "central address", "central"),
    "launch central": (lambda a: _C.launch.CentralClient(options(_C.gpu.CentralClientOptions,
                                                                 address=a)),
                       "central address", "central"),
    "store": (lambda a: collective.StoreClient(a), "store address", "store"),
    "ps": (lambda a: ps.Client([a]), "ps server address", "ps server"),
}


def closed_port():
    """A port the OS considered free a moment ago: nothing listens there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("address", sorted(MALFORMED))
@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_malformed_address_is_refused_at_once(client, address):
    make, field, _ = CLIENTS[client]
    start = time.monotonic()
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        make(address)
    assert time.monotonic() - start < 1.0
    assert str(e.value) == f'{field} "{address}": {MALFORMED[address]}{EXPECTED}'


def test_ps_client_refuses_a_malformed_address_among_servers_before_dialing():
    start = time.monotonic()
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        ps.Client([f"127.0.0.1:{closed_port()}", "127.0.0.1"])
    assert time.monotonic() - start < 1.0
    assert str(e.value) == f'ps server address "127.0.0.1": no port; {EXPECTED}'


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_closed_port_is_unavailable_within_seconds_saying_connection_refused(client):
    make, _, server = CLIENTS[client]
    address = f"127.0.0.1:{closed_port()}"
    start = time.monotonic()
    with pytest.raises(deepnex.UnavailableError) as e:
        make(address)
    assert time.monotonic() - start < 10.0
    message = str(e.value)
    assert message.startswith(f"{server} at {address}: no connection within 5000 ms: "), message
    assert "Connection refused" in message, message


def cli(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("DEEPNEX_CENTRAL", "DEEPNEX_TOKEN")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "deepnex", *args], capture_output=True,
                          text=True, timeout=60, env=env)
    return proc, time.monotonic() - start


def test_cli_against_a_closed_port_fails_within_seconds_saying_connection_refused():
    address = f"127.0.0.1:{closed_port()}"
    proc, took = cli("nodes", "--central", address)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert took < 10.0
    assert proc.stderr.startswith(
        f"deepnex: central at {address}: no connection within 5000 ms: "), proc.stderr
    assert "Connection refused" in proc.stderr


def test_cli_refuses_a_malformed_central_address():
    proc, took = cli("nodes", "--central", "http://127.0.0.1:7070")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert took < 10.0
    assert proc.stderr == f'deepnex: central address "http://127.0.0.1:7070": {EXPECTED}\n'
