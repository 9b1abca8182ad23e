"""Shared pytest setup for deepnex's Python tests.

Run against a build tree:
    PYTHONPATH=<build>/python /usr/bin/python3 -m pytest -q tests/python
or against an installed package (pip install). Nothing here imports torch.
"""

import os
import pathlib
import shutil
import tempfile

import pytest

# Every variable of the job environment contract (ARCHITECTURE.md) and the
# torchrun variables derived from it.
JOB_ENV_VARS = (
    "DEEPNEX_JOB_ID",
    "DEEPNEX_ROLE",
    "DEEPNEX_RANK",
    "DEEPNEX_WORLD_SIZE",
    "DEEPNEX_LOCAL_RANK",
    "DEEPNEX_PS_ADDRS",
    "DEEPNEX_STORE_ADDR",
    "DEEPNEX_TOKEN",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "DEEPNEX_GPU_MEMORY_LIMIT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def pytest_report_header(config):
    try:
        import deepnex
    except ImportError as e:
        return f"deepnex: NOT IMPORTABLE ({e}); set PYTHONPATH=<build>/python"
    return f"deepnex {deepnex.__version__} from {os.path.dirname(deepnex.__file__)}"


def _mount_points_under(path):
    prefix = os.path.realpath(path) + "/"
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(prefix)]


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir():
    """TMPDIR of every process the tests start: a directory of this session's,
    removed at its end. A daemon a test kills with SIGKILL (as a crash would)
    cannot remove its temporary files, e.g. its launcher's deepnex-launch-*
    state directory; they end here instead of in /tmp. Open to every user,
    as /tmp is: some tests run daemons as another user. Left in place, and
    named, if something is still mounted under it."""
    d = tempfile.mkdtemp(prefix="deepnex-tests-")
    os.chmod(d, 0o1777)
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = d
    yield d
    if saved is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = saved
    mounts = _mount_points_under(d)
    if mounts:
        print(f"conftest: {d} left in place, mounts under it: {mounts}")
    else:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def clean_job_env(monkeypatch):
    """An environment without any job variable."""
    for name in JOB_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def job_env(clean_job_env):
    """A minimal valid job environment (worker 1 of 4 in job "mnist-42");
    returns the monkeypatch to change it further."""
    clean_job_env.setenv("DEEPNEX_JOB_ID", "mnist-42")
    clean_job_env.setenv("DEEPNEX_ROLE", "worker")
    clean_job_env.setenv("DEEPNEX_RANK", "1")
    clean_job_env.setenv("DEEPNEX_WORLD_SIZE", "4")
    return clean_job_env


@pytest.fixture(scope="session")
def _simulated_hosts():
    """Why simulated hosts cannot be made here (None when they can); the
    first test that wants them also removes what a killed run left."""
    import _hosts
    why = _hosts.unavailable()
    if why is None:
        _hosts.cleanup_leftovers()
    return why


@pytest.fixture
def make_hosts(_simulated_hosts, request):
    """make_hosts({"h1": 11, "h2": 12}): simulated hosts 10.77.0.11 and .12
    (tests/python/_hosts.py), up, and torn down with everything running on
    them when the test ends, passed or failed, and with the cgroups of the
    containers recorded under the test's tmp_path. Skips without root or
    the tools."""
    if _simulated_hosts:
        pytest.skip(_simulated_hosts)
    import _hosts

    def make(hosts):
        h = _hosts.Hosts(hosts)
        if "tmp_path" in request.fixturenames:
            # Runs after h.down (finalizers run last first), which killed
            # the hosts' processes.
            from _agents import sweep_recorded_launchers
            tmp_path = request.getfixturevalue("tmp_path")
            request.addfinalizer(lambda: sweep_recorded_launchers(tmp_path))
        request.addfinalizer(h.down)
        return h.up()

    return make


@pytest.fixture(scope="module")
def slurm_two_nodes(_simulated_hosts, request):
    """A 2-node Slurm on simulated hosts: slurmctld on head (10.77.0.13),
    slurmd on n1 (10.77.0.11) and n2 (10.77.0.12), 2 GPU devices each, made
    by tests/launch/slurm.sh. Returns (hosts, env): run Slurm commands and
    jobs on head with env (SLURM_CONF). Torn down after the module's tests;
    skips where Slurm, munge or simulated hosts are missing."""
    if _simulated_hosts:
        pytest.skip(_simulated_hosts)
    import subprocess

    import _hosts
    hosts = _hosts.Hosts({"head": 13, "n1": 11, "n2": 12})
    request.addfinalizer(hosts.down)
    hosts.up()
    script = os.path.join(os.path.dirname(__file__), "..", "launch", "slurm.sh")
    # Inside the hosts' directory, so that a killed run's cluster goes with
    # its hosts (cleanup_leftovers).
    cluster = os.path.join(hosts.dir, "slurm")
    request.addfinalizer(lambda: subprocess.run(["bash", script, "stop", cluster],
                                                capture_output=True, timeout=120))
    r = subprocess.run(["bash", script, "start", cluster, hosts.dir], capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    if not os.path.exists(os.path.join(cluster, "env")):
        pytest.skip(r.stdout.strip())
    return hosts, dict(os.environ, SLURM_CONF=os.path.join(cluster, "slurm.conf"))


@pytest.fixture
def store():
    """A collective.Store on 127.0.0.1:0, stopped when the test ends."""
    from deepnex import collective
    s = collective.Store("127.0.0.1:0")
    yield s
    s.stop()


@pytest.fixture
def central_process(tmp_path):
    """deepnex-central as a subprocess, with a process-backend launcher for
    alice's and bob's containers (_central.start_central_launcher): (its
    address, its Popen). Stopped when the test ends."""
    import _central
    proc, address = _central.start_central_launcher(tmp_path)
    yield address, proc
    _central.stop_central(proc)


@pytest.fixture
def central(central_process):
    """The address of central_process's deepnex-central."""
    return central_process[0]


@pytest.fixture
def agent_hosts(make_hosts, tmp_path):
    """deepnex-central on simulated host h1 and a deepnex-agent on each of
    h2 and h3 (process backend, 2x16GiB), both nodes Ready: an
    _agents.AgentHosts. Killed when the test ends; skips without root."""
    import _agents
    _agents.require_binaries()
    cluster = _agents.AgentHosts(make_hosts({"h1": 11, "h2": 12, "h3": 13}), tmp_path)
    try:
        yield cluster.start()
    finally:
        cluster.close()


@pytest.fixture
def open_dir():
    """A directory that users' processes (running as nobody when the tests
    run as root) can reach: pytest's tmp_path lies under a directory only
    its owner can enter."""
    path = tempfile.mkdtemp(prefix="deepnex-test-")
    os.chmod(path, 0o777)
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)
