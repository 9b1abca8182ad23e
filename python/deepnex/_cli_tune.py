"""``deepnex tune``: hyperparameter search from the command line.

    deepnex tune --space 'lr=loguniform(0.01, 0.5)' --space 'hidden=choice([32, 64, 128])' \\
        --samples 8 --asha --max-t 12 --out tune-digits \\
        -- python3 examples/digits/mlp_numpy.py --epochs 12

Each trial runs the command with its configuration appended as --name value,
as a job (deepnex run's): --workers-per-trial workers in --job-mode, each with
--cpus cores and --gpus-per-worker GPUs. Trials run at once as far as the
machine's cores and GPUs (and --max-concurrent) allow; the others wait. In
the parameter-server modes a configuration's lr, momentum and optimizer also
go to the servers. --plain runs each trial as one plain process instead. See
deepnex.tune.
"""


def _tune(args):
    from deepnex import tune
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("deepnex tune: no command (put it after --)")
    scheduler = None
    if args.asha:
        scheduler = tune.ASHA(metric=args.metric, mode=args.mode, min_t=args.min_t,
                              max_t=args.max_t, eta=args.eta)
    if args.plain:
        runner = tune.subprocess_runner
    else:
        options = {"backend": args.backend}
        if args.central:
            options["central"] = args.central
        runner = tune.job_runner(workers=args.workers_per_trial, mode=args.job_mode,
                                 ps=args.ps, cpus=args.cpus,
                                 gpus_per_worker=args.gpus_per_worker, **options)
    results = tune.run(command, tune.parse_space(args.space), metric=args.metric,
                       mode=args.mode, num_samples=args.samples, scheduler=scheduler,
                       max_concurrent=args.max_concurrent, seed=args.seed, out_dir=args.out,
                       runner=runner)
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
    p.add_argument("--metric", default="accuracy")
    p.add_argument("--mode", choices=("max", "min"), default="max",
                   help="whether a higher or a lower metric is better (the trials' "
                        "training mode is --job-mode)")
    p.add_argument("--max-concurrent", type=int, default=None,
                   help="at most this many trials at once (default: as many as fit)")
    p.add_argument("--workers-per-trial", type=int, default=1,
                   help="workers in each trial's job (default 1)")
    p.add_argument("--job-mode", default="allreduce",
                   help="each trial's job: sync, ssp:S, async (parameter servers) or "
                        "allreduce (default)")
    p.add_argument("--ps", type=int, default=None,
                   help="parameter servers per trial (default 1 in the PS modes)")
    p.add_argument("--cpus", type=float, default=1, help="cores per worker (default 1)")
    p.add_argument("--gpus-per-worker", type=int, default=0)
    p.add_argument("--backend", default="process", help="launch backend of the trials' jobs")
    p.add_argument("--central", default=None, help="allocate from deepnex-central at ADDR")
    p.add_argument("--plain", action="store_true",
                   help="run each trial as one plain process, not as a job")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--asha", action="store_true", help="stop poor trials early (ASHA)")
    p.add_argument("--min-t", type=int, default=1, help="ASHA's first rung (default 1)")
    p.add_argument("--max-t", type=int, default=100, help="ASHA's budget (default 100)")
    p.add_argument("--eta", type=int, default=3, help="ASHA's reduction factor (default 3)")
    p.add_argument("--out", default="tune-results", help="results directory")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    p.set_defaults(func=_tune)
