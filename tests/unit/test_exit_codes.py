"""Issue 40: every command's error paths end with the documented exit code, and a ``--json``
run prints exactly one JSON object whatever happens.

README: "0 success, 1 a check found a problem, 2 usage or configuration error ... With
``--json`` stdout holds exactly one JSON object whatever the exit code". Every command of
the registry (groups down to their subcommands) runs, as a user runs it (tests/hostile.py),
with an unknown option, with a configuration that does not exist, and with ``--json
--help`` (decided: the help as one ``kvpersist.help/1`` document, exit 0); every numeric
option with ``-1``, ``nan``, ``inf``, ``1e308``, ``0x10`` and its out-of-range values; and the
two findings of the issue: an unusable secret file for ``fleet status`` (0644, a symlink, a
FIFO, 10 MB, not UTF-8) and an unusable key file for ``scrub`` (missing, a symlink, a FIFO,
8 bytes, 0644), which exited 1 (scrub's "dirty padding left") instead of 2."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from kvpersist.cli import COMMANDS

from ..conftest import clean_env, free_port
from ..hostile import HostileRunner, Outcome, assert_all_bounded


def leaves() -> list[tuple[list[str], click.Command]]:
    """(words, command) of every command and subcommand kvp-admin has."""
    out: list[tuple[list[str], click.Command]] = []

    def walk(words: list[str], cmd: click.Command) -> None:
        if isinstance(cmd, click.Group):
            for name, sub in sorted(cmd.commands.items()):
                walk([*words, name], sub)
        else:
            out.append((words, cmd))

    for name, entry in sorted(COMMANDS.items()):
        module, attr = entry.target.split(":")
        walk([name], getattr(importlib.import_module(module), attr))
    return out


LEAVES = leaves()


def has_json(cmd: click.Command) -> bool:
    return any("--json" in p.opts for p in cmd.params if isinstance(p, click.Option))


#: options a command needs before it loads its config
NEEDS: dict[str, list[str]] = {"forget": ["--token-ids", "/nonexistent/ids.json"]}


def positional(cmd: click.Command) -> list[str]:
    """Placeholder words for the command's arguments: a config that does not exist."""
    return [("no-such-config-40" if a.name in ("config", "old", "new", "a", "b")
             else "/nonexistent/x") for a in cmd.params
            if isinstance(a, click.Argument) and a.required] + NEEDS.get(cmd.name or "", [])


def command_of(words: list[str]) -> click.Command:
    """The leaf command ``words`` (an argv) starts with."""
    return max((c for w, c in LEAVES if words[:len(w)] == w),
               key=lambda c: len(c.name or ""))


@pytest.fixture(scope="module")
def runner() -> Iterator[HostileRunner]:
    with HostileRunner() as h:
        yield h


def one_json(o: Outcome, code: int) -> dict[str, object]:
    """The one JSON object on stdout, with the error document's exit code when it is one."""
    doc = json.loads(o.stdout)
    assert isinstance(doc, dict), o.argv
    if doc.get("schema") == "kvpersist.error/1":
        assert doc["exit_code"] == code == o.code, (o.argv, doc)
    return doc


def test_every_command_has_been_found() -> None:
    names = {" ".join(w) for w, _ in LEAVES}
    assert {"scrub", "fleet status", "upgrade plan", "forget", "warmup", "prune",
            "identity show"} <= names
    assert len(LEAVES) >= 25


def test_usage_errors_exit_2_with_one_json_object(runner: HostileRunner) -> None:
    outcomes = []
    for words, cmd in LEAVES:
        args = [*words, *positional(cmd)]
        bad = runner.run(*args, "--no-such-option-40", "--json")
        outcomes.append(bad)
        assert bad.code == 2, (args, bad.stderr)
        doc = one_json(bad, 2)
        assert doc["schema"] == "kvpersist.error/1" and "no-such-option-40" in str(doc["error"])
        if any(a.name in ("config", "old", "new") for a in cmd.params
               if isinstance(a, click.Argument)):
            missing = runner.run(*args, *(["--json"] if has_json(cmd) else []))
            outcomes.append(missing)
            assert missing.code == 2, (args, missing.stderr)
            assert "no-such-config-40" in missing.stderr, (args, missing.stderr)
            if has_json(cmd):
                assert one_json(missing, 2)["schema"] == "kvpersist.error/1"
    assert_all_bounded(outcomes, allowed=(2,))


def test_json_help_is_one_json_object(runner: HostileRunner) -> None:
    """Decided: ``--json --help`` prints the help as one document (``usage`` and ``help``),
    exit 0; a command without ``--json`` refuses the option (exit 2, the error document)."""
    for words, cmd in LEAVES:
        o = runner.run(*words, "--json", "--help")
        doc = json.loads(o.stdout)
        if has_json(cmd):
            assert o.code == 0 and doc["schema"] == "kvpersist.help/1", (words, o.stdout)
            assert str(doc["usage"]).startswith(f"kvp-admin {' '.join(words)}")
            assert "--json" in str(doc["help"])
        else:
            assert o.code == 2 and doc["schema"] == "kvpersist.error/1", (words, o.stdout)
        plain = runner.run(*words, "--help")
        assert plain.code == 0 and plain.stdout.startswith("Usage:"), words


#: (words, option, values refused) for every numeric option
NUMBERS: list[tuple[list[str], str, list[str]]] = [
    (["fleet", "status"], "--timeout", ["-1", "0", "nan", "inf", "1e308", "3601"]),
    (["metrics"], "--timeout", ["-1", "0", "nan", "inf", "1e308", "0x10"]),
    (["health", "cpu-demo"], "--timeout", ["-1", "0", "nan", "inf", "1e308"]),
    (["health", "cpu-demo"], "--wait", ["-1", "nan", "inf", "1e308", "86401"]),
    (["warmup", "cpu-demo"], "--wait", ["-1", "nan", "inf", "1e308", "86401", "1_0"]),
    (["verify", "cpu-demo"], "--rate", ["-1", "nan", "inf", "1e308"]),
    (["verify", "cpu-demo"], "--temp-age", ["-1", "nan", "inf", "1e308"]),
    (["launch", "cpu-demo", "--check"], "--timeout", ["0", "nan", "inf", "-5"]),
    (["launch", "cpu-demo", "--check"], "--vllm-timeout", ["0", "nan", "inf"]),
    (["launch", "cpu-demo", "--check"], "--crash-check-rate", ["-1", "nan"]),
    (["launch", "cpu-demo", "--check"], "--crash-check-seconds", ["-1", "nan", "inf"]),
    (["launch", "cpu-demo", "--check"], "--warmup-wait", ["-1", "nan", "inf"]),
    (["launch", "cpu-demo", "--check"], "--deadline", ["0", "nan", "inf"]),
    (["stop", "cpu-demo"], "--timeout", ["0", "nan", "inf", "-1"]),
    (["restart", "cpu-demo"], "--stop-timeout", ["0", "nan", "inf"]),
    (["demo"], "--turns", ["0", "1.5", "nan", "1001", "-3"]),
    (["prune", "--root", "/nonexistent"], "--older-than",
     ["30 d", "30d\n", " 30d", "30", "nan", "inf", "-30d", "1e3d", "99999999999d"]),
    (["prune", "--root", "/nonexistent"], "--temp-older-than",
     ["1 h", "1h\n", "nan", "-1h", "99999999999w"]),
]


def test_every_number_is_range_checked_at_parse_time(runner: HostileRunner) -> None:
    """Issue 40: ``--timeout X`` with -1, nan, inf, 1e308 (and 0 for metrics) ended in
    ValueError/OverflowError; ``warmup --wait nan`` never returned (the deadline never
    came); ``--older-than '30 d'`` and ``'30d\\n'`` were accepted."""
    outcomes = []
    for words, option, values in NUMBERS:
        json_flag = ["--json"] if has_json(command_of(words)) else []
        for value in values:
            o = runner.run(*words, f"{option}={value}", *json_flag, timeout=20)
            outcomes.append(o)
            assert o.code == 2, (words, option, value, o.stderr)
            assert option in o.stderr, (option, value, o.stderr)
            if json_flag:
                assert option in str(one_json(o, 2)["error"])
    assert_all_bounded(outcomes, allowed=(2,))
    assert max(o.seconds for o in outcomes) < 10  # refused at parse time


def _secret_cases(tmp: Path) -> dict[str, Path]:
    good = "username=kvp\npassword=pw\n"
    cases: dict[str, Path] = {}
    p = tmp / "world-readable"
    p.write_text(good)
    p.chmod(0o644)
    cases["0644"] = p
    target = tmp / "target"
    target.write_text(good)
    target.chmod(0o600)
    (tmp / "link").symlink_to(target)
    cases["symlink"] = tmp / "link"
    os.mkfifo(tmp / "fifo", 0o600)
    cases["fifo"] = tmp / "fifo"
    big = tmp / "big"
    big.write_bytes(b"x" * (10 << 20))
    big.chmod(0o600)
    cases["10 MB"] = big
    bad = tmp / "not-utf8"
    bad.write_bytes(b"username=\xff\npassword=\xfe\n")
    bad.chmod(0o600)
    cases["not UTF-8"] = bad
    cases["missing"] = tmp / "missing"
    return cases


def test_an_unusable_secret_file_is_a_configuration_error(tmp_path: Path,
                                                          runner: HostileRunner) -> None:
    """``fleet status`` exited 1 for these; a configuration error is 2. No store is ever
    contacted (the port has no listener)."""
    outcomes = []
    for why, path in _secret_cases(tmp_path).items():
        env = clean_env()
        env.update({"KVP_CACHE_ROOT": str(tmp_path / "cache"),
                    "KVP_SHARED_TIER": f"valkey://127.0.0.1:{free_port()}",
                    "KVP_SHARED_TIER_SECRET_FILE": str(path)})
        for json_flag in ([], ["--json"]):
            o = runner.run("fleet", "status", "--config", "cpu-demo", *json_flag, env=env,
                           timeout=20)
            outcomes.append(o)
            assert o.code == 2, (why, o.stderr)
            assert "secret file" in o.stderr, (why, o.stderr)
            if json_flag:
                assert one_json(o, 2)["schema"] == "kvpersist.error/1"
    assert_all_bounded(outcomes, allowed=(2,))


def test_an_unusable_key_file_is_a_configuration_error(tmp_path: Path,
                                                       runner: HostileRunner) -> None:
    """``scrub`` exited 1 for these, its code for "dirty padding left": a timer could not
    tell the two apart. Now 2, and so for ``verify`` (which reads the same key)."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    good = keys / "good.key"
    good.write_bytes(os.urandom(32))
    good.chmod(0o600)
    (keys / "link.key").symlink_to(good)
    os.mkfifo(keys / "fifo.key", 0o600)
    short = keys / "short.key"
    short.write_bytes(os.urandom(8))
    short.chmod(0o600)
    shared = keys / "shared.key"
    shared.write_bytes(os.urandom(32))
    shared.chmod(0o644)
    cases = {"missing": keys / "missing.key", "symlink": keys / "link.key",
             "fifo": keys / "fifo.key", "8 bytes": short, "0644": shared}
    outcomes = []
    for why, key in cases.items():
        env = clean_env()
        env.update({"KVP_CACHE_ROOT": str(root), "KVP_SERDE_KEY_FILE": str(key)})
        for argv in (["scrub", "cpu-demo"], ["scrub", "cpu-demo", "--apply", "--json"],
                     ["verify", "cpu-demo", "--json"]):
            o = runner.run(*argv, env=env, timeout=20)
            outcomes.append(o)
            assert o.code == 2, (why, argv, o.stderr)
            assert "key file" in o.stderr, (why, o.stderr)
            if "--json" in argv:
                assert one_json(o, 2)["schema"] == "kvpersist.error/1"
    # and a scrub that runs exits 0 (nothing dirty), so 1 means dirty padding only
    env = clean_env()
    env.update({"KVP_CACHE_ROOT": str(root), "KVP_SERDE_KEY_FILE": str(good)})
    ok = runner.run("scrub", "cpu-demo", "--json", env=env)
    outcomes.append(ok)
    assert ok.code == 0, ok.stderr
    assert_all_bounded(outcomes, allowed=(0, 2))


def test_the_warm_ups_bound_is_range_checked_in_the_config_and_the_child(
        tmp_path: Path, runner: HostileRunner) -> None:
    """The launch hands KVP_WARMUP_WAIT to the warm-up child as ``--wait``: both take 0 (the
    child) or more than 0 (the setting) up to a day, never nan, inf or 1e308 (the deadline
    must come)."""
    import subprocess
    import sys

    from ..conftest import REPO

    outcomes = []
    for value in ("nan", "inf", "1e308", "2d", "86401", "0", "-5"):
        env = clean_env()
        env.update({"KVP_CACHE_ROOT": str(tmp_path / "cache"), "KVP_WARMUP_WAIT": value})
        o = runner.run("render", "cpu-demo", "--json", env=env)
        outcomes.append(o)
        assert o.code == 2 and "KVP_WARMUP_WAIT" in o.stdout, (value, o.stdout)
    assert_all_bounded(outcomes, allowed=(2,))
    for value in ("nan", "inf", "1e308", "86401", "-1"):
        r = subprocess.run([sys.executable, "-m", "kvpersist.cli", "warmup", "cpu-demo",
                            "--wait", value], capture_output=True, text=True, cwd=REPO,
                           env=clean_env(), timeout=60)
        assert r.returncode == 2 and "--wait" in r.stderr, (value, r.stderr)
