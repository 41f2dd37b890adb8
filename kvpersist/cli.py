"""``kvp-admin``: the command-line interface. Parses and formats only.

Subcommands live in :mod:`kvpersist.commands` and are imported only when used: ``--help``
lists them from :data:`COMMANDS` without importing any of them, and running one imports only
its own module, so the read commands start fast and never import lmcache or torch.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
from dataclasses import dataclass
from typing import Any

import click

from kvpersist import __version__
from kvpersist.errors import EXIT_USAGE, KvpError
from kvpersist.json_mode import JsonRun, help_document, wants_help, wants_json


@dataclass(frozen=True)
class Entry:
    """Where a subcommand lives and its one-line help, known without importing it."""

    target: str  #: "module:attribute" of the click command
    summary: str  #: the command's short help (the first sentence of its docstring)


#: command name -> where it lives and what ``--help`` says about it. ``summary`` must equal
#: the real command's short help; tests/unit/test_cli_startup.py keeps the two from drifting.
COMMANDS: dict[str, Entry] = {
    "identity": Entry("kvpersist.commands.identity:identity",
                      "Compatibility identity and namespace of a deployment."),
    "render": Entry("kvpersist.commands.render:render_cmd",
                    "Render the lmcache server argv, vLLM arguments and namespace manifest of "
                    "CONFIG."),
    "report": Entry("kvpersist.commands.report:report",
                    "What the L2 cache holds per namespace, on disk and on the shared tier."),
    "budget": Entry("kvpersist.commands.budget:budget",
                    "How much L1 (RAM) and L2 (NVMe) the deployment's cache server may use, "
                    "and why."),
    "prune": Entry("kvpersist.commands.prune:prune",
                   "Delete L2 cache files explicitly: dry run unless --apply."),
    "launch": Entry("kvpersist.commands.lifecycle:launch",
                    "Preflight CONFIG, start whatever of its lmcache server and vLLM does not "
                    "run, warm up."),
    "stop": Entry("kvpersist.commands.lifecycle:stop",
                  "Stop CONFIG's vLLM, then its cache server."),
    "restart": Entry("kvpersist.commands.lifecycle:restart",
                     "Restart CONFIG, or only its vLLM or its cache server; L2 files stay on "
                     "disk."),
    "status": Entry("kvpersist.commands.lifecycle:status",
                    "Show whether CONFIG's cache server and vLLM run (pid files checked, not "
                    "trusted)."),
    "health": Entry("kvpersist.commands.health:health",
                    "Check CONFIG's cache server, cache root, vLLM, its warm-up and its canary."),
    "fleet": Entry("kvpersist.commands.fleet:fleet",
                   "The hosts sharing the shared tier, from their fleet records."),
    "metrics": Entry("kvpersist.commands.metrics:metrics",
                     "Prometheus metrics of cache roots, shared-tier stores and deployments: "
                     "bytes per namespace, budget, free space, temp and quarantined files, "
                     "health, last verify and prune, keys and memory of the shared tier."),
    "verify": Entry("kvpersist.commands.verify:verify",
                    "Check CONFIG's cache root: wrong sizes, frames failing authentication "
                    "with the deployment's key, one frame under two names, a frame recorded "
                    "under another chunk's name, links, FIFOs and unreadable files under "
                    "chunk names, stale temp files."),
    "scrub": Entry("kvpersist.commands.scrub:scrub",
                   "Zero the padding after the aesgcm frame of CONFIG's chunk files (stale L1 "
                   "bytes, often plaintext KV of other chunks)."),
    "weights": Entry("kvpersist.commands.weights:weights",
                     "Check that the weights at CONFIG's KVP_MODEL_PATH are those its namespace "
                     "was first served with."),
    "warmup": Entry("kvpersist.commands.warmup:warmup",
                    "Prefetch CONFIG's warm set (KVP_WARMUP_FILE) from disk into the cache "
                    "server's memory."),
    "canary": Entry("kvpersist.commands.canary:canary",
                    "The namespace's known-answer canary: what it found, a run now, reset."),
    "forget": Entry("kvpersist.commands.forget:forget",
                    "Remove one conversation's KV chunks from every tier: dry run unless "
                    "--apply."),
    "shred": Entry("kvpersist.commands.shred:shred",
                   "Destroy a namespace's L2 key, then its data: dry run unless --apply."),
    "upgrade": Entry("kvpersist.commands.upgrade:upgrade",
                     "Plan a vLLM, LMCache or model upgrade: what changes and the steps, "
                     "read-only."),
    "demo": Entry("kvpersist.commands.demo:demo",
                  "Launch the cache server and vLLM (CPU build) on a generated model, send a "
                  "long chat, restart both, send it again: cold vs after-restart time to first "
                  "token, tokens served from disk, identical output."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use.

    Listing them (``kvp-admin --help``, or no arguments) reads :data:`COMMANDS` only, so it
    imports no command module; running one imports that command's module and nothing else.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self._load(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The "Commands" section from the registry, shortened exactly as click would."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = [(name, click.Command(name, help=COMMANDS[name].summary).get_short_help_str(limit))
                for name in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    @staticmethod
    def _load(name: str) -> click.Command | None:
        entry = COMMANDS.get(name)
        if entry is None:
            return None
        module_name, attr = entry.target.split(":")
        module = importlib.import_module(module_name)
        command = getattr(module, attr, None)
        if not isinstance(command, click.Command):
            raise TypeError(f"{entry.target} is not a click command")
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"],
                                              "max_content_width": 100})
@click.version_option(__version__, prog_name="kvp-admin")
def cli() -> None:
    """Persistent KV cache for vLLM on local NVMe, around stock LMCache.

    CONFIG is a path to an identity.env, a directory holding one, or a name under configs/.
    Exit codes: 0 success, 1 a check found a problem, 2 usage or configuration error.
    Nothing is ever deleted unless you run prune/verify with --apply.
    """


def main(argv: list[str] | None = None) -> Any:
    """Console entry point: run the CLI, turning kvpersist errors into messages + codes.

    Returns the exit status a command set (``kvpersist.commands.common.exit_with``: click
    returns it under ``standalone_mode=False``), or None (status 0) when it returned; the
    console script and :func:`run` exit with it. A :class:`KvpError` prints one
    ``kvp-admin: ...`` message and exits with its ``exit_code``. With ``--json`` stdout
    carries exactly one JSON object whatever happens: the command's document or, when it
    ends without one, the error document of :class:`~kvpersist.json_mode.JsonRun` (the
    message still goes to stderr, the exit code is unchanged)."""
    if argv is None:  # the process's own entry (the console script): its own streams
        _forgiving_streams()
    args = sys.argv[1:] if argv is None else list(argv)
    run = JsonRun(wants_json(args))
    if run.requested and wants_help(args):
        text = _help_text(args)
        if text is not None:  # --json --help: the help as the one JSON document
            click.echo(json.dumps(help_document(text), indent=2, sort_keys=True))
            return 0
    try:
        result = cli.main(args=args, prog_name="kvp-admin", standalone_mode=False, obj=run)
    except KvpError as exc:
        run.fail(str(exc), exc.exit_code, exc)
        click.echo(f"kvp-admin: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        run.fail("aborted", 130)
        click.echo("kvp-admin: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        code = EXIT_USAGE if exc.exit_code == 2 else exc.exit_code
        run.fail(exc.format_message(), code, exc)
        exc.show()
        sys.exit(code)
    except click.exceptions.Exit as exc:
        run.fail_on_code(exc.exit_code)
        sys.exit(exc.exit_code)
    except SystemExit as exc:
        run.fail_on_code(exc.code)
        raise
    except Exception as exc:  # a bug: the traceback still goes to stderr, exit 1
        run.fail(f"internal error: {type(exc).__name__}: {exc}", 1, exc)
        raise
    run.fail_on_code(result)
    return result


def _help_text(args: list[str]) -> str | None:
    """The help click prints for ``args`` (which ask for it), or None when the command line
    fails before (an unknown option, a bad value: the normal run reports it). Parsing only:
    with ``--help`` no command runs."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            cli.main(args=args, prog_name="kvp-admin", standalone_mode=False,
                     obj=JsonRun(False))
    except click.exceptions.Exit as exc:
        if exc.exit_code == 0 and out.getvalue().startswith("Usage:"):
            return out.getvalue()
        return None
    except (click.ClickException, click.exceptions.Abort, KvpError):
        return None
    return out.getvalue() if out.getvalue().startswith("Usage:") else None


def _forgiving_streams() -> None:
    """Paths are printed escaped, but should text that is not UTF-8 still reach a stream
    that refuses it (a UTF-8 locale's ``strict`` stdout), it is written escaped
    (``\\udcff``) rather than ending the command with ``UnicodeEncodeError``."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")


def run() -> None:
    """Entry for ``python3 -m kvpersist.cli``."""
    result = main()
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    run()
