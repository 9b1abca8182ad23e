"""What a search of deepnex.tune comes to: its Trials, the Results, the
Interrupted error, and load(), which reads them back from the journal."""

import math
import os
import signal
from dataclasses import dataclass, field

from . import _tune_journal
from .errors import NotFoundError


@dataclass
class Trial:
    id: int
    config: dict
    # pending, running, stopping (told to stop, not ended yet), then one of
    # completed, stopped (early, by the scheduler), failed (exit N),
    # interrupted (ended by Ctrl-C / SIGTERM), not started.
    status: str = "pending"
    results: list = field(default_factory=list)
    log_path: str = ""
    exit_code: int = None
    attempts: int = 0
    # A report whose metric was NaN or infinite: the trial failed.
    nonfinite: bool = False

    @property
    def last(self):
        return self.results[-1] if self.results else {}

    @property
    def finished(self):
        """Whether the trial ran to an end of its own (or the scheduler's)."""
        return self.status not in ("pending", "running", "stopping", "interrupted",
                                   "not started")


@dataclass
class Results:
    trials: list
    metric: str
    mode: str
    csv_path: str
    interrupted: str = None     # "SIGINT" or "SIGTERM" when a signal ended the search
    note: dict = field(default_factory=dict)   # run()'s note

    @property
    def best(self):
        """The completed or stopped trial whose last reported metric is
        best (None if none reported): never a failed one."""
        scored = [t for t in self.trials if t.status in ("completed", "stopped")
                  and _finite(t.last.get(self.metric))]
        if not scored:
            return None
        sign = 1 if self.mode == "max" else -1
        return max(scored, key=lambda t: sign * t.last[self.metric])


def _finite(value):
    return isinstance(value, (int, float)) and math.isfinite(value)


class Interrupted(KeyboardInterrupt):
    """Raised by run() when SIGINT (Ctrl-C) or SIGTERM ended the search,
    after the running trials were stopped and results.csv and best.json
    written for the finished ones. A KeyboardInterrupt, so that a script's
    Ctrl-C handling still applies. ``signal``: the signal's number,
    ``exit_code``: 128 + it (130, 143), ``results``: the Results."""

    def __init__(self, signum, results):
        finished = sum(1 for t in results.trials if t.finished)
        super().__init__(f"tune: interrupted by {signal.Signals(signum).name}: {finished} of "
                         f"{len(results.trials)} trials finished; results in {results.csv_path}")
        self.signal, self.exit_code, self.results = signum, 128 + signum, results


def _trials_of(records):
    """The trials a journal records, as they stood at its last record, and
    the (trial, attempt, report) records in their order."""
    trials, reports = {}, []
    for r in records:
        event = r["event"]
        if event == "trial":
            trials[r["trial"]] = Trial(r["trial"], r["config"])
            continue
        t = trials.get(r.get("trial"))
        if t is None:
            continue
        if event == "start":
            t.attempts, t.status, t.results, t.nonfinite = r["attempt"] + 1, "running", [], False
        elif event == "report":
            t.results.append(r["record"])
            reports.append((t, r["attempt"], r["record"]))
        elif event == "end":
            t.status, t.exit_code = r["status"], r["exit_code"]
            t.nonfinite = r.get("nonfinite", False)
    return [trials[i] for i in sorted(trials)], reports


def load(out_dir):
    """The Results of the search journalled in out_dir, finished or still
    running (its trials as they stand)."""
    path = os.path.join(out_dir, _tune_journal.JOURNAL)
    if not os.path.exists(path):
        raise NotFoundError(f"out_dir: {out_dir} has no search ({path})")
    records, _ = _tune_journal.read(path)
    head = records[0] if records else {}
    trials, _ = _trials_of(records)
    return Results(trials, head.get("metric", "accuracy"), head.get("mode", "max"),
                   os.path.join(out_dir, "results.csv"), note=head.get("note", {}))


def _tail(path, n):
    """The last n non-empty lines of the file at path."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
    except OSError:
        return []
    return lines[-n:]
