"""JSON mode of the CLI: a run given ``--json`` prints exactly one JSON object on stdout.

That object is the command's own document (printed by
:func:`kvpersist.commands.common.echo_json`) or, when the command ends without printing one
(a configuration or usage error, a vanished file, an exit code without a document, an
unexpected exception), the error document::

    {"schema": "kvpersist.error/1", "error": "<the message stderr shows>", "exit_code": 2,
     "problems": [{"where": ..., "message": ..., "fix": ...}]}   # problems: ConfigError only

The message still goes to stderr and the exit code is what it would be without ``--json``.
``--json --help`` prints the help as one document too (:func:`help_document`, schema
``kvpersist.help/1``), exit 0.
:func:`kvpersist.cli.main` creates one :class:`JsonRun` per run and passes it to click as the
context's ``obj``. Formatting only: no I/O besides writing stdout.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from kvpersist.errors import ConfigError, KvpError

#: schema of the error document
ERROR_SCHEMA = "kvpersist.error/1"


def wants_json(args: Sequence[str]) -> bool:
    """True if the command line asks for ``--json`` (before a ``--`` that ends the options)."""
    head = args[:list(args).index("--")] if "--" in args else args
    return "--json" in head


#: schema of the document ``--json --help`` prints
HELP_SCHEMA = "kvpersist.help/1"
_HELP_FLAGS = ("--help", "-h")


def wants_help(args: Sequence[str]) -> bool:
    """True if the command line asks for ``--help`` (or ``-h``) before a ``--``."""
    head = args[:list(args).index("--")] if "--" in args else args
    return any(a in _HELP_FLAGS for a in head)


def help_document(text: str) -> dict[str, Any]:
    """``--json --help``: the help click prints, as one JSON object (pure)::

        {"schema": "kvpersist.help/1", "usage": "kvp-admin scrub [OPTIONS] CONFIG",
         "help": "<the whole text>"}
    """
    first = text.splitlines()[0] if text else ""
    return {"schema": HELP_SCHEMA, "usage": first.removeprefix("Usage:").strip(),
            "help": text}


def error_document(message: str, exit_code: int,
                   exc: BaseException | None = None) -> dict[str, Any]:
    """The error document for ``message`` and ``exit_code`` (pure); a ConfigError's problems
    are listed, the type of an exception that is not a kvpersist or click error is named."""
    doc: dict[str, Any] = {"schema": ERROR_SCHEMA, "error": message, "exit_code": exit_code}
    if isinstance(exc, ConfigError):
        doc["problems"] = [{"where": p.where, "message": p.message, "fix": p.fix}
                           for p in exc.problems]
    elif exc is not None and not isinstance(exc, KvpError | click.ClickException):
        doc["exception"] = type(exc).__name__
    return doc


class JsonRun:
    """One run of the CLI: was ``--json`` asked for, and has the command printed its
    document (:meth:`mark_written`)?"""

    def __init__(self, requested: bool) -> None:
        self.requested = requested
        self.written = False

    def mark_written(self) -> None:
        self.written = True

    def fail(self, message: str, exit_code: int, exc: BaseException | None = None) -> None:
        """Print the error document on stdout, unless JSON was not asked for or the command
        already printed its document (a second object would break the one-object rule)."""
        if not self.requested or self.written:
            return
        self.written = True
        click.echo(json.dumps(error_document(message, exit_code, exc), indent=2,
                              sort_keys=True))

    def fail_on_code(self, code: object) -> None:
        """An exit status (``SystemExit.code``, a click ``Exit``, a returned int) that is not
        0, met before the command printed its document: the error document says so."""
        if code is None or code == 0:
            return
        if isinstance(code, int):
            self.fail(f"exited with status {code} without printing a result", code)
        else:  # SystemExit("message") prints the message and exits 1
            self.fail(str(code), 1)


def mark_written() -> None:
    """Note, on the current run (if any), that the command printed its JSON document."""
    ctx = click.get_current_context(silent=True)
    run = ctx.find_object(JsonRun) if ctx is not None else None
    if run is not None:
        run.mark_written()
