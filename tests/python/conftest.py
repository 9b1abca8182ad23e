"""Shared pytest setup for deepnex's Python tests.

Run against a build tree:
    PYTHONPATH=<build>/python /usr/bin/python3 -m pytest -q tests/python
or against an installed package (pip install). Nothing here imports torch.
"""

import os

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
    them when the test ends, passed or failed. Skips without root or the
    tools."""
    if _simulated_hosts:
        pytest.skip(_simulated_hosts)
    import _hosts

    def make(hosts):
        h = _hosts.Hosts(hosts)
        request.addfinalizer(h.down)
        return h.up()

    return make
