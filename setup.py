"""Builds the deepnex Python package: setuptools drives CMake for deepnex._C.

    python3 -m pip install --no-build-isolation .

In the style of pybind/cmake_example. CMake builds the target _C (and with it
libdeepnex); both land in the package directory, _C finding libdeepnex.so.N
next to itself through its $ORIGIN rpath. The daemons deepnex-ps,
deepnex-store, deepnex-central and deepnex-agent land in deepnex/bin/ (where deepnex.job
looks for deepnex-ps first), finding the same libdeepnex.so.N through
$ORIGIN/.. ; console entry points of the same names put them on PATH.
Environment knobs:
CMAKE_BUILD_PARALLEL_LEVEL (default 2), DEEPNEX_CMAKE_ARGS (extra -D...),
DEEPNEX_BUILD_TYPE (default RelWithDebInfo, as scripts/build.sh, so ccache shares objects).
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# Programs shipped in deepnex/bin/: `deepnex run` starts deepnex-ps for the
# parameter-server modes; `deepnex shell` execs deepnex-shell (no console
# entry point: `deepnex shell` is how a user starts it).
TOOLS = ("deepnex-ps", "deepnex-store", "deepnex-central", "deepnex-agent", "deepnex-shell")


def project_version() -> str:
    text = (ROOT / "CMakeLists.txt").read_text()
    match = re.search(r"project\(\s*deepnex\s+VERSION\s+([0-9.]+)", text)
    if not match:
        raise RuntimeError("no project(deepnex VERSION x.y.z) in CMakeLists.txt")
    return match.group(1)


class CMakeExtension(Extension):
    def __init__(self, name: str, sourcedir: Path = ROOT) -> None:
        super().__init__(name, sources=[])
        self.sourcedir = str(sourcedir)


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        # Where setuptools wants deepnex/_C*.so: the package directory.
        ext_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        package_dir = ext_path.parent
        package_dir.mkdir(parents=True, exist_ok=True)

        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        build_type = os.environ.get("DEEPNEX_BUILD_TYPE", "RelWithDebInfo")

        configure = [
            "cmake",
            "-S", ext.sourcedir,
            "-B", str(build_dir),
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DPYTHON_EXECUTABLE={sys.executable}",
            "-DDEEPNEX_BUILD_TESTS=OFF",
            "-DDEEPNEX_BUILD_BENCHMARKS=OFF",
            "-DDEEPNEX_BUILD_PYTHON=ON",
            # Only $ORIGIN in _C's rpath: the installed copy must find the
            # libdeepnex.so.N next to it, never a build directory. The
            # programs (no rpath of their own) sit one level below it.
            "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
            "-DCMAKE_INSTALL_RPATH=$ORIGIN/..",
        ]
        if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja"]
        configure += shlex.split(os.environ.get("DEEPNEX_CMAKE_ARGS", ""))
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")
        build = ["cmake", "--build", str(build_dir), "--target", "_C", *TOOLS, "-j", jobs]

        subprocess.run(configure, check=True)
        subprocess.run(build, check=True)

        built = build_dir / "python" / "deepnex"
        modules = sorted(built.glob("_C*.so"))
        if len(modules) != 1:
            raise RuntimeError(f"expected one _C*.so in {built}, found {modules}")
        shutil.copyfile(modules[0], ext_path)

        # libdeepnex.so.N (the SONAME _C records) as a real file, not a link.
        sonames = [
            p for p in (build_dir / "lib").glob("libdeepnex.so.*")
            if re.fullmatch(r"libdeepnex\.so\.\d+", p.name)
        ]
        if len(sonames) != 1:
            raise RuntimeError(f"expected one libdeepnex.so.N in {build_dir}/lib, "
                               f"found {sonames}")
        shutil.copyfile(sonames[0], package_dir / sonames[0].name)

        bin_dir = package_dir / "bin"
        bin_dir.mkdir(exist_ok=True)
        for tool in TOOLS:
            shutil.copy2(build_dir / "bin" / tool, bin_dir / tool)


# `deepnex` and, on PATH after `pip install`, the daemons: each entry point
# execs the program in deepnex/bin/.
entry_points = {"console_scripts": [
    "deepnex = deepnex.__main__:main",
    "deepnex-agent = deepnex.__main__:agent",
    "deepnex-central = deepnex.__main__:central",
    "deepnex-ps = deepnex.__main__:ps",
    "deepnex-store = deepnex.__main__:store",
]}

setup(
    name="deepnex",
    version=project_version(),
    description="Embeddable C++ SDK with Python bindings for data-parallel training",
    python_requires=">=3.8",
    package_dir={"": "python"},
    packages=find_packages(where="python"),
    ext_modules=[CMakeExtension("deepnex._C")],
    cmdclass={"build_ext": CMakeBuild},
    entry_points=entry_points,
    zip_safe=False,
)
