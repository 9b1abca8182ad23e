"""Prometheus text pages as the tests read them: each sample line checked
against the exposition format, samples keyed by series."""

import re

_SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{((?:[a-zA-Z_][a-zA-Z0-9_]*="[^"]*",?)*)\})? '
    r'(-?[0-9.e+-]+|\+Inf|NaN)$')


def parse(text):
    """({(name, ((label, value), ...)): value}, {name: type}) of a page;
    fails on a sample line that is not in the exposition format."""
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, line
            labels = tuple(re.findall(r'(\w+)="([^"]*)"', m[3] or ""))
            samples[(m[1], labels)] = float(m[4])
    return samples, types


def series(samples, name):
    """{labels: value} of metric `name` in parse's samples."""
    return {labels: v for (n, labels), v in samples.items() if n == name}


def value(text, name):
    """The value of unlabelled metric `name` on a page."""
    samples, _ = parse(text)
    assert (name, ()) in samples, f"{name} is not in the metrics:\n{text}"
    return samples[(name, ())]
