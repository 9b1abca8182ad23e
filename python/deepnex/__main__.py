"""The deepnex command line: ``python3 -m deepnex`` or ``deepnex``."""

import argparse
import os
import sys
from typing import List, Optional


def _version(args: argparse.Namespace) -> int:
    import deepnex

    print(f"deepnex {deepnex.__version__}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; parts add their subcommands here."""
    parser = argparse.ArgumentParser(
        prog="deepnex",
        description="deepnex: data-parallel training on shared GPU machines.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = commands.add_parser("version", help="print the version")
    version.set_defaults(func=_version)
    from deepnex import _cli_gpu  # nodes, alloc, release, quota, node, ...

    _cli_gpu.add_commands(commands)
    from deepnex import _cli_launch  # ps

    _cli_launch.add_commands(commands)
    from deepnex import _cli_images  # images, image

    _cli_images.add_commands(commands)
    from deepnex import _cli_session  # exec, shell, port-forward

    _cli_session.add_commands(commands)
    from deepnex import _cli_tune  # tune

    _cli_tune.add_commands(commands)
    from deepnex import _cli_job  # run, top

    _cli_job.add_commands(commands)
    from deepnex import _cli_jobs  # jobs, job show / cancel

    _cli_jobs.add_commands(commands)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return args.func(args)


def _exec_program(name: str) -> None:
    """Replaces this process with the daemon `name` that the package ships in
    deepnex/bin/, passing on the arguments: the console entry points
    deepnex-central, deepnex-ps and deepnex-store (see setup.py)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", name)
    if not os.access(path, os.X_OK):
        raise SystemExit(f"{name}: {path} is missing; reinstall the deepnex package")
    os.execv(path, [path, *sys.argv[1:]])


def agent() -> None:
    _exec_program("deepnex-agent")


def central() -> None:
    _exec_program("deepnex-central")


def ps() -> None:
    _exec_program("deepnex-ps")


def store() -> None:
    _exec_program("deepnex-store")


if __name__ == "__main__":
    sys.exit(main())
