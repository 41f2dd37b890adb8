"""kvp-admin start-up: ``--help`` lists commands from the registry in cli.py without importing
any of them, the registry cannot drift from the real commands, and the commands that do not
launch anything never import lmcache or torch."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from kvpersist.cli import COMMANDS, cli

from ..conftest import REPO, clean_env

#: never imported by ``kvp-admin --help`` (nor with no arguments)
NOT_FOR_HELP = ("kvpersist.commands", "lmcache", "torch", "vllm", "transformers", "requests",
                "psutil", "jinja2", "yaml")
#: never imported by a command that does not launch anything
HEAVY = ("lmcache", "torch", "vllm", "transformers")

#: Runs ``python -m kvpersist.cli ARGS`` in-process, then prints the loaded modules as JSON.
WRAPPER = """\
import json, runpy, sys
sys.argv = ["kvp-admin", *sys.argv[1:]]
try:
    runpy.run_module("kvpersist.cli", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print("\\nMODULES=" + json.dumps({"code": code, "file": sys.modules["kvpersist"].__file__,
                                 "modules": sorted(sys.modules)}))
"""


def loaded_modules(*args: str) -> tuple[object, list[str]]:
    """Exit code and ``sys.modules`` after ``python -m kvpersist.cli ARGS`` in a fresh
    interpreter (this checkout's package, no KVP_ settings)."""
    env = dict(clean_env(), KVP_CACHE_ROOT="/tmp/kvp-import-check")
    res = subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=120)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("MODULES=")]
    assert line, res.stdout + res.stderr
    data = json.loads(line[-1].removeprefix("MODULES="))
    assert data["file"] == str(REPO / "kvpersist" / "__init__.py")
    return data["code"], data["modules"]


def matching(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == n or m.startswith(n + ".") for n in names)]


def real_command(name: str) -> click.Command:
    module_name, attr = COMMANDS[name].target.split(":")
    command = getattr(importlib.import_module(module_name), attr)
    assert isinstance(command, click.Command), COMMANDS[name].target
    return command


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_registry_summary_is_the_commands_own_short_help(name: str) -> None:
    """The summary ``--help`` shows is the one the command's docstring gives click."""
    command = real_command(name)
    assert command.name == name
    assert COMMANDS[name].summary == command.get_short_help_str(limit=10_000)


def test_help_lists_what_the_real_commands_would() -> None:
    """The lazy listing is exactly the one click prints with every command imported."""
    eager = click.Group("kvp-admin", commands={n: real_command(n) for n in COMMANDS},
                        context_settings=cli.context_settings)
    lazy_text = CliRunner().invoke(cli, ["--help"], prog_name="kvp-admin").output
    eager_text = CliRunner().invoke(eager, ["--help"], prog_name="kvp-admin").output
    section = lazy_text[lazy_text.index("Commands:"):]
    assert section == eager_text[eager_text.index("Commands:"):]
    for name in COMMANDS:
        assert f"\n  {name} " in section


@pytest.mark.parametrize("args", [["--help"], ["-h"], []])
def test_help_imports_no_command_module(args: list[str]) -> None:
    code, modules = loaded_modules(*args)
    assert code in (0, 2)  # no arguments: click prints the help and exits 2
    assert matching(modules, NOT_FOR_HELP) == []


@pytest.mark.parametrize("args", [
    ["identity", "show", "cpu-demo"],
    ["identity", "namespace", "cpu-demo"],
    ["identity", "--help"],
    ["render", "--help"],
    ["report", "--help"],
    ["budget", "--help"],
    ["prune", "--help"],
    ["verify", "--help"],
    ["stop", "--help"],
    ["status", "--help"],
    ["health", "--help"],
])
def test_commands_that_do_not_launch_never_import_lmcache_or_torch(args: list[str]) -> None:
    code, modules = loaded_modules(*args)
    assert code == 0
    assert matching(modules, HEAVY) == []


def test_a_command_imports_only_its_own_command_module() -> None:
    _, modules = loaded_modules("identity", "--help")
    own = {"kvpersist.commands", "kvpersist.commands.identity", "kvpersist.commands.common"}
    assert set(matching(modules, ("kvpersist.commands",))) <= own
