"""``deepnex tune``: hyperparameter search from the command line.

    deepnex tune --space 'lr=loguniform(0.01, 0.5)' --space 'hidden=choice([32, 64, 128])' \\
        --samples 8 --asha --max-t 12 --out tune-digits \\
        -- python3 examples/digits/mlp_numpy.py --epochs 12

Each trial runs the command with its configuration appended as --name value,
as a job (deepnex run's): --workers-per-trial workers in --mode (sync,
ssp:S, async, allreduce), each with --cpus cores and --gpus-per-worker GPUs.
Trials run at once as far as the machine's cores and GPUs (and
--max-concurrent) allow; the others wait. In the parameter-server modes a
configuration's lr, momentum and optimizer also go to the servers. --plain
runs each trial as one plain process instead. --metric is maximized, or
minimized with --direction min.

While trials run, a status table is redrawn in place on a terminal (a line
per trial start and end otherwise). Ctrl-C or SIGTERM stops the running
trials, writes results.csv and best.json for the finished ones and exits 130
or 143. See deepnex.tune.
"""

import os
import sys


def _warn(message):
    print(f"deepnex tune: {message}", file=sys.stderr, flush=True)


def _modes(args):
    """(training mode, direction) from --mode, --job-mode and --direction,
    with the old spellings (--mode max|min, --job-mode) warned about."""
    mode, direction = args.mode, args.direction
    if mode in ("max", "min"):
        _warn(f"--mode {mode} is deprecated for the metric's direction: use --direction "
              f"{mode} (--mode is now the trials' training mode)")
        if direction is not None and direction != mode:
            raise SystemExit(f"deepnex tune: --mode {mode} and --direction {direction} "
                             "disagree")
        mode, direction = None, mode
    if args.job_mode is not None:
        _warn(f"--job-mode is deprecated: use --mode {args.job_mode}")
        if mode is not None and mode != args.job_mode:
            raise SystemExit(f"deepnex tune: --mode {mode} and --job-mode {args.job_mode} "
                             "disagree")
        mode = args.job_mode
    return mode or "allreduce", direction or "max"


def _tune(args):
    from deepnex import tune
    from deepnex.errors import InvalidArgumentError
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("deepnex tune: no command (put it after --)")
    mode, direction = _modes(args)
    if args.token and args.token_file:
        raise SystemExit(f"deepnex tune: --token and --token-file {args.token_file} were "
                         "both given; give one")
    try:
        space = tune.parse_space(args.space)
        scheduler = None
        if args.asha:
            scheduler = tune.ASHA(metric=args.metric, mode=direction, min_t=args.min_t,
                                  max_t=args.max_t, eta=args.eta)
        if args.plain:
            runner = tune.subprocess_runner
        else:
            options = {"backend": args.backend}
            if args.central:
                options["central"] = args.central
                if args.token_file:
                    options["central_token_file"] = args.token_file
                else:
                    options["central_token"] = args.token or os.environ.get("DEEPNEX_TOKEN")
            runner = tune.job_runner(workers=args.workers_per_trial, mode=mode, ps=args.ps,
                                     cpus=args.cpus, gpus_per_worker=args.gpus_per_worker,
                                     **options)
    except InvalidArgumentError as e:
        raise SystemExit(f"deepnex tune: {e}") from None
    try:
        results = tune.run(command, space, metric=args.metric, mode=direction,
                           num_samples=args.samples, scheduler=scheduler,
                           max_concurrent=args.max_concurrent, seed=args.seed,
                           out_dir=args.out, runner=runner)
    except tune.Interrupted as e:
        # The search has said what finished and where the results are.
        return e.exit_code
    return 0 if results.best is not None else 1


def add_commands(commands):
    import argparse
    p = commands.add_parser("tune", help="hyperparameter search (random, grid, ASHA)",
                            description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--space", action="append", default=[], metavar="NAME=EXPR",
                   help="a dimension: a literal, uniform(a, b), loguniform(a, b), "
                        "randint(a, b), choice([...]) or grid([...]); repeatable")
    p.add_argument("--samples", type=int, default=4,
                   help="configurations drawn per grid point (default 4)")
    p.add_argument("--metric", default="accuracy",
                   help="the reported metric that ranks trials (default accuracy)")
    p.add_argument("--direction", choices=("max", "min"), default=None,
                   help="whether a higher (max, the default) or a lower (min) metric is "
                        "better")
    p.add_argument("--mode", default=None, metavar="sync|ssp:S|async|allreduce",
                   help="each trial's training mode: sync, ssp:S or async (with parameter "
                        "servers) or allreduce (default)")
    p.add_argument("--job-mode", default=None, help="deprecated: use --mode")
    p.add_argument("--max-concurrent", type=int, default=None,
                   help="at most this many trials at once (default: as many as fit)")
    p.add_argument("--workers-per-trial", type=int, default=1,
                   help="workers in each trial's job (default 1)")
    p.add_argument("--ps", type=int, default=None,
                   help="parameter servers per trial (default 1 in the PS modes)")
    p.add_argument("--cpus", type=float, default=1, help="cores per worker (default 1)")
    p.add_argument("--gpus-per-worker", type=int, default=0,
                   help="GPUs per worker (default 0)")
    p.add_argument("--backend", default="process",
                   help="launch backend of the trials' jobs (default process)")
    p.add_argument("--central", default=None, metavar="ADDR",
                   help="allocate the trials' jobs from deepnex-central at ADDR")
    p.add_argument("--token", default=None,
                   help="bearer token for --central (default $DEEPNEX_TOKEN)")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="read the token for --central from FILE instead")
    p.add_argument("--plain", action="store_true",
                   help="run each trial as one plain process, not as a job")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random search (default 0)")
    p.add_argument("--asha", action="store_true", help="stop poor trials early (ASHA)")
    p.add_argument("--min-t", type=int, default=1, help="ASHA's first rung (default 1)")
    p.add_argument("--max-t", type=int, default=100, help="ASHA's budget (default 100)")
    p.add_argument("--eta", type=int, default=3, help="ASHA's reduction factor (default 3)")
    p.add_argument("--out", default="tune-results",
                   help="results directory (default tune-results)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    p.set_defaults(func=_tune)
