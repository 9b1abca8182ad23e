"""What the deepnex CLI's commands share: the address, token and client of
the commands against deepnex-central, one-line errors, tables and KEY=VALUE
arguments.

Every command finds deepnex-central the same way: --central, else
$DEEPNEX_CENTRAL, read when the command runs; the token is --token, else
--token-file, else $DEEPNEX_TOKEN.
"""

import os
import sys


def add_central_args(p):
    """The options every command against deepnex-central takes."""
    p.add_argument("--central", help="host:port of deepnex-central ($DEEPNEX_CENTRAL)")
    p.add_argument("--token", help="bearer token ($DEEPNEX_TOKEN)")
    p.add_argument("--token-file", help="file holding the bearer token")
    p.add_argument("--tls-ca-file", help="PEM CA certificate to verify deepnex-central's TLS")
    p.add_argument("--call-timeout", type=float, default=30.0, help="seconds per call")


def add_worker_resources(p):
    """--cpus and --memory, what each worker of a job is allocated: deepnex
    run's job's workers, deepnex tune's trials' (one definition, so that
    the two commands take the same values)."""
    p.add_argument("--cpus", type=float, default=1,
                   help="CPU cores per worker (default 1); OMP_NUM_THREADS follows it")
    p.add_argument("--memory", default=None,
                   help="memory per worker (e.g. 4GiB); default: an equal share of this "
                        "machine's, and required with --central")


def central_address(args):
    """deepnex-central's host:port from --central or $DEEPNEX_CENTRAL; None
    when neither is set."""
    return args.central or os.environ.get("DEEPNEX_CENTRAL") or None


def central_token(args):
    """--token, or $DEEPNEX_TOKEN unless --token-file names the token's file."""
    return args.token or (None if args.token_file else os.environ.get("DEEPNEX_TOKEN"))


def client(args):
    """A deepnex.gpu.CentralClient from add_central_args' options."""
    from deepnex import gpu
    address = central_address(args)
    if not address:
        raise SystemExit("deepnex: no central address (--central or $DEEPNEX_CENTRAL)")
    return gpu.CentralClient(address, token=central_token(args), token_file=args.token_file,
                             tls_ca_file=args.tls_ca_file, timeout=args.call_timeout)


def guard(fn):
    """fn(args), with a DeepnexError printed as one line and exit code 1."""
    def run(args):
        from deepnex import DeepnexError
        try:
            return fn(args)
        except DeepnexError as e:
            print(f"deepnex: {e}", file=sys.stderr)
            return 1
    return run


def native_shell():
    """deepnex-shell, the C++ client of `deepnex shell`: the package's
    (deepnex/bin/) or the build tree's (<build>/bin/); None where there is
    none."""
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.join(here, "bin", "deepnex-shell"),
                 os.path.join(here, "..", "..", "bin", "deepnex-shell")):
        if os.access(path, os.X_OK):
            return os.path.abspath(path)
    return None


# C0 and C1 control characters and DEL, as \x.. (see printable).
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7f, 0xa0)]}


def printable(text):
    """`text` with its control characters escaped (ESC as \\x1b): commands,
    metric names and messages that one user wrote reach another's (an
    admin's) terminal, where raw escape sequences clear it, retitle it or
    overwrite lines."""
    return text.translate(_CONTROL)


def format_table(table):
    """Rows of strings (the header first) as left-aligned columns, each
    cell printable()."""
    table = [[printable(c) for c in row] for row in table]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)


def parse_pairs(items, flag):
    """{KEY: VALUE} from repeated KEY=VALUE arguments of ``flag``; a
    SystemExit naming the flag and the item for one without "=" or a key."""
    out = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"deepnex: {flag} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out
