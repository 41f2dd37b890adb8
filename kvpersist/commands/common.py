"""Helpers shared by the click commands: output formatting, common options, the exit status."""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import click

from kvpersist.config.values import MAX_DURATION_S, MAX_WAIT_S
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


class Number(click.ParamType):  # type: ignore[type-arg]
    """A number given on the command line: finite, in ``[low, high]`` (``low`` excluded when
    ``above``), an integer when ``integer``. Anything else (``nan``, ``inf``, ``1e308``, a
    negative timeout, ``0x10``) is a usage error naming the option: exit 2, never a
    traceback (issue 40: ``--timeout nan`` and ``--wait nan`` got through)."""

    def __init__(self, low: float, high: float, *, above: bool = False,
                 integer: bool = False, unit: str = "") -> None:
        self.low, self.high, self.above, self.integer = low, high, above, integer
        self.unit = unit
        self.name = "seconds" if unit == "seconds" else "integer" if integer else "number"

    def _range(self) -> str:
        low = f"more than {self.low:g} and at most" if self.above else f"from {self.low:g} to"
        kind = "an integer" if self.integer else "one"
        unit = f" {self.unit}" if self.unit else ""
        return f"give {kind} {low} {self.high:g}{unit}"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool):
            number: float = value
        else:
            text = str(value)
            pattern = _INTEGER if self.integer else _DECIMAL
            if not pattern.fullmatch(text):
                what = "an integer" if self.integer else "a number"
                self.fail(f"{text[:40]!r} is not {what} ({self._range()})", param, ctx)
            number = int(text) if self.integer else float(text)
        if not math.isfinite(number) or number > self.high or number < self.low or (
                self.above and number <= self.low):
            self.fail(f"{str(value)[:40]!r} is out of range ({self._range()})", param, ctx)
        return number


#: what a number on the command line may look like: ASCII digits, one optional point, an
#: optional sign (no exponent, no nan or inf, no "_", no other digits than 0-9)
_DECIMAL = re.compile(r"[+-]?[0-9]{1,15}(?:\.[0-9]{1,9})?|[+-]?\.[0-9]{1,9}", re.ASCII)
_INTEGER = re.compile(r"[+-]?[0-9]{1,15}", re.ASCII)
#: a network timeout: more than 0, at most an hour
TIMEOUT = Number(0, 3600, above=True, unit="seconds")
#: a wait or a time bound that may be 0 (do not wait), at most a day
WAIT = Number(0, MAX_WAIT_S, unit="seconds")
#: a time bound that must be more than 0, at most a day
SECONDS = Number(0, MAX_WAIT_S, above=True, unit="seconds")
#: an age in seconds (0 to 100 years)
AGE_S = Number(0, MAX_DURATION_S, unit="seconds")
#: a read rate in MB/s (0: unbounded)
RATE = Number(0, 1e6, unit="MB/s")


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
