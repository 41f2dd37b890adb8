"""Helpers shared by the click commands: output formatting, common options, the exit status."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import click

from kvpersist.json_mode import mark_written

F = TypeVar("F", bound=Callable[..., Any])

config_argument = click.argument("config", metavar="CONFIG")


def exit_with(code: int) -> NoReturn:
    """End the command with exit status ``code``: the one way a command in commands/ sets
    its status (an error is a :class:`~kvpersist.errors.KvpError` instead, which
    ``kvpersist.cli.main`` prints and exits with).

    Raises ``click.exceptions.Exit``: click closes the context, and ``cli.main`` (which runs
    click with ``standalone_mode=False``) returns ``code`` for the console script to exit
    with."""
    raise click.exceptions.Exit(code)


def json_option(func: F) -> F:
    """Add ``--json`` (machine-readable output with a stable schema)."""
    return click.option("--json", "as_json", is_flag=True,
                        help="Print one JSON object (stable schema) instead of text.")(func)


def echo_json(obj: Any) -> None:
    """Print ``obj`` as the command's one JSON document (see :mod:`kvpersist.json_mode`)."""
    click.echo(json.dumps(obj, indent=2, sort_keys=True))
    mark_written()


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain-text table with left-aligned columns."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def progress_printer(what: str, delay_s: float = 1.0) -> Callable[..., None] | None:
    """A progress callback writing to stderr, or None if stderr is not a terminal.

    Nothing is shown during the first ``delay_s`` seconds, so quick runs stay quiet.
    """
    if not sys.stderr.isatty():
        return None
    start = time.monotonic()

    def show(done: int, total: int | None = None) -> None:
        if time.monotonic() - start < delay_s:
            return
        of = f"/{total:,}" if total else ""
        click.echo(f"\r{what}: {done:,}{of}  ", err=True, nl=False)

    return show


def end_progress(cb: Callable[..., None] | None) -> None:
    if cb is not None:
        click.echo("\r" + " " * 60 + "\r", err=True, nl=False)


def inventory_options(func: F) -> F:
    """``--root DIR`` and ``--config CONFIG`` (repeatable)."""
    func = click.option("--config", "configs", multiple=True, metavar="CONFIG",
                        help="Deployment config whose namespace is active (repeatable). "
                             "Default: every config under configs/ on this root.")(func)
    return click.option("--root", type=click.Path(file_okay=False), default=None,
                        help="Cache root to inspect (default: the configs' KVP_CACHE_ROOT).")(func)
