"""Servers advertise an address their peers can dial: a daemon or an
in-process server listening on 0.0.0.0 advertises this host's primary
address (never 0.0.0.0), --advertise / advertise= overrides it, and host
names resolve with the system resolver (/etc/hosts)."""

import os
import re
import socket
import subprocess

import pytest

deepnex = pytest.importorskip("deepnex")
from _central import stop_central as stop  # noqa: E402 - ends any daemon: TERM, then KILL
from deepnex import collective, gpu, ps  # noqa: E402

BUILD_DIR = os.environ.get("DEEPNEX_BUILD_DIR",
                           os.path.join(os.path.dirname(__file__), "..", "..", "build"))
DAEMONS = {
    "deepnex-ps": [],
    "deepnex-store": [],
    "deepnex-central": ["--token", "admintok"],
}
# Each daemon's client, doing one call that needs the server.
DIAL = {
    "deepnex-ps": lambda a: ps.Client([a], worker_id=-1, timeout=10).stats(),
    "deepnex-store": lambda a: collective.StoreClient(a, timeout=10).set("k", "v"),
    "deepnex-central": lambda a: gpu.CentralClient(a, token="admintok", timeout=10).nodes(),
}


def without_job_env():
    return {k: v for k, v in os.environ.items()
            if k not in ("DEEPNEX_STORE_ADDR", "DEEPNEX_CENTRAL")}


def start(daemon, *flags):
    """(Popen, the address it printed) of `daemon` with `flags`."""
    binary = os.path.join(BUILD_DIR, "bin", daemon)
    if not os.path.exists(binary):
        pytest.skip(f"{binary} not built")
    proc = subprocess.Popen([binary, *DAEMONS[daemon], *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=without_job_env())
    line = proc.stdout.readline()
    m = re.match(rf"{daemon} listening on (\S+)", line)
    if not m:
        proc.kill()
        pytest.fail(line + proc.communicate(timeout=10)[1])
    return proc, m.group(1)


def split(address):
    host, port = address.rsplit(":", 1)
    return host, int(port)


def assert_is_an_address_of_this_host(host):
    """The primary address: not a wildcard, and one this host can bind."""
    assert host not in ("0.0.0.0", "::", "[::]", ""), host
    socket.inet_aton(host)  # an IPv4 address, not a name
    with socket.socket() as s:
        s.bind((host, 0))


# The wildcard tests stop short of dialing the primary address: tests talk
# only to 127.0.0.1 and the simulated hosts' 10.77.0.x, and test_multihost.py
# dials a wildcard daemon's advertised address from another simulated host.
@pytest.mark.parametrize("daemon", sorted(DAEMONS))
def test_daemon_on_the_wildcard_advertises_an_address_of_this_host(daemon):
    proc, address = start(daemon, "--listen", "0.0.0.0:0")
    try:
        host, port = split(address)
        assert_is_an_address_of_this_host(host)
        assert port > 0
    finally:
        stop(proc)


@pytest.mark.parametrize("daemon", sorted(DAEMONS))
def test_daemon_advertises_the_host_it_is_given(daemon):
    proc, address = start(daemon, "--listen", "0.0.0.0:0", "--advertise", "127.0.0.1")
    try:
        host, port = split(address)
        assert host == "127.0.0.1"
        DIAL[daemon](address)
    finally:
        stop(proc)


# A daemon on a unix socket said "listening on unix:1" (gRPC's stand-in
# port joined to "unix"), which nobody can dial.
@pytest.mark.parametrize("daemon", sorted(DAEMONS))
def test_daemon_on_a_unix_socket_advertises_its_path(daemon, tmp_path):
    path = tmp_path / "d.sock"
    proc, address = start(daemon, "--listen", f"unix:{path}")
    try:
        assert address == f"unix:{path}"
        DIAL[daemon](address)
    finally:
        stop(proc)


def test_a_host_name_from_etc_hosts_is_dialed_through_the_system_resolver():
    # gRPC's own resolver (c-ares) does not read /etc/hosts; deepnex makes it
    # use getaddrinfo, which does.
    proc, address = start("deepnex-store", "--listen", "127.0.0.1:0", "--advertise",
                          "localhost")
    try:
        assert re.fullmatch(r"localhost:\d+", address), address
        DIAL["deepnex-store"](address)
    finally:
        stop(proc)


@pytest.mark.parametrize("daemon", sorted(DAEMONS))
def test_daemon_refuses_to_advertise_what_no_peer_can_dial(daemon):
    binary = os.path.join(BUILD_DIR, "bin", daemon)
    if not os.path.exists(binary):
        pytest.skip(f"{binary} not built")
    for bad, why in (("0.0.0.0", "peers cannot dial a wildcard address"),
                     ("10.77.0.11:7070", "a host name or an address, without a port")):
        proc = subprocess.run([binary, *DAEMONS[daemon], "--listen", "0.0.0.0:0",
                               "--advertise", bad], capture_output=True, text=True, timeout=30,
                              env=without_job_env())
        # deepnex-ps checks its options as flags (exit 2), the others when
        # they start the server (exit 1).
        assert proc.returncode == (2 if daemon == "deepnex-ps" else 1), proc.stdout + proc.stderr
        assert f'advertise "{bad}": {why}' in proc.stderr, proc.stderr


def test_in_process_servers_on_the_wildcard_advertise_an_address_of_this_host(monkeypatch):
    monkeypatch.delenv("DEEPNEX_STORE_ADDR", raising=False)
    monkeypatch.delenv("DEEPNEX_CENTRAL", raising=False)
    with collective.Store("0.0.0.0:0") as store:
        host, _ = split(store.address)
        assert_is_an_address_of_this_host(host)
    server = ps.Server("0.0.0.0:0")
    host, _ = split(server.address)
    assert_is_an_address_of_this_host(host)
    server.stop()


def test_in_process_servers_advertise_the_host_they_are_given():
    with collective.Store("0.0.0.0:0", advertise="localhost") as store:
        assert store.address == f"localhost:{store.port}"
        collective.StoreClient(store.address, timeout=10).set("k", "v")
    server = ps.Server("0.0.0.0:0", advertise="127.0.0.1")
    assert server.address == f"127.0.0.1:{server.port}"
    server.stop()
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        collective.Store("0.0.0.0:0", advertise="0.0.0.0")
    assert str(e.value) == 'advertise "0.0.0.0": peers cannot dial a wildcard address'
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        ps.Server("0.0.0.0:0", advertise="n1:7070")
    assert str(e.value) == 'advertise "n1:7070": a host name or an address, without a port'
