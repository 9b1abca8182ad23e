"""The deepnex command line: ``python3 -m deepnex`` or ``deepnex``."""

# Annotations stay unevaluated: the command starts without importing typing.
from __future__ import annotations

import os
import sys


def _version(args) -> int:
    import deepnex

    print(f"deepnex {deepnex.__version__}")
    return 0


# The modules that add subcommands, in the order of `deepnex --help`.
_CLI_MODULES = (
    "_cli_gpu",  # nodes, alloc, release, quota, node, ...
    "_cli_launch",  # ps, launch, logs, stop
    "_cli_images",  # images, image
    "_cli_session",  # exec, shell, notebook, port-forward
    "_cli_tune",  # tune
    "_cli_job",  # run, top
    "_cli_jobs",  # jobs, job show / cancel
)
# Commands whose module is known: they parse with that module's parser
# alone, so that `deepnex shell` starts without importing the others (and
# what they import). Any other command, and no command, gets the full parser.
_COMMAND_MODULES = {
    "exec": "_cli_session",
    "shell": "_cli_session",
    "notebook": "_cli_session",
    "port-forward": "_cli_session",
}


def build_parser(modules: tuple[str, ...] = _CLI_MODULES):
    """The argument parser with the subcommands of `modules` (default: all)."""
    import argparse  # here: `deepnex shell` execs deepnex-shell without it

    parser = argparse.ArgumentParser(
        prog="deepnex",
        description="deepnex: data-parallel training on shared GPU machines.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = commands.add_parser("version", help="print the version")
    version.set_defaults(func=_version)
    for name in modules:
        __import__(f"deepnex.{name}")  # as `import`, which -X importtime reports
        sys.modules[f"deepnex.{name}"].add_commands(commands)
    # A prefix of a flag is not that flag: `--worker 2` was taken as
    # --workers, and a prefix shared later by a new flag would change meaning.
    stack = [parser]
    while stack:
        p = stack.pop()
        p.allow_abbrev = False
        stack.extend(c for a in p._actions if isinstance(a, argparse._SubParsersAction)
                     for c in a.choices.values())
    return parser


def _innermost(parser, argv):
    """The parser of the (sub)command that `argv` runs: the one whose usage
    goes with an error about its arguments. Found in argv, not in the
    parsed arguments, where a command's own `command` (tune's) hides it."""
    import argparse

    rest = list(argv)
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        names = subs[0].choices if subs else {}
        at = next((i for i, word in enumerate(rest) if word in names), None)
        if at is None:
            return parser
        parser, rest = names[rest[at]], rest[at + 1:]


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        if argv[:1] == ["shell"]:
            _exec_shell(argv[1:])
    module = _COMMAND_MODULES.get(argv[0]) if argv else None
    parser = build_parser((module,) if module else _CLI_MODULES)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Said by the subcommand's parser: argparse's own says the top-level
        # usage, which does not name the flags of the command that was meant.
        _innermost(parser, argv).error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        # Ctrl-C where a command has no handler of its own: what it held went
        # on the way out (a waiting `alloc` withdrew its request); no
        # traceback, and the shell's code for SIGINT.
        print(f"deepnex {argv[0]}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # A reader that stopped early (`deepnex alloc | head`): nothing more
        # to say, and Python's flush at exit would fail again on stdout.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _exec_shell(args: list[str]) -> None:
    """`deepnex shell` straight to deepnex-shell, before argparse and what
    it imports load (half of this command's Python start). deepnex-shell
    reads flags spelled out in full itself; anything else (--help, an
    abbreviation, a bad value) it hands back to `python -m deepnex shell`
    with DEEPNEX_NATIVE_SHELL=late, whose argparse then speaks. Returns where
    there is no deepnex-shell (argparse then says so), or with
    DEEPNEX_NATIVE_SHELL=late."""
    if os.environ.get("DEEPNEX_NATIVE_SHELL") == "late" or not sys.executable:
        return
    from deepnex._cli_common import native_shell

    path = native_shell()
    if path is None:
        return
    try:
        os.execve(path, [path, *args], dict(os.environ, DEEPNEX_SHELL_PYTHON=sys.executable))
    except OSError:
        pass  # _cli_session._shell says why


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
