"""deepnex-central's image catalog (#16 "Images"): presets, a user's own
images and those shared with them; central runs only those, and keeps the
catalog across restarts."""

import os
import shutil
import subprocess

import pytest

import deepnex
from _central import clients, run_cli, start_central, start_central_launcher, stop_central
from _wait import wait_for
from deepnex import gpu, launch


def grant():
    return gpu.Request(user="", gpus=1, cpus=1, memory="256MiB")


def admin(address):
    return gpu.CentralClient(address, token="admintok", timeout=10)


def names(client):
    return [(i["name"], i["tag"], i["owner"], i["visibility"]) for i in client.images()]


def run(client, image, name, command=("true",)):
    """Runs `command` in `image` on a new allocation; (its exit, its log)
    once it ended."""
    a = client.allocate(grant())
    client.start_container(launch.ContainerSpec(name=name, command=list(command), image=image),
                           a)

    def ended():
        c = next((c for c in client.containers() if c["name"] == name), None)
        return c if c is not None and c["allocation_released"] else None

    return (wait_for(ended, f"container {name} to end")["last_exit"],
            client.container_logs(name))


def refused(client, image):
    a = client.allocate(grant())
    with pytest.raises(deepnex.PermissionDeniedError) as e:
        client.start_container(launch.ContainerSpec(name="r", command=["true"], image=image), a)
    client.release(a.id)
    return str(e.value)


@pytest.fixture
def catalog(tmp_path):
    """deepnex-central (process backend) with presets base and host, and
    alice's own image tools:v1 (the host's files, so the process backend
    runs it); yields (address, state_dir)."""
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    (rootfs / "file").write_bytes(b"x" * 1000)
    state = tmp_path / "state"
    proc, address = start_central_launcher(tmp_path, "--state-dir", str(state), "--image",
                                           f"base={rootfs}", "--image", "host=host")
    try:
        admin(address).register_image("tools:v1", "host", owner="alice")
        yield address, state, proc
    finally:
        stop_central(proc)


def test_a_user_runs_presets_their_own_and_what_is_shared_with_them(catalog):
    address, _, _ = catalog
    alice, bob = clients(address)
    assert names(alice) == [("base", "latest", "", "preset"), ("host", "latest", "", "preset"),
                            ("tools", "v1", "alice", "private")]
    assert [i["size"] for i in alice.images()] == [1000, 0, 0]
    assert names(bob) == [("base", "latest", "", "preset"), ("host", "latest", "", "preset")]
    assert run(alice, "tools:v1", "own")[0] == "exited(0)"
    # Bob neither runs nor sees alice's private image.
    assert refused(bob, "alice/tools:v1") == (
        'spec.image: "alice/tools:v1" is not an image that user bob may run [base, host] '
        "(deepnex images)")
    # His own name "tools" is not alice's.
    assert refused(bob, "tools:v1").startswith('spec.image: "tools:v1" is not an image')
    shared = alice.share_image("tools:v1", "bob")
    assert (shared["visibility"], shared["shared_with"]) == ("shared", ["bob"])
    assert names(bob)[2] == ("alice/tools", "v1", "alice", "shared")
    # Whom alice shares with is hers to know.
    assert bob.images()[2]["shared_with"] == []
    assert run(bob, "alice/tools:v1", "borrowed")[0] == "exited(0)"
    # Shared is not owned: bob cannot pass it on, nor remove it.
    with pytest.raises(deepnex.PermissionDeniedError) as e:
        bob.share_image("alice/tools:v1", "carol")
    assert str(e.value) == 'image "alice/tools:v1": user bob does not own it (its owner is alice)'
    with pytest.raises(deepnex.PermissionDeniedError):
        bob.remove_image("alice/tools:v1")
    unshared = alice.unshare_image("tools:v1", "bob")
    assert (unshared["visibility"], unshared["shared_with"]) == ("private", [])
    assert refused(bob, "alice/tools:v1").startswith('spec.image: "alice/tools:v1" is not')
    # Public: everyone; unshare without users takes that back too.
    assert alice.share_image("tools:v1", public=True)["visibility"] == "public"
    assert names(bob)[2] == ("alice/tools", "v1", "alice", "public")
    assert alice.unshare_image("tools:v1")["visibility"] == "private"
    assert len(names(bob)) == 2


def test_bad_names_and_calls_are_refused_naming_the_image(catalog):
    address, _, _ = catalog
    alice, bob = clients(address)
    root = admin(address)
    # Never a host path from a user, nor an image that does not exist.
    for image in ("/", "/usr", "../x", "nope", "base:v9"):
        assert refused(alice, image) == (
            f'spec.image: "{image}" is not an image that user alice may run '
            "[base, host, tools:v1] (deepnex images)")
    with pytest.raises(deepnex.NotFoundError) as e:
        bob.share_image("alice/tools:v1", "bob")
    assert str(e.value) == 'image "alice/tools:v1": no such image that user bob may see'
    with pytest.raises(deepnex.NotFoundError) as e:
        alice.unshare_image("tools:v1", "bob")
    assert str(e.value) == 'image "tools:v1" is not shared with user "bob" (it is shared with [])'
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        alice.share_image("tools:v1")
    assert str(e.value) == 'share of image "tools:v1": give users or public'
    # Only what could be a user: '*' is not everyone (public is), and
    # '../bob' no one (they were kept; probe).
    for bad, shown in (("*", '"*"'), ("../bob", '"../bob"'), ("b\nx", '"b\\nx"'),
                       ("x" * 3000, '"' + "x" * 64 + '"...')):
        with pytest.raises(deepnex.InvalidArgumentError) as e:
            alice.share_image("tools:v1", bad)
        assert str(e.value) == (
            f'share of image "tools:v1": user {shown} is not a user name (letters, digits, '
            "'_', '.', '-', at most 128 characters; public shares with everyone)")
    assert alice.images()[2]["shared_with"] == []
    with pytest.raises(deepnex.ResourceExhaustedError, match="more than 1024; share it public"):
        alice.share_image("tools:v1", [f"u{i}" for i in range(1025)])
    with pytest.raises(deepnex.PermissionDeniedError) as e:
        alice.remove_image("base")
    assert str(e.value) == 'image "base": user alice does not own it (a preset, an admin\'s)'
    with pytest.raises(deepnex.PermissionDeniedError) as e:
        alice.register_image("mine", "host")
    assert str(e.value) == "user alice cannot register images (admins only)"
    with pytest.raises(deepnex.AlreadyExistsError) as e:
        root.register_image("tools:v1", "host", owner="alice")
    assert str(e.value) == 'image "alice/tools:v1" exists (force replaces it)'
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        root.register_image("x", "relative")
    assert str(e.value) == ('source: "relative" is not an absolute directory on '
                            'deepnex-central\'s host or "host"')
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        root.register_image("a/b/c", "host")
    assert str(e.value).startswith('name: "a/b/c" is not an image NAME[:TAG]')
    assert root.register_image("tools:v1", "host", owner="alice", force=True)["owner"] == "alice"
    removed = alice.remove_image("tools:v1")
    assert (removed["name"], removed["tag"]) == ("tools", "v1")
    assert len(names(alice)) == 2


def test_a_refused_image_or_container_name_is_quoted_escaped_and_cut(catalog):
    """As the share's user above: an image, a container name or an
    environment variable's name came back as the user typed it, so that an
    escape sequence in it cleared the terminal that showed the error, and a
    100 kB name came back whole (probe: `deepnex shell --image`, `--name`)."""
    address, _, _ = catalog
    alice, _ = clients(address)
    root = admin(address)
    for bad, shown, image in (("x\x1b[2Jy", '"x\\x1b[2Jy"', '"x\\x1b[2Jy"'),
                              ("a" * 100000, '"' + "a" * 64 + '"...', '"' + "a" * 1024 + '"...')):
        # An image may be a directory's path: shown whole up to 1 KiB.
        assert refused(alice, bad) == (
            f"spec.image: {image} is not an image that user alice may run "
            "[base, host, tools:v1] (deepnex images)")
        with pytest.raises(deepnex.InvalidArgumentError) as e:
            root.register_image(bad, "host")
        assert str(e.value).startswith(f"name: {shown} is not an image NAME[:TAG]")
        with pytest.raises(deepnex.NotFoundError) as e:
            alice.unshare_image("tools:v1", bad)
        assert str(e.value) == (
            f'image "tools:v1" is not shared with user {shown} (it is shared with [])')
        a = alice.allocate(grant())
        with pytest.raises(deepnex.InvalidArgumentError) as e:
            alice.start_container(launch.ContainerSpec(name=bad, command=["true"]), a)
        assert str(e.value) == (
            f"spec.name: {shown} is not a valid name ([a-zA-Z0-9][a-zA-Z0-9_.-]*, at most 63 "
            "characters)")
        with pytest.raises(deepnex.InvalidArgumentError) as e:
            alice.start_container(launch.ContainerSpec(name="e", command=["true"],
                                                       env={bad + "=": "1"}), a)
        message = str(e.value)
        assert message.endswith(" is not a variable name") and "\x1b" not in message and \
            len(message) < 200, message
        alice.release(a.id)
    assert alice.allocations() == [] and alice.containers() == []


def test_an_images_error_names_it_as_the_user_did_not_by_its_path(catalog, tmp_path):
    """The launcher's errors named an image by its directory on central's
    host, which a user never names (probe)."""
    address, _, _ = catalog
    alice, _ = clients(address)
    rootfs = tmp_path / "dirimage"
    rootfs.mkdir()
    admin(address).register_image("t:v1", str(rootfs), owner="alice")
    for image in ("base", "t:v1"):  # a preset, and a directory of the catalog
        a = alice.allocate(grant())
        with pytest.raises(deepnex.InvalidArgumentError) as e:
            alice.start_container(launch.ContainerSpec(name="p", command=["true"], image=image),
                                  a)
        alice.release(a.id)
        assert str(e.value) == (
            f'spec.image: "{image}": the process backend runs on the host and cannot use an '
            'image\'s files (use image "host", or the oci backend)')
        assert str(tmp_path) not in str(e.value)


def test_the_catalog_survives_a_restart(catalog, tmp_path):
    address, state, proc = catalog
    alice, _ = clients(address)
    alice.share_image("tools:v1", ["bob"])
    before = alice.images()
    stop_central(proc)
    proc2, address2 = start_central_launcher(tmp_path,
                                             "--state-dir", str(state), "--image",
                                             f"base={tmp_path / 'rootfs'}")
    try:
        alice2, bob2 = clients(address2)
        # host was a flag's preset and is not one now; the rest is as it was.
        assert alice2.images() == before
        assert names(bob2)[2] == ("alice/tools", "v1", "alice", "shared")
    finally:
        stop_central(proc2)


def test_cli_images_share_unshare_rm(catalog):
    address, _, _ = catalog
    out = run_cli("images", "--central", address)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["NAME", "TAG", "SIZE", "OWNER", "VISIBILITY", "CREATED"]
    assert [line.split()[:5] for line in lines[1:]] == [
        ["base", "latest", "1000B", "-", "preset"], ["host", "latest", "0B", "-", "preset"],
        ["tools", "v1", "0B", "alice", "private"]]
    out = run_cli("image", "share", "tools:v1", "--with", "bob,carol", "--central", address)
    assert (out.returncode, out.stdout) == (0, "tools:v1 shared with bob,carol\n")
    out = run_cli("images", "--central", address, token="bobtok")
    assert out.stdout.splitlines()[3].split()[:5] == ["alice/tools", "v1", "0B", "alice",
                                                     "shared"]
    out = run_cli("image", "unshare", "tools:v1", "--with", "carol", "--central", address)
    assert (out.returncode, out.stdout) == (0, "tools:v1 shared with bob\n")
    out = run_cli("image", "share", "tools:v1", "--central", address)
    assert out.returncode != 0
    assert "image share: give --with USER[,USER] or --public" in out.stderr
    out = run_cli("image", "rm", "alice/tools:v1", "--central", address, token="bobtok")
    assert (out.returncode, out.stderr) == (
        1, 'deepnex: image "alice/tools:v1": user bob does not own it (its owner is alice)\n')
    out = run_cli("image", "rm", "tools:v1", "--central", address)
    assert (out.returncode, out.stdout) == (0, "removed tools:v1\n")
    out = run_cli("image", "register", "py:3", "host", "--central", address, token="admintok")
    assert (out.returncode, out.stdout) == (0, "py:3 preset\n")


def test_without_a_state_dir_the_catalog_is_in_memory(tmp_path):
    proc, address = start_central(tmp_path, "--image", "host=host")
    try:
        alice, _ = clients(address)
        assert names(alice) == [("host", "latest", "", "preset")]
    finally:
        stop_central(proc)


@pytest.fixture
def registry(tmp_path):
    from _registry import start_registry
    reg = start_registry(tmp_path)
    yield reg
    reg.stop()


def oci_or_skip():
    if os.geteuid() != 0 or shutil.which("runc") is None:
        pytest.skip("the oci backend needs root and runc")


def test_a_registry_image_is_pulled_once_per_digest(tmp_path, registry):
    """Registered from an OCI layout, the image goes to the registry; a node
    pulls it on first use, and a second start finds it in its cache."""
    from _registry import busybox_layout
    oci_or_skip()
    layout = busybox_layout(tmp_path / "layout", files={"/etc/motd": "from the registry\n"})
    proc, address = start_central_launcher(tmp_path, "--state-dir", str(tmp_path / "state"),
                                           "--registry", registry.address, backend="oci")
    try:
        alice, _ = clients(address)
        root = admin(address)
        assert root.register_image("bb:v1", str(layout))["visibility"] == "preset"
        assert registry.blob_gets("library/bb") == 0
        assert run(alice, "bb:v1", "first", ["busybox", "cat", "/etc/motd"]) == \
            ("exited(0)", "from the registry\n")
        # The layer and the config, once.
        assert registry.blob_gets("library/bb") == 2
        assert run(alice, "bb:v1", "second", ["busybox", "cat", "/etc/motd"]) == \
            ("exited(0)", "from the registry\n")
        assert registry.blob_gets("library/bb") == 2
        registry.stop()
        a = alice.allocate(grant())
        with pytest.raises(deepnex.UnavailableError) as e:
            alice.start_container(launch.ContainerSpec(name="down", command=["busybox", "true"],
                                                       image="bb:v1"), a)
        assert str(e.value).startswith(
            f"image registry {registry.address} is unreachable "
            f"(docker://{registry.address}/library/bb:v1@sha256:")
        with pytest.raises(deepnex.UnavailableError) as e:
            root.register_image("bb:v2", str(layout))
        assert str(e.value).startswith(
            f"image registry {registry.address} is unreachable "
            f"(docker://{registry.address}/library/bb:v2): ")
        assert [i["tag"] for i in alice.images()] == ["v1"]
    finally:
        stop_central(proc)


def test_a_registered_image_runs_what_was_pushed_not_what_was_pushed_over_it(tmp_path, registry):
    """The registry takes pushes from whoever reaches it (a user's process on
    a node): one pushed over library/bb:v1, and every user's next start of
    preset bb:v1 ran that user's files (probe). Registration pins the digest
    it pushed, as a commit does."""
    from _registry import busybox_layout
    oci_or_skip()
    layout = busybox_layout(tmp_path / "layout", files={"/etc/motd": "the admin's\n"})
    forged = busybox_layout(tmp_path / "forged", files={"/etc/motd": "a user's\n"})
    proc, address = start_central_launcher(tmp_path, "--state-dir", str(tmp_path / "state"),
                                           "--registry", registry.address, backend="oci")
    try:
        alice, _ = clients(address)
        admin(address).register_image("bb:v1", str(layout))
        subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{forged}:v1",
                        f"docker://{registry.address}/library/bb:v1"], check=True,
                       capture_output=True, timeout=120)
        assert run(alice, "bb:v1", "pinned", ["busybox", "cat", "/etc/motd"]) == \
            ("exited(0)", "the admin's\n")
    finally:
        stop_central(proc)


def test_registry_flag_must_be_host_port(tmp_path):
    from _central import CENTRAL_BIN
    bad = subprocess.run([CENTRAL_BIN, "--listen", "127.0.0.1:0", "--registry", "http://x/y"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0
    assert '--registry "http://x/y": expected HOST:PORT' in bad.stderr


def test_a_nodes_agent_pulls_a_registry_image_into_its_own_store_once(tmp_path, registry):
    """Through the deepnex-agent of the allocation's node: the agent pulls,
    into its state directory, on first use only."""
    from _agents import client
    from _registry import busybox_layout, central_with_agent
    oci_or_skip()
    layout = busybox_layout(tmp_path / "layout", files={"/etc/motd": "on h1\n"})
    with central_with_agent(tmp_path, registry, layout) as address:
        alice = client(address, "alicetok")
        assert run(alice, "bb:v1", "first", ["busybox", "cat", "/etc/motd"]) == \
            ("exited(0)", "on h1\n")
        assert run(alice, "bb:v1", "second", ["busybox", "cat", "/etc/motd"]) == \
            ("exited(0)", "on h1\n")
        assert registry.blob_gets("library/bb") == 2
        # The stores themselves, not a walk of the state directories, whose
        # run directories (an ended run's layer) may go while it walks.
        pulled = [p.name for p in (tmp_path / "h1" / "oci" / "pulled").iterdir()]
        assert len(pulled) == 1 and pulled[0].startswith("sha256-"), pulled
        central_store = tmp_path / "central" / "oci" / "pulled"
        assert not central_store.exists() or not list(central_store.iterdir())


@pytest.mark.parametrize("preset,script,expected", [
    ("debian-python", "import numpy; print(int(numpy.array([1, 1]).sum()))", "2\n"),
    ("debian-torch", "import torch; print(int(torch.tensor([1, 2]).sum()))", "3\n"),
], ids=["debian-python", "debian-torch"])
def test_a_preset_runs_its_framework(tmp_path, registry, preset, script, expected):
    """scripts/build_presets.sh's presets (built beforehand: they take
    minutes and a Debian mirror), registered, pushed, pulled and run."""
    presets = os.environ.get("DEEPNEX_PRESETS_DIR")
    if not presets or not os.path.isdir(os.path.join(presets, preset)):
        pytest.skip(f"set DEEPNEX_PRESETS_DIR to a directory that "
                    f"`scripts/build_presets.sh DIR {preset}` filled")
    oci_or_skip()
    proc, address = start_central_launcher(tmp_path, "--state-dir", str(tmp_path / "state"),
                                           "--registry", registry.address, backend="oci")
    try:
        # The first start pulls and unpacks the image (debian-torch: ~470 MB
        # compressed) within the call.
        alice = gpu.CentralClient(address, token="alicetok", timeout=600)
        root = gpu.CentralClient(address, token="admintok", timeout=600)  # pushes it
        root.register_image(preset, os.path.join(presets, preset))
        assert run(alice, preset, "py", ["python3", "-c", script]) == ("exited(0)", expected)
    finally:
        stop_central(proc)
