"""Every hostile setting ends in exit 2 with a message and no traceback, for ``render``,
``launch --check`` and ``identity show`` — through the environment (the operator's
override) and through the identity.env file.

All of tests/unit/hostile_inputs.py runs through ``kvpersist.cli.main`` in one batch process
(tests/unit/cli_batch.py); a sample of one input per kind also runs as separate
``python -m kvpersist.cli`` processes, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..cli import kvp
from ..conftest import REPO, clean_env, free_port
from .hostile_inputs import HOSTILE_SETTINGS, Hostile

#: (words before CONFIG, words after it)
COMMANDS = [(["render"], []), (["launch"], ["--check"]), (["identity", "show"], [])]
CPU_DEMO = (REPO / "configs" / "cpu-demo" / "identity.env").read_text()


def base_env(tmp_path: Path, case: Hostile) -> dict[str, str]:
    """A relocated cpu-demo (temp cache root, free ports) with the case's keys left alone."""
    env = clean_env()
    reloc = {"KVP_CACHE_ROOT": str(tmp_path / "cache"), "KVP_LMCACHE_PORT": str(free_port()),
             "KVP_LMCACHE_HTTP_PORT": str(free_port()), "KVP_VLLM_PORT": str(free_port())}
    env.update({k: v for k, v in reloc.items() if k != case.key and k not in case.extra})
    return env


def env_file_line(key: str, value: str) -> str:
    """``KEY=value`` as an operator would write it: quoted when it holds a space."""
    return f"{key}='{value}'" if " " in value and "'" not in value else f"{key}={value}"


def config_with(tmp_path: Path, index: int, case: Hostile) -> str:
    """A copy of cpu-demo whose identity.env sets the case's keys."""
    keys = {case.key: case.value, **case.extra}
    lines = [ln for ln in CPU_DEMO.split("\n") if ln.split("=", 1)[0] not in keys]
    lines += [env_file_line(k, v) for k, v in keys.items()]
    d = tmp_path / f"case{index}"
    d.mkdir()
    (d / "identity.env").write_text("\n".join(lines) + "\n", encoding="utf-8",
                                    errors="surrogateescape")
    return str(d)


def channels(tmp_path: Path) -> list[tuple[str, Hostile, str, dict[str, str]]]:
    """(channel, case, config, env) for every case: the environment where it can travel
    there, and the file always."""
    out = []
    for i, case in enumerate(HOSTILE_SETTINGS):
        env = base_env(tmp_path, case)
        if case.env_ok:
            out.append(("env", case, "cpu-demo", {**env, case.key: case.value, **case.extra}))
        out.append(("file", case, config_with(tmp_path, i, case), env))
    return out


def assert_config_error(code: int, stderr: str, traceback: str, case: Hostile,
                        channel: str) -> None:
    where = f"{channel} {case}"
    assert not traceback, f"{where}: {traceback}"
    assert "Traceback" not in stderr, f"{where}: {stderr}"
    assert code == 2, f"{where}: exit {code}: {stderr}"
    assert stderr.startswith("kvp-admin: "), f"{where}: {stderr}"
    # the message names the key, or (a value that breaks the file's syntax) the line
    assert case.names in stderr or "identity.env:" in stderr, f"{where}: {stderr}"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: "-".join(c[0] + c[1]))
def test_every_hostile_input_is_exit_2_without_traceback(
        tmp_path: Path, command: tuple[list[str], list[str]]) -> None:
    runs = channels(tmp_path)
    before, after = command
    batch = [{"argv": [*before, config, *after], "env": env}
             for _, _, config, env in runs]
    proc = subprocess.run([sys.executable, "-m", "tests.unit.cli_batch"], cwd=REPO,
                          input=json.dumps(batch), capture_output=True, text=True,
                          timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout)
    assert len(results) == len(runs) > 600
    for (channel, case, _, _), res in zip(runs, results, strict=True):
        assert_config_error(res["code"], res["stderr"], res["traceback"], case, channel)


def _sample() -> list[Hostile]:
    """The first case of each key that can travel in the environment."""
    seen: set[str] = set()
    out = []
    for case in HOSTILE_SETTINGS:
        if case.key not in seen and case.env_ok:
            seen.add(case.key)
            out.append(case)
    return out


@pytest.mark.parametrize("case", _sample(), ids=str)
def test_hostile_input_in_a_real_process(tmp_path: Path, case: Hostile) -> None:
    env = {**base_env(tmp_path, case), case.key: case.value, **case.extra}
    for before, after in COMMANDS:
        res = kvp(*before, "cpu-demo", *after, env=env)
        assert_config_error(res.returncode, res.stderr, "", case, "env")
