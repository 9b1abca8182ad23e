"""The pip-installed package carries what `deepnex run` needs: deepnex-ps,
deepnex-store and deepnex-central in deepnex/bin/, finding the
libdeepnex.so.N beside _C, and puts them on PATH as console scripts. Runs
only against an installed package (the venv pass of scripts/test.sh), not
the build tree."""

import glob
import os
import re
import subprocess
import sys
import sysconfig

import pytest

import deepnex

PACKAGE = os.path.dirname(os.path.abspath(deepnex.__file__))
TOOLS = ("deepnex-ps", "deepnex-store", "deepnex-central")
pytestmark = pytest.mark.skipif(
    not glob.glob(os.path.join(PACKAGE, "libdeepnex.so.*")),
    reason="deepnex is the build tree's, not an installed package")


def test_the_package_ships_its_programs():
    for tool in TOOLS:
        path = os.path.join(PACKAGE, "bin", tool)
        assert os.access(path, os.X_OK), path
        # Loads (libdeepnex from the package through $ORIGIN/..) and runs.
        out = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=30).stdout
        lib = re.search(r"libdeepnex\.so\.\d+ => (\S+)", out)
        assert lib and os.path.dirname(os.path.realpath(lib[1])) == os.path.realpath(PACKAGE), out
    assert deepnex.job._ps_binary() == os.path.join(PACKAGE, "bin", "deepnex-ps")


def test_deepnex_run_with_parameter_servers_from_the_package_alone(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("DEEPNEX_BUILD_DIR", "DEEPNEX_PS_BIN", "PYTHONPATH", "LD_LIBRARY_PATH")}
    env["DEEPNEX_RUN_DIR"] = str(tmp_path / "jobs")
    p = subprocess.run(
        [sys.executable, "-m", "deepnex", "run", "--workers", "2", "--mode", "sync", "--",
         sys.executable, "-c", "import deepnex; print('rank', deepnex.init().rank)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[worker 0] rank 0" in p.stdout and "[worker 1] rank 1" in p.stdout, p.stdout
    assert "[ps 0] deepnex-ps listening on" in p.stdout, p.stdout


@pytest.mark.parametrize("tool", TOOLS)
def test_pip_puts_the_programs_on_path(tool, tmp_path):
    scripts = sysconfig.get_path("scripts")
    script = os.path.join(scripts, tool)
    assert os.access(script, os.X_OK), script
    env = dict(os.environ, PATH=scripts + os.pathsep + os.environ.get("PATH", ""))
    # By name, as a user types it: the entry point execs the packaged program.
    out = subprocess.run([tool, "--help"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    assert out.stdout.startswith(f"usage: {tool} [flags]\n"), out.stdout
    bad = subprocess.run([tool, "--no-such-flag"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert (bad.returncode, bad.stderr) == (
        2, f'{tool}: unknown flag "--no-such-flag" (see --help)\n')

