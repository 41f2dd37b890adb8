"""Metric names in PromQL and where they come from, for the monitoring/ tests.

* :func:`metric_names`: the metric names an expression selects (strings, label matchers,
  ranges and ``by``/``on``/... label lists removed first; functions and keywords skipped);
* :func:`documented_names`: the ``kvpersist_*`` names of the table in docs/observability.md;
* :func:`vllm_metric_names`: the exposed names of the metrics vLLM's code defines
  (``vllm:*``; counters with ``_total``, histograms with ``_bucket``/``_sum``/``_count``),
  read from the installed package's source without importing it;
* :func:`exposition_names`: the sample names of a Prometheus text exposition.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

#: PromQL words that look like identifiers but select nothing
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "and",
                      "or", "unless", "bool", "offset", "inf", "nan"})
#: Grafana's variables, replaced by values a plain Prometheus accepts
GRAFANA_VALUES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def grafana_to_promql(expr: str) -> str:
    """A panel's query as Prometheus would receive it with every variable set to All."""
    for var, value in GRAFANA_VALUES.items():
        expr = expr.replace(var, value)
    return re.sub(r"\$\{?([A-Za-z_]\w*)\}?", ".*", expr)


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"'(?:[^'\\]|\\.)*'", "''", s)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names: set[str] = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        if m.start() and (s[m.start() - 1].isdigit() or s[m.start() - 1] in ".$"):
            continue  # a number (1e3), a duration (1h) or a leftover variable
        if s[m.end():].lstrip().startswith("("):
            continue  # a function or an aggregation
        if m.group().lower() in KEYWORDS:
            continue
        names.add(m.group())
    return names


def documented_names(doc: Path) -> set[str]:
    """The names in the first column of the metrics table of docs/observability.md."""
    names: set[str] = set()
    for line in doc.read_text().splitlines():
        if line.startswith("| `kvpersist_"):
            first = line.split("|")[1]
            names.update(re.findall(r"`(kvpersist_[a-z0-9_]+)`", first))
    return names


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "gauge": ("",)}


def vllm_metric_names() -> set[str]:
    """Exposed names of the ``vllm:*`` metrics defined under the installed vllm/v1/."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vllm is not installed"
    base = Path(next(iter(spec.submodule_search_locations))) / "v1"
    names: set[str] = set()
    for path in base.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            fname = (func.attr if isinstance(func, ast.Attribute)
                     else func.id if isinstance(func, ast.Name) else "").lower()
            kind = next((k for k in _SUFFIXES if k in fname), None)
            for kw in node.keywords:
                if (kind and kw.arg == "name" and isinstance(kw.value, ast.Constant)
                        and isinstance(kw.value.value, str)
                        and kw.value.value.startswith("vllm:")):
                    # prometheus_client drops a counter's own _total before adding it
                    base_name = kw.value.value.removesuffix("_total")
                    names.update(base_name + sfx for sfx in _SUFFIXES[kind])
    return names


def exposition_names(text: str) -> set[str]:
    """Sample names of a text exposition."""
    return {m.group(1) for m in re.finditer(r"^([A-Za-z_:][A-Za-z0-9_:]*)[{ ]", text, re.M)}
