"""`deepnex commit` (#16 "Images"): a running oci container's changes (its
writable layer, an overlay over the image's files) saved as one new layer on
top of its image's, pushed to the registry and recorded in the catalog as the
user's private image; through an agent, the node commits. And port-forward
into an oci container's own network namespace."""

import hashlib
import json
import os
import shutil
import subprocess

import pytest

import deepnex
from _central import clients, run_cli, start_central_launcher, stop_central
from _wait import wait_for
from deepnex import gpu, launch


def grant():
    return gpu.Request(user="", gpus=1, cpus=1, memory="256MiB")


def admin(address):
    return gpu.CentralClient(address, token="admintok", timeout=10)


def oci_or_skip():
    if os.geteuid() != 0 or shutil.which("runc") is None:
        pytest.skip("the oci backend needs root and runc")


@pytest.fixture
def registry(tmp_path):
    from _registry import start_registry
    reg = start_registry(tmp_path)
    yield reg
    reg.stop()


@pytest.fixture
def oci_central(tmp_path, registry):
    """deepnex-central on the oci backend with `registry`, and bb:v1
    (base_layout) as a preset; yields its address."""
    oci_or_skip()
    layout = base_layout(tmp_path)
    proc, address = start_central_launcher(tmp_path, "--state-dir", str(tmp_path / "state"),
                                           "--registry", registry.address, backend="oci")
    try:
        admin(address).register_image("bb:v1", str(layout))
        yield address
    finally:
        stop_central(proc)


def base_layout(tmp_path):
    """bb:v1's layout: busybox, a writable /work holding base.txt."""
    from _registry import busybox_layout
    return busybox_layout(tmp_path / "layout", files={"/work/base.txt": "base\n"},
                          writable=("/work",))


def start_box(client, name, image="bb:v1"):
    """Starts `name` (sleeping) from `image`; returns its allocation once it
    runs."""
    a = client.allocate(grant())
    client.start_container(launch.ContainerSpec(
        name=name, command=["busybox", "sleep", "1000"], image=image), a)
    wait_for(lambda: next((c for c in client.containers()
                           if c["name"] == name and c["state"] == "running"), None),
             f"container {name} to run")
    return a


def sh(client, name, script):
    r = client.exec(name, ["busybox", "sh", "-c", script])
    assert r.exit_code == 0, r.stderr
    return r.stdout.decode()


def run(client, image, name, script):
    """Runs `script` in `image` to its end; (its exit, its log)."""
    a = client.allocate(grant())
    client.start_container(launch.ContainerSpec(
        name=name, command=["busybox", "sh", "-c", script], image=image), a)

    def ended():
        c = next((c for c in client.containers() if c["name"] == name), None)
        return c if c is not None and c["allocation_released"] else None

    return (wait_for(ended, f"container {name} to end")["last_exit"],
            client.container_logs(name))


def manifest(registry, repo, tag):
    """(the manifest, its digest) of repo:tag, as the registry serves it."""
    raw = subprocess.run(
        ["skopeo", "inspect", "--raw", "--tls-verify=false",
         f"docker://{registry.address}/{repo}:{tag}"],
        check=True, capture_output=True, timeout=60).stdout
    return json.loads(raw), "sha256:" + hashlib.sha256(raw).hexdigest()


def stored_blobs(tmp_path):
    """The digests of every blob the registry stores (content-addressed)."""
    root = tmp_path / "registry" / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256"
    return {"sha256:" + p.name for p in root.glob("*/*") if (p / "data").exists()}


WRITE = "echo mine > /work/added.txt && rm /work/base.txt"
LOOK = "cat /work/added.txt 2>/dev/null; busybox ls /work"


def test_a_commit_is_one_new_layer_the_owner_runs_and_shares(tmp_path, registry, oci_central):
    alice, bob = clients(oci_central)
    start_box(alice, "box")
    sh(alice, "box", WRITE)
    before = stored_blobs(tmp_path)
    committed = alice.commit("box", "mine:v1")
    assert (committed["name"], committed["tag"], committed["owner"],
            committed["visibility"]) == ("mine", "v1", "alice", "private")
    assert committed["size"] > 0

    # One new layer over the base's, and nothing else of the image's
    # contents stored anew.
    base, _ = manifest(registry, "library/bb", "v1")
    mine, digest = manifest(registry, "alice/mine", "v1")
    assert mine["layers"][:-1] == base["layers"]
    assert len(mine["layers"]) == len(base["layers"]) + 1
    assert stored_blobs(tmp_path) - before == {
        mine["layers"][-1]["digest"], mine["config"]["digest"], digest}

    # The new image has the file, not the deleted one (a whiteout); the
    # base, and the running container's own view, are as they were.
    assert run(alice, "mine:v1", "look", LOOK) == ("exited(0)", "mine\nadded.txt\n")
    assert run(alice, "bb:v1", "base", LOOK) == ("exited(0)", "base.txt\n")
    assert sh(alice, "box", "busybox ls /work") == "added.txt\n"

    # Bob runs it once shared with him.
    a = bob.allocate(grant())
    with pytest.raises(deepnex.PermissionDeniedError):
        bob.start_container(launch.ContainerSpec(name="b", command=["busybox", "true"],
                                                 image="alice/mine:v1"), a)
    bob.release(a.id)
    alice.share_image("mine:v1", ["bob"])
    assert run(bob, "alice/mine:v1", "look", LOOK) == ("exited(0)", "mine\nadded.txt\n")

    # The same name again is refused; a new tag is a new image.
    with pytest.raises(deepnex.AlreadyExistsError) as e:
        alice.commit("box", "mine:v1")
    assert str(e.value) == ('name: image "mine:v1" of user alice exists; commit as a new '
                            'tag (NAME:TAG) or remove it first')
    sh(alice, "box", "echo two > /work/second.txt")
    assert alice.commit("box", "mine:v2")["tag"] == "v2"
    assert run(alice, "mine:v2", "look2", "busybox ls /work") == (
        "exited(0)", "added.txt\nsecond.txt\n")


def test_two_commits_of_one_name_at_once_one_wins_and_its_image_is_pinned(
        tmp_path, registry, oci_central):
    """The second commit of a NAME:TAG under way is refused before it
    pushes: the registry tag, and the image, are the winner's. The catalog
    pins the pushed digest: a later push over the tag changes nothing."""
    import threading
    alice, _ = clients(oci_central)
    grants = []
    for box in ("one", "two"):
        grants.append(start_box(alice, box))
        sh(alice, box, f"echo {box} > /work/{box}.txt")
    start = threading.Barrier(2)
    got = {}

    def commit(box):
        start.wait(timeout=30)
        try:
            got[box] = alice.commit(box, "mine:v1")
        except deepnex.AlreadyExistsError as e:
            got[box] = e

    threads = [threading.Thread(target=commit, args=(box,)) for box in ("one", "two")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive()
    won = [box for box, r in got.items() if isinstance(r, dict)]
    lost = [box for box, r in got.items() if isinstance(r, deepnex.AlreadyExistsError)]
    assert len(won) == 1 and len(lost) == 1, got
    assert str(got[lost[0]]) == ('name: image "mine:v1" of user alice is being committed by '
                                 'another call; commit as a new tag (NAME:TAG)')
    for a in grants:  # their GPUs, for the runs below
        alice.release(a.id)
    assert run(alice, "mine:v1", "look", "busybox ls /work") == (
        "exited(0)", f"base.txt\n{won[0]}.txt\n")

    # The tag pushed over (another tool, the same registry): a container of
    # the image still gets what was committed, on a node that has not
    # pulled it yet too.
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false",
                    "--dest-tls-verify=false", f"docker://{registry.address}/library/bb:v1",
                    f"docker://{registry.address}/alice/mine:v1"],
                   check=True, capture_output=True, timeout=120)
    shutil.rmtree(tmp_path / "launch" / "oci" / "pulled")
    assert run(alice, "mine:v1", "look2", "busybox ls /work") == (
        "exited(0)", f"base.txt\n{won[0]}.txt\n")


def restart_registry(registry, tmp_path):
    """Starts `registry` again on its address, over the same storage."""
    from _agents import Daemon
    config = tmp_path / "registry" / "config.yml"
    config.write_text(config.read_text().replace("127.0.0.1:0", registry.address))
    registry.daemon = Daemon(registry.daemon.argv, tmp_path / "registry" / "log-again")
    wait_for(lambda: f"listening on {registry.address}" in (registry.daemon.stdout() +
                                                            registry.daemon.stderr()),
             "docker-registry to listen again")


def test_a_failed_commit_leaves_the_name_free_for_a_retry(tmp_path, registry, oci_central):
    alice, _ = clients(oci_central)
    start_box(alice, "box")
    sh(alice, "box", WRITE)
    # The container's lookup fails after the name is held.
    with pytest.raises(deepnex.NotFoundError):
        alice.commit("nosuch", "mine")
    registry.stop()
    with pytest.raises(deepnex.UnavailableError) as e:
        alice.commit("box", "mine")
    assert f"image registry {registry.address} is unreachable" in str(e.value), str(e.value)
    assert [i["name"] for i in alice.images()] == ["bb"]
    restart_registry(registry, tmp_path)
    assert alice.commit("box", "mine")["name"] == "mine"
    assert run(alice, "mine", "look", LOOK) == ("exited(0)", "mine\nadded.txt\n")


def test_commit_refuses_others_containers_bad_names_and_the_cli_prints_it(oci_central):
    alice, bob = clients(oci_central)
    start_box(alice, "box")
    with pytest.raises(deepnex.NotFoundError) as e:
        bob.commit("box", "stolen")
    assert str(e.value) == 'no container "box" of user bob'
    # Quoted C-escaped, as every refused value (core/text.h's Quoted).
    for bad, shown in (("../x", "../x"), ("a:b:c", "a:b:c"), ("Ünicode", "\\xc3\\x9cnicode"),
                       ("bob/x", "bob/x")):
        with pytest.raises(deepnex.InvalidArgumentError) as e:
            alice.commit("box", bad)
        assert str(e.value).startswith(f'name: "{shown}"'), str(e.value)
    sh(alice, "box", WRITE)
    got = run_cli("commit", "box", "cli", "--central", oci_central)
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("cli:latest private "), got.stdout
    assert run(alice, "cli", "look", LOOK) == ("exited(0)", "mine\nadded.txt\n")


def test_a_user_named_library_cannot_push_over_the_presets(tmp_path, registry):
    """Presets live in the registry's library/ repositories; a user named
    "library" committing a preset's name would otherwise push over the image
    every user runs."""
    oci_or_skip()
    layout = base_layout(tmp_path)
    proc, address = start_central_launcher(
        tmp_path, "--state-dir", str(tmp_path / "state"), "--registry", registry.address,
        backend="oci", users=("alice", "library"))
    try:
        admin(address).register_image("bb:v1", str(layout))
        before = manifest(registry, "library/bb", "v1")
        lib = gpu.CentralClient(address, token="librarytok", timeout=10)
        start_box(lib, "box")
        sh(lib, "box", WRITE)
        with pytest.raises(deepnex.PermissionDeniedError) as e:
            lib.commit("box", "bb:v1")
        assert str(e.value) == (
            'user "library": the registry\'s library/ repositories hold the presets; a user of '
            'that name cannot store images there')
        assert manifest(registry, "library/bb", "v1") == before
        alice, _ = clients(address)
        assert run(alice, "bb:v1", "look", LOOK) == ("exited(0)", "base.txt\n")
    finally:
        stop_central(proc)


def test_a_process_container_cannot_be_committed(tmp_path):
    """No registry, runc or root needed: refused before any of it."""
    proc, address = start_central_launcher(tmp_path, "--state-dir", str(tmp_path / "state"))
    try:
        alice, _ = clients(address)
        a = alice.allocate(grant())
        alice.start_container(launch.ContainerSpec(name="p", command=["sleep", "1000"],
                                                   image="host"), a)
        with pytest.raises(deepnex.FailedPreconditionError) as e:
            alice.commit("p", "mine")
        assert str(e.value) == ('container "p" runs on the process backend: only oci '
                                'containers have a layer of changes to commit')
    finally:
        stop_central(proc)


def test_an_agents_node_commits_its_container(tmp_path, registry):
    """The container's changes are on its node: its deepnex-agent packs and
    pushes them, central records the image."""
    from _agents import client
    from _registry import central_with_agent
    oci_or_skip()
    with central_with_agent(tmp_path, registry, base_layout(tmp_path)) as address:
        alice = client(address, "alicetok")
        start_box(alice, "box")
        sh(alice, "box", WRITE)
        assert alice.commit("box", "mine")["owner"] == "alice"
        assert run(alice, "mine", "look", LOOK) == ("exited(0)", "mine\nadded.txt\n")
        # An agent that goes leaves its containers running (a new one adopts
        # them): the box ends first, and its layer is unmounted.
        alice.stop_container("box", grace=0)
        wait_for(lambda: str(tmp_path) not in open("/proc/self/mountinfo").read(),
                 "the box's overlay to be unmounted")


def test_port_forward_reaches_an_oci_containers_own_network(oci_central):
    """An oci container has a network namespace of its own: the forwarded
    port is dialled in it, not on the host's loopback (where another server
    listens on the same port here)."""
    import socket
    import threading
    import urllib.request
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Host(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"the host\n")

    host = HTTPServer(("127.0.0.1", 0), Host)
    port = host.server_address[1]
    threading.Thread(target=host.serve_forever, daemon=True).start()
    try:
        alice, bob = clients(oci_central)
        a = alice.allocate(grant())
        alice.start_container(launch.ContainerSpec(
            name="web", command=["busybox", "httpd", "-f", "-p", f"127.0.0.1:{port}", "-h",
                                 "/work"], image="bb:v1"), a)

        def fetch(f):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{f.port}/base.txt",
                                            timeout=10) as r:
                    return r.read()
            except (OSError, socket.timeout):
                return None  # httpd is not listening yet

        with alice.port_forward("web", port) as f:
            assert wait_for(lambda: fetch(f), "httpd in the container to answer") == b"base\n"
        with bob.port_forward("web", port) as f:
            assert fetch(f) is None  # another user's container: the session is refused
    finally:
        host.shutdown()
        host.server_close()
