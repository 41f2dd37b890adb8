"""Every default of ``launch``/``restart`` is stated once (``stack/launch_options.py``).

* the click options of ``launch``, ``restart`` and ``stop`` show :data:`DEFAULTS`' values;
* no function of the launch's layers (the command, the action, the launch sequence, the plan,
  the crash-window check) states a default of its own for an option that
  :class:`LaunchOptions` holds: they take the one object;
* the crash-window check's own defaults are the options' defaults.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import ModuleType

import click
import pytest

from kvpersist.actions import lifecycle as actions
from kvpersist.commands import lifecycle as commands
from kvpersist.stack import crash_window, launch_plan
from kvpersist.stack import launch as stack
from kvpersist.stack.launch_options import DEFAULTS, STOP_TIMEOUT, LaunchOptions

FIELDS = {f.name for f in dataclasses.fields(LaunchOptions)}
#: click's parameter names of launch/restart -> the option they fill
CLI_NAMES = {"timeout": "server_timeout", "vllm_timeout": "vllm_timeout",
             "crash_rate": "crash_rate_mb_s", "crash_seconds": "crash_seconds",
             "warmup_wait": "warmup_wait"}


def _defaults(cmd: click.Command) -> dict[str, object]:
    """Each option's default as click resolves it (a flag's absence: False)."""
    ctx = click.Context(cmd)
    return {p.name: p.get_default(ctx) for p in cmd.params
            if isinstance(p, click.Option) and p.name}


@pytest.mark.parametrize("cmd", [commands.launch, commands.restart], ids=lambda c: c.name)
def test_the_cli_shows_the_one_set_of_defaults(cmd: click.Command) -> None:
    shown = _defaults(cmd)
    compared = {name: field for name, field in CLI_NAMES.items() if name in shown}
    assert {"timeout", "vllm_timeout", "warmup_wait"} <= set(compared)
    for name, field in compared.items():
        assert shown[name] == getattr(DEFAULTS, field), (cmd.name, name)
    # flags that turn a default off: their absence is the default
    for flag, field in (("no_vllm", "with_vllm"), ("no_warmup", "warmup")):
        if flag in shown:
            assert shown[flag] is False and getattr(DEFAULTS, field) is True


def test_stop_timeouts_are_the_one_value() -> None:
    assert _defaults(commands.stop)["timeout"] == STOP_TIMEOUT
    assert _defaults(commands.restart)["stop_timeout"] == STOP_TIMEOUT
    assert inspect.signature(actions.stop).parameters["timeout"].default == STOP_TIMEOUT
    assert inspect.signature(actions.restart).parameters["timeout"].default == STOP_TIMEOUT


@pytest.mark.parametrize("module", [actions, stack, launch_plan, crash_window],
                         ids=lambda m: m.__name__)
def test_no_layer_states_a_default_of_its_own(module: ModuleType) -> None:
    own = []
    for name, fn in inspect.getmembers(module, inspect.isfunction):
        if fn.__module__ != module.__name__:
            continue
        for p in inspect.signature(fn).parameters.values():
            if p.name in FIELDS and p.default is not inspect.Parameter.empty:
                own.append(f"{name}({p.name}={p.default!r})")
    assert own == [], "take a LaunchOptions instead: " + ", ".join(own)


def test_the_crash_window_check_uses_the_options_defaults() -> None:
    assert DEFAULTS.crash_rate_mb_s == crash_window.DEFAULT_RATE_MB_S
    assert DEFAULTS.crash_seconds == crash_window.DEFAULT_SECONDS
