"""Prometheus text pages as the tests read them, checked as strictly as
Prometheus' own parser does (text format 0.0.4), samples keyed by series."""

import math
import re

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_VALUE = r'"(?:[^"\\\n]|\\[\\"n])*"'
_LABEL = rf'([a-zA-Z_][a-zA-Z0-9_]*)=({_VALUE})'
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{((?:[a-zA-Z_][a-zA-Z0-9_]*={_VALUE},?)*)\}})? (\S+)$")
_HELP = re.compile(rf"^# HELP ({_NAME}) ((?:[^\\\n]|\\[\\n])*)$")
_TYPE = re.compile(rf"^# TYPE ({_NAME}) (counter|gauge|histogram|summary|untyped)$")
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def _unescape(v):
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], v)


def _number(text, line):
    if text in ("+Inf", "-Inf", "NaN"):
        return float(text.replace("Inf", "inf").replace("NaN", "nan"))
    assert re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text), line
    return float(text)


def parse(text):
    """({(name, ((label, value), ...)): value}, {name: type}) of a page.
    Fails on what a strict parser refuses: a line out of the format, a
    label value's bad escape, a family's second HELP or TYPE, a TYPE after
    its samples, a family split in two, a sample of no declared family, a
    series twice, a label twice, a counter that is negative or NaN, a
    histogram's buckets out of order or without le; and a counter whose
    name does not end in _total, or another type's that does."""
    samples, types, helps, done = {}, {}, set(), set()
    family = None
    assert text == "" or text.endswith("\n"), "the page does not end in a newline"
    for line in text.splitlines():
        if line.startswith("# HELP "):
            m = _HELP.match(line)
            assert m and m[1] not in helps, line
            helps.add(m[1])
        elif line.startswith("# TYPE "):
            m = _TYPE.match(line)
            assert m and m[1] not in types and m[1] not in done, line
            types[m[1]] = m[2]
            # Prometheus' naming: a counter's name, and no other's, ends in _total.
            assert (m[2] == "counter") == m[1].endswith("_total"), line
            if family is not None:
                done.add(family)
            family = m[1]
        elif line.startswith("#") or not line:
            continue
        else:
            m = _SAMPLE.match(line)
            assert m, line
            name, kind = m[1], types.get(family)
            suffix = name[len(family):] if family and name.startswith(family) else None
            assert suffix in _SUFFIXES.get(kind, ("",)), f"{line}: not of family {family}"
            pairs = [(k, _unescape(v[1:-1])) for k, v in re.findall(_LABEL, m[2] or "")]
            assert len({k for k, _ in pairs}) == len(pairs), f"{line}: a label twice"
            key = (name, tuple(sorted(pairs)))
            assert key not in samples, f"{line}: the series twice"
            samples[key] = _number(m[3], line)
            if kind == "counter" or suffix in ("_bucket", "_count"):
                assert samples[key] >= 0, f"{line}: a negative or NaN count"
            if suffix == "_bucket":
                assert "le" in dict(pairs), f"{line}: a bucket without le"
    for (name, labels), v in samples.items():
        if name.endswith("_bucket") and types.get(name[:-7]) == "histogram":
            rest = tuple(p for p in labels if p[0] != "le")
            bounds = sorted((float(dict(l)["le"]), c) for (n, l), c in samples.items()
                            if n == name and tuple(p for p in l if p[0] != "le") == rest)
            counts = [c for _, c in bounds]
            assert counts == sorted(counts) and math.isinf(bounds[-1][0]), (name, labels)
            assert counts[-1] == samples.get((name[:-7] + "_count", rest)), (name, labels)
    return samples, types


def series(samples, name):
    """{labels: value} of metric `name` in parse's samples."""
    return {labels: v for (n, labels), v in samples.items() if n == name}


def value(text, name):
    """The value of unlabelled metric `name` on a page."""
    samples, _ = parse(text)
    assert (name, ()) in samples, f"{name} is not in the metrics:\n{text}"
    return samples[(name, ())]
