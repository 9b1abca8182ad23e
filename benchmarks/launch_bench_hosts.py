"""launch_bench --via-agent across simulated hosts: deepnex-central (in
launch_bench) on host h1, the deepnex-agent it starts containers through on
host h2, beside the local backends and plain `runc run` on h1.

    python3 benchmarks/launch_bench_hosts.py [--build build] [launch_bench flags...]

e.g. `--n 30 --backends process,oci`. Needs root and the tools of
tests/python/_hosts.py (which says why when they are missing); the hosts
are torn down when it ends, with whatever still runs on them.
"""

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

import _hosts  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"),
                        help="the build directory (default: build)")
    args, bench_flags = parser.parse_known_args()
    bench = os.path.join(os.path.abspath(args.build), "bin", "launch_bench")
    for binary in (bench, os.path.join(os.path.dirname(bench), "deepnex-agent")):
        if not os.path.exists(binary):
            sys.exit(f"launch_bench_hosts: {binary} is not built")
    why = _hosts.unavailable()
    if why:
        sys.exit(f"launch_bench_hosts: {why}")
    with _hosts.Hosts({"h1": 11, "h2": 12}) as hosts:
        argv = [bench, "--via-agent", "--central-listen", f"{hosts.address('h1')}:0",
                "--agent-on", hosts.wrapper("h2"), *bench_flags]
        print(f"central on h1 ({hosts.address('h1')}), its agent on h2 "
              f"({hosts.address('h2')}): {' '.join(argv)}", flush=True)
        return subprocess.run(hosts.command("h1", argv)).returncode


if __name__ == "__main__":
    sys.exit(main())
