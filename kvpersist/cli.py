"""``kvp-admin``: the command-line interface. Parses and formats only.

Subcommands live in :mod:`kvpersist.commands` and are imported only when used, so
``kvp-admin --help`` and the read commands start fast and never import lmcache or torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from kvpersist import __version__
from kvpersist.errors import EXIT_USAGE, KvpError

#: command name -> "module:attribute"
COMMANDS: dict[str, str] = {
    "identity": "kvpersist.commands.identity:identity",
    "render": "kvpersist.commands.render:render_cmd",
    "report": "kvpersist.commands.report:report",
    "budget": "kvpersist.commands.budget:budget",
    "prune": "kvpersist.commands.prune:prune",
    "launch": "kvpersist.commands.lifecycle:launch",
    "stop": "kvpersist.commands.lifecycle:stop",
    "status": "kvpersist.commands.lifecycle:status",
    "health": "kvpersist.commands.health:health",
    "verify": "kvpersist.commands.verify:verify",
    "demo": "kvpersist.commands.demo:demo",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if self._load(name) is not None)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self._load(cmd_name)

    @staticmethod
    def _load(name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                return None  # not built yet in this checkout
            raise
        command = getattr(module, attr, None)
        return command if isinstance(command, click.Command) else None


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
    """Console entry point: run the CLI, turning kvpersist errors into messages + codes."""
    try:
        return cli.main(args=argv, prog_name="kvp-admin", standalone_mode=False)
    except KvpError as exc:
        click.echo(f"kvp-admin: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("kvp-admin: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(EXIT_USAGE if exc.exit_code == 2 else exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)


def run() -> None:
    """Entry for ``python3 -m kvpersist.cli``."""
    result = main()
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    run()
