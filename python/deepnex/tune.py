"""Hyperparameter search: ``deepnex.tune`` (and ``deepnex tune``).

A search runs a training command once per configuration (a trial), as many
at once as the machine's capacity (and ``max_concurrent``) allows, and ends
in a results table, a CSV and the best configuration::

    from deepnex import tune
    results = tune.run(
        ["python3", "examples/digits/mlp_numpy.py", "--mode", "allreduce"],
        space={"lr": tune.loguniform(0.01, 0.5), "hidden": tune.choice([32, 64, 128])},
        metric="accuracy", mode="max", num_samples=8,
        scheduler=tune.ASHA(max_t=12))
    results.best.config

Search spaces: ``uniform(a, b)``, ``loguniform(a, b)``, ``randint(a, b)``
(a <= n < b), ``choice([...])`` are sampled; ``grid([...])`` dimensions are
expanded into every combination; plain values are passed as they are.
``num_samples`` configurations are drawn for each grid point, by the search
method (``search=``): "tpe" or "cmaes", Optuna's samplers (ask and tell:
each new trial's configuration is proposed from the trials that ended
before; deepnex still runs the trials and decides on stopping them),
"random", or "grid" (choice() dimensions gridded too). The default is tpe
where Optuna is importable, random otherwise. ``seed`` reproduces a random
or grid search, and a tpe or cmaes one whose trials run one at a time.

A search is journalled in <out_dir>/journal.jsonl (trials, their starts,
reports and decisions, their ends; fsync'd per record): ``run(...,
resume=True)`` or ``deepnex tune --resume OUT`` continues it after a crash
or a kill, and ``load(out_dir)``, ``show`` and ``plot`` read it. The
sampler's history is the trials' configurations and results, told to it
again on a resume. Trials whose command is ``python SCRIPT.py`` start warm
(``warm=``): forked from a worker that imported what the script imports;
a script loads its data once for all of them with ``tune.warm(load_data)``
in place of ``load_data()`` (see warm()).

A trial gets its configuration as ``--name value`` arguments (underscores in
names become dashes) and as JSON in $DEEPNEX_TUNE_CONFIG (``get_config()``).
The training script calls ``deepnex.tune.report(step=epoch, accuracy=acc)``:
the metrics travel through a deepnex.collective.Store served by the search,
and the call returns True when the scheduler stops the trial, which should
then end: ``ASHA(...)`` (asynchronous successive halving) or
``Hyperband(...)`` (brackets of it that judge trials first at different
steps), or by name, ``scheduler="asha"`` or ``"hyperband"``. Outside a
search report() does nothing and returns False. In a multi-worker trial
every worker calls report() at the same steps, one of them (rank 0) with
the metrics: all of them get the same answer.

While trials run, the search shows their status (trial, state, last
metric, parameters): a table redrawn in place on a terminal, otherwise a
line when a trial starts and one when it ends. Ctrl-C (SIGINT) or SIGTERM
ends a search cleanly: no trial is started any more, the running ones are
stopped (SIGTERM, SIGKILL after a grace period) and their allocations
released, results.csv and best.json are written for what finished, and
run() raises ``Interrupted`` (a KeyboardInterrupt); ``deepnex tune`` exits
130 or 143. A trial whose search is gone fails in report() within 5 s.

Trials are started by a runner, ``runner(trial_id, argv, env, log_path)`` ->
an object with poll(), wait() and kill() (kill: stop it, waiting out its
grace period). A runner may have cancel(): an interrupted search calls it,
and the starts then waiting for resources raise CancelledError; and
close(), which the search calls at its end. The
default, ``job_runner()``, runs each trial as a deepnex job
(deepnex.job.Job: allocated cores and GPUs, its workers started with the job
environment, parameter servers in the PS modes) and starts a trial only when
its workers fit on the machine beside the running trials', so trials run in
parallel up to the machine's capacity::

    tune.run(cmd, space, runner=tune.job_runner(workers=2, mode="sync"))

``subprocess_runner`` runs each trial as one plain child process (as many
at once as there are cores, unless max_concurrent says otherwise).
"""

# The code is in private modules, one concept each (spaces, search methods,
# schedulers, a trial's reporting, runners, the search loop, its results and
# status); this module is the public surface and re-exports their names,
# and the private ones that tests reach through it.
from ._tune_report import (ENV_ATTEMPT, ENV_CHECKPOINT, ENV_CONFIG, ENV_STORE,  # noqa: F401
                           ENV_STORE_TOKEN, ENV_TRIAL, checkpoint_dir, get_config, report, warm)
from ._tune_results import Interrupted, Results, Trial, load
from ._tune_runners import job_runner, subprocess_runner
from ._tune_sampler import SEARCHES, _Sampler, default_search  # noqa: F401
from ._tune_schedulers import ASHA, SCHEDULERS, Hyperband, make_scheduler
from ._tune_search import _config_args, _Search, _Warm, command_epochs, run  # noqa: F401
from ._tune_space import choice, generate_configs, grid, loguniform, parse_space, randint, uniform
from ._tune_status import _write_results, plot, show  # noqa: F401

__all__ = ["uniform", "loguniform", "randint", "choice", "grid", "ASHA", "Hyperband",
           "SCHEDULERS", "make_scheduler", "run",
           "report", "get_config", "checkpoint_dir", "warm", "generate_configs", "parse_space",
           "Trial", "Results", "Interrupted", "job_runner", "subprocess_runner", "load",
           "show", "plot", "default_search", "SEARCHES"]

# The public classes read as deepnex.tune's (in reprs, tracebacks and help()),
# where they were defined before the split.
for _cls in (ASHA, Hyperband, Trial, Results, Interrupted):
    _cls.__module__ = __name__
del _cls
