"""A real OCI registry for the image tests: Debian's docker-registry (the
CNCF distribution registry) on 127.0.0.1 with a port the OS picks, storing
under tmp_path; and OCI image layouts built with umoci.

    reg = start_registry(tmp_path)     # reg.address is "127.0.0.1:PORT"
    ...
    reg.blob_gets("library/bb")        # layer and config downloads so far
    reg.stop()
"""

import contextlib
import os
import re
import shutil
import subprocess

import pytest

from _wait import wait_for

TOOLS = ("docker-registry", "skopeo", "umoci")


def need_tools():
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (Debian packages; scripts/setup.sh)")


class Registry:
    """The registry's Daemon (tests/python/_agents.py) and its address."""

    def __init__(self, daemon, address):
        self.daemon, self.address = daemon, address

    def blob_gets(self, repo):
        """How many blobs of `repo` were downloaded (its access log's GETs)."""
        log = self.daemon.stdout() + self.daemon.stderr()
        return len(re.findall(rf'"GET /v2/{re.escape(repo)}/blobs/sha256:[0-9a-f]+ HTTP', log))

    def stop(self):
        self.daemon.stop()


def start_registry(tmp_path, timeout=30):
    from _agents import Daemon
    need_tools()
    root = tmp_path / "registry"
    root.mkdir()
    config = root / "config.yml"
    config.write_text(f"version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\n"
                      f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
                      f"http:\n  addr: 127.0.0.1:0\n  secret: deepnex-test\n")
    d = Daemon([shutil.which("docker-registry"), "serve", config], root / "log")

    def listening():
        m = re.search(r"listening on (127\.0\.0\.1:\d+)", d.stdout() + d.stderr())
        if m is None and d.proc.poll() is not None:
            raise AssertionError(f"docker-registry exited: {d.stderr()}")
        return m

    m = wait_for(listening, lambda: f"docker-registry to listen: {d.stderr()}", timeout=timeout)
    return Registry(d, m.group(1))


def busybox_layout(path, tag="v1", files=None, writable=()):
    """An OCI image layout at `path` with one image, `tag`: a static busybox
    as /bin/busybox and /bin/sh, plus `files` ({path in the image: text}) and
    `writable` directories (mode 777: any container user may write there)."""
    need_tools()
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox not installed (busybox-static)")
    bundle = f"{path}.bundle"
    subprocess.run(["umoci", "init", "--layout", str(path)], check=True)
    subprocess.run(["umoci", "new", "--image", f"{path}:{tag}"], check=True)
    subprocess.run(["umoci", "unpack", "--image", f"{path}:{tag}", bundle], check=True,
                   capture_output=True)
    rootfs = os.path.join(bundle, "rootfs")
    os.makedirs(os.path.join(rootfs, "bin"))
    shutil.copy(busybox, os.path.join(rootfs, "bin", "busybox"))
    os.symlink("busybox", os.path.join(rootfs, "bin", "sh"))
    for name, text in (files or {}).items():
        target = os.path.join(rootfs, name.lstrip("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write(text)
    for name in writable:
        target = os.path.join(rootfs, name.lstrip("/"))
        os.makedirs(target, exist_ok=True)
        os.chmod(target, 0o777)
    subprocess.run(["umoci", "repack", "--image", f"{path}:{tag}", bundle], check=True)
    shutil.rmtree(bundle)
    return path


@contextlib.contextmanager
def central_with_agent(tmp_path, registry, layout):
    """deepnex-central with `registry`, one deepnex-agent (node h1, oci
    backend) and preset bb:v1 from OCI layout `layout`; yields central's
    address."""
    from _agents import Agents, start_central
    from deepnex import gpu
    central, address = start_central(tmp_path, flags=("--registry", registry.address))
    agents = Agents(tmp_path, address)
    try:
        agents.registered(agents.start("h1", "h1tok", flags=("--backend", "oci")), "h1")
        gpu.CentralClient(address, token="admintok", timeout=10).register_image(
            "bb:v1", str(layout))
        yield address
    finally:
        agents.close()
        central.stop()
