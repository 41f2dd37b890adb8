"""Jinja2 for every template kvpersist renders: one environment factory, one reader.

The environment is strict (``StrictUndefined``: a missing value is an error, never an empty
string) and never autoescapes (the outputs are argv lines, JSON and systemd units, not HTML).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jinja2

from kvpersist.errors import ConfigError, Problem
from kvpersist.system import resources


def environment(loader: jinja2.BaseLoader, *, filters: Mapping[str, Callable[..., Any]]
                | None = None, lstrip_blocks: bool = False,
                keep_trailing_newline: bool = False) -> jinja2.Environment:
    """A strict Jinja2 environment over ``loader`` with ``filters`` added."""
    env = jinja2.Environment(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=lstrip_blocks,
        keep_trailing_newline=keep_trailing_newline,
        autoescape=False,
    )
    env.filters.update(filters or {})
    return env


def read_templates(names: Iterable[str]) -> dict[str, str]:
    """The texts of the named templates under ``templates/``. Raises ConfigError naming the
    unreadable file and the fix."""
    root = resources.templates_dir()
    out: dict[str, str] = {}
    for name in names:
        try:
            out[name] = (root / name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(Problem(str(root / name), f"cannot read template: {exc}",
                                      "set KVP_HOME to the kvpersist share directory")) from exc
    return out
