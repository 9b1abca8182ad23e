"""What deepnex.tune shows: the live status of the running trials, the
summary and results.csv at the end, and show() and plot() of a journalled
search."""

import csv
import io
import json
import os
import shutil
import sys
import threading

from . import _tune_files
from ._tune_results import _finite, _tail, load


def _shown(value):
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _params(config):
    return " ".join(f"{k}={_shown(v)}" for k, v in config.items())


class _Output:
    """The stream a search prints to (the status, the summary), whose reader
    may go away (`deepnex tune ... | head -1`): from the first EPIPE on,
    what is printed is dropped and the search goes on, its trials and files
    as they would be. The stream's descriptor then points at /dev/null, so
    that the interpreter's own flush of what is still buffered, at exit,
    does not fail on the broken pipe too (Python's documented remedy)."""

    def __init__(self, out):
        self._out = out
        self.gone = False

    def write(self, text):
        if not self.gone:
            try:
                self._out.write(text)
            except BrokenPipeError:
                self._went()
        return len(text)

    def flush(self):
        if not self.gone:
            try:
                self._out.flush()
            except BrokenPipeError:
                self._went()

    def isatty(self):
        return self._out.isatty()

    def _went(self):
        self.gone = True
        try:
            fd = self._out.fileno()
        except (AttributeError, OSError, ValueError):
            return   # not a file (a StringIO): nothing is left to flush
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)


class _Status:
    """What the search shows while trials run. On a terminal: a table (trial,
    state, step, metric, parameters) redrawn in place a few times a second.
    Otherwise (a pipe, a log): a line when a trial starts and one when it
    ends, never one per report. Lines given to say() stay above the table.
    Thread-safe."""

    REFRESH = 0.25   # seconds between redraws of a changed table

    def __init__(self, trials, metric, out):
        self.trials, self.metric, self.out = trials, metric, out
        try:
            self.tty = out.isatty() and os.environ.get("TERM") != "dumb"
        except (AttributeError, ValueError):
            self.tty = False
        self._lock = threading.Lock()
        self._drawn = 0          # lines of the table on the screen now
        self._dirty = False
        self._closed = threading.Event()
        self._thread = None
        if self.tty:
            self._thread = threading.Thread(target=self._refresh, daemon=True)
            self._thread.start()

    def say(self, line):
        with self._lock:
            self._erase()
            print(line, file=self.out, flush=True)
            self._dirty = True

    def started(self, trial):
        self._changed(f"trial {trial.id} {trial.status}: {_params(trial.config)}")

    def updated(self):
        """A trial reported or was told to stop: the table's business only."""
        self._changed(None)

    def ended(self, trial):
        line = f"trial {trial.id} {trial.status}"
        if trial.results:
            line += f" at step {_shown(trial.last.get('step'))}"
            if self.metric in trial.last:
                line += f": {self.metric}={_shown(trial.last[self.metric])}"
        self._changed(line)

    def close(self):
        """Stops redrawing and takes the table off the screen."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._erase()

    def _changed(self, line):
        with self._lock:
            if self.tty:
                self._dirty = True
            elif line is not None:
                print(line, file=self.out, flush=True)

    def _refresh(self):
        while not self._closed.wait(self.REFRESH):
            with self._lock:
                if self._dirty:
                    self._erase()
                    self._draw()

    def _erase(self):
        if self._drawn:
            # To the first line of the table, then clear to the end of the screen.
            self.out.write(f"\x1b[{self._drawn}F\x1b[J")
            self.out.flush()
            self._drawn = 0

    def _draw(self):
        size = shutil.get_terminal_size()
        trials = self.trials
        counts = {}
        for t in trials:
            counts[t.status.split(" ")[0]] = counts.get(t.status.split(" ")[0], 0) + 1
        head = "tune: " + ", ".join(f"{n} {state}" for state, n in counts.items())
        rows = [["trial", "state", "step", self.metric, "parameters"]]
        room = max(3, size.lines - 4)
        shown = trials
        if len(trials) > room:
            # The running ones first, then the finished, then the pending.
            order = {"running": 0, "stopping": 0, "pending": 2}
            shown = sorted(sorted(trials, key=lambda t: order.get(t.status, 1))[:room - 1],
                           key=lambda t: t.id)
        for t in shown:
            rows.append([str(t.id), t.status, _shown(t.last.get("step", "")),
                         _shown(t.last.get(self.metric, "")), _params(t.config)])
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4]
                          for r in rows]
        if len(shown) < len(trials):
            lines.append(f"... {len(trials) - len(shown)} more")
        # A line that wraps would throw the cursor arithmetic off.
        lines = [line[:max(1, size.columns - 1)] for line in lines]
        self.out.write("\n".join(lines) + "\n")
        self.out.flush()
        self._drawn, self._dirty = len(lines), False


def show(out_dir, out=None):
    """Prints the search in out_dir: its trials, the best one and each
    trial's reports (also while the search runs)."""
    out = out or sys.stdout
    results = load(out_dir)
    _print_table(results, out, limit=None)
    print("", file=out)
    for t in results.trials:
        history = " ".join(f"{_shown(r.get('step'))}:{_shown(r.get(results.metric, ''))}"
                           for r in t.results)
        print(f"trial {t.id} {t.status}: {history or '(no reports)'}", file=out)
    _print_best(results, out)


def plot(out_dir, path=None):
    """Draws the search in out_dir into a PNG (default <out_dir>/tune.png):
    the optimisation history, each trial's intermediate values and the
    parameters' parallel coordinates. Returns the PNG's path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = load(out_dir)
    path = path or os.path.join(out_dir, "tune.png")
    metric, sign = results.metric, 1 if results.mode == "max" else -1
    fig, (history, curves, coords) = plt.subplots(1, 3, figsize=(16, 4.5))
    scored = [t for t in results.trials if t.finished and _finite(t.last.get(metric))]
    best, xs, ys = None, [], []
    for t in scored:
        v = t.last[metric]
        best = v if best is None or sign * v > sign * best else best
        xs.append(t.id)
        ys.append(best)
    history.scatter([t.id for t in scored], [t.last[metric] for t in scored], s=12)
    history.step(xs, ys, where="post", color="tab:red", label="best so far")
    history.set(title="optimisation history", xlabel="trial", ylabel=metric)
    history.legend()
    for t in results.trials:
        points = [(r["step"], r[metric]) for r in t.results if _finite(r.get(metric))]
        if points:
            curves.plot(*zip(*points), marker=".", linewidth=0.8)
    curves.set(title="intermediate values", xlabel="step", ylabel=metric)
    keys = [k for k in dict.fromkeys(k for t in scored for k in t.config)
            if all(isinstance(t.config.get(k), (int, float)) for t in scored)]
    if scored and keys:
        cols = []
        for k in keys:
            vals = [float(t.config[k]) for t in scored]
            lo, hi = min(vals), max(vals)
            cols.append([(v - lo) / (hi - lo) if hi > lo else 0.5 for v in vals])
        values = [t.last[metric] for t in scored]
        lo, hi = min(values), max(values)
        cmap = plt.get_cmap("viridis")
        for i in range(len(scored)):
            shade = (values[i] - lo) / (hi - lo) if hi > lo else 1.0
            coords.plot(range(len(keys)), [c[i] for c in cols], color=cmap(shade), alpha=0.7)
        coords.set_xticks(range(len(keys)), keys)
    coords.set(title=f"parallel coordinates (colour: {metric})", ylabel="scaled value")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    _tune_files.write_new(path, png.getvalue(), mode="wb")
    plt.close(fig)
    return path


# The summary shows this many trials at most (the best ones); results.csv
# has them all.
_SUMMARY_ROWS = 10


def _cell(v):
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _print_table(results, out, limit):
    """The trials that started (the `limit` best when there are more)."""
    shown = [t for t in results.trials if t.status != "not started"]
    rows, header = _rows(shown)
    more = 0
    if limit is not None and len(rows) > limit:
        sign = 1 if results.mode == "max" else -1
        ranked = sorted(shown, key=lambda t: (not (t.finished and _finite(
            t.last.get(results.metric))), -sign * t.last.get(results.metric, 0)
            if _finite(t.last.get(results.metric)) else 0, t.id))
        keep = {t.id for t in ranked[:limit]}
        more = len(rows) - limit
        rows = [r for t, r in zip(shown, rows) if t.id in keep]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    print("", file=out)
    for r in [header] + rows:
        print("  ".join(c.ljust(n) for c, n in zip(r, widths)).rstrip(), file=out)
    if more:
        counts = {}
        for t in shown:
            state = t.status.split(" ")[0]
            counts[state] = counts.get(state, 0) + 1
        print(f"... and {more} more ({', '.join(f'{n} {s}' for s, n in counts.items())} in "
              f"all; every trial in {results.csv_path})", file=out)


def _rows(shown):
    keys = list(dict.fromkeys(k for t in shown for k in t.config))
    metrics = list(dict.fromkeys(k for t in shown for k in t.last if k != "step"))
    header = ["trial", "status", "steps"] + keys + metrics
    rows = [[str(t.id), t.status, str(t.last.get("step", ""))]
            + [_cell(t.config.get(k, "")) for k in keys]
            + [_cell(t.last[m]) if m in t.last else "" for m in metrics] for t in shown]
    return rows, header


def _print_best(results, out):
    best = results.best
    if best is None:
        print(f"\nno finished trial reported {results.metric}", file=out)
        failed = [t for t in results.trials if t.status.startswith("failed")]
        if failed:  # why, where fewer trials ran than stop a search early
            t = failed[-1]
            path = t.log_path or os.path.join(os.path.dirname(results.csv_path),
                                              f"trial_{t.id}.log")
            print(f"{len(failed)} trial(s) failed; the last lines of {path}:", file=out)
            for line in _tail(path, 5):
                print("  " + line, file=out)
        return
    shown_config = " ".join(f"{k}={_cell(v)}" for k, v in best.config.items())
    print(f"\nbest: trial {best.id} {results.metric}={best.last[results.metric]:.4f} "
          f"config: {shown_config}", file=out)


def _write_results(results, out_dir, out):
    """results.csv, best.json and the summary (at most 20 lines)."""
    rows, header = _rows([t for t in results.trials if t.status != "not started"])
    table = io.StringIO()
    w = csv.writer(table)
    w.writerow(header)
    w.writerows(rows)
    _tune_files.write_new(results.csv_path, table.getvalue(), newline="")
    _print_table(results, out, _SUMMARY_ROWS)
    best = results.best
    if best is not None:
        _tune_files.write_new(os.path.join(out_dir, "best.json"), json.dumps(
            {"trial": best.id, "config": best.config, "result": best.last}, indent=1))
    _print_best(results, out)
    if results.interrupted:
        finished = sum(1 for t in results.trials if t.finished)
        print(f"tune: interrupted by {results.interrupted}: {finished} of "
              f"{len(results.trials)} trials finished", file=out)
    print(f"results: {results.csv_path}", file=out, flush=True)
