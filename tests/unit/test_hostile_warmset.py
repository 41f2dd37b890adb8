"""Issue 20, the warm set: ``KVP_WARMUP_FILE`` is the operator's input, read by
``kvp-admin warmup CONFIG`` and by the warm-up child ``python -m kvpersist.cli warmup``
(the launch, the units and the hook start it), and by the launch's preflight (``launch`` and
``launch --check`` with vLLM: a bad warm set refuses the launch before anything starts).
Whatever it is — 16 MiB of bad lines, 16 MiB of lines nested 100,000 deep, one 16 MiB
line of five million empty objects, a million good lines, a FIFO, ``/dev/zero``, a link to
it, a directory, a sparse file past the cap, bytes that are not UTF-8, nothing — the command
exits 2 naming the file (and the line), lists at most the first 20 problems and says where
reading stopped and how many lines were not checked, writes nothing, and stays under
RLIMIT_AS = 512 MiB, 30 s and 1 MB of output (tests/hostile.py)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpersist.config.warmset import MAX_BYTES, MAX_ENTRIES, parse_warm_set
from kvpersist.errors import MAX_PROBLEMS, ConfigError

from ..conftest import REPO, clean_env, free_port
from ..hostile import AS_LIMIT, OUTPUT_LIMIT, HostileRunner, Outcome, assert_all_bounded
from .state_files import summary

DEEP = b"[" * 100_000 + b"]" * 100_000 + b"\n"


def fill(line: bytes) -> bytes:
    """As many copies of ``line`` as fit in :data:`MAX_BYTES`."""
    return line * (MAX_BYTES // len(line))


def _write(data: bytes) -> Callable[[Path], None]:
    return lambda p: p.write_bytes(data)


def _sparse(p: Path) -> None:
    with open(p, "wb") as f:
        f.truncate(MAX_BYTES + 1)


#: name -> (how to make the warm file at a path, what its problems must say)
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "16 MiB of bad lines": (_write(fill(b"x\n")), "is bad too; reading stopped there"),
    "16 MiB of lines nested 100,000 deep": (_write(fill(DEEP)),
                                           "is bad too; reading stopped there"),
    "one line of five million empty objects": (
        _write(b"[" + b"{}," * (MAX_BYTES // 3 - 2) + b"{}]\n"), "arrays and objects"),
    "a million good lines": (_write(fill(b'{"prompt": "x"}\n')),
                             f"more than {MAX_ENTRIES:,} entries"),
    "a line nested 65 deep": (_write(b'{"prompt": ' + b"[" * 64 + b"]" * 64 + b"}\n"),
                              "nested 65 levels"),
    "NaN": (_write(b'{"prompt": NaN}\n'), "NaN"),
    "1e309": (_write(b'{"prompt": "x", "n": 1e309}\n'), "out of range"),
    "not UTF-8": (_write(b'{"prompt": "\xff"}\n'), "not UTF-8"),
    "empty": (_write(b""), "holds no entry"),
    "a FIFO": (lambda p: os.mkfifo(p), "a FIFO"),
    "/dev/zero": (lambda p: None, "a character device"),
    "a link to /dev/zero": (lambda p: os.symlink("/dev/zero", p), "a character device"),
    "a directory": (lambda p: p.mkdir(), "a directory"),
    "a sparse file past the cap": (_sparse, "larger than"),
    "no file": (lambda p: None, "no such file"),
}


@pytest.fixture(scope="module")
def runner() -> Iterator[HostileRunner]:
    with HostileRunner() as r:
        yield r


def deployment(tmp: Path, warm_file: str) -> dict[str, str]:
    (tmp / "cache").mkdir(parents=True, mode=0o700)
    return {**clean_env(), "KVP_CACHE_ROOT": str(tmp / "cache"),
            "KVP_LMCACHE_PORT": str(free_port()), "KVP_LMCACHE_HTTP_PORT": str(free_port()),
            "KVP_VLLM_PORT": str(free_port()), "KVP_WARMUP_FILE": warm_file}


def warm_file(tmp: Path, name: str) -> str:
    if name == "/dev/zero":
        return "/dev/zero"
    path = tmp / "warm.jsonl"
    CASES[name][0](path)
    return str(path)


def test_kvp_admin_warmup_refuses_every_hostile_warm_set_bounded(
        tmp_path: Path, runner: HostileRunner) -> None:
    outcomes: list[Outcome] = []
    for i, name in enumerate(CASES):
        tmp = tmp_path / f"case{i}"
        tmp.mkdir()
        path = warm_file(tmp, name)
        env = deployment(tmp, path)
        o = runner.run("warmup", "cpu-demo", "--json", env=env)
        outcomes.append(o)
        assert_all_bounded([o], allowed=(2,))
        doc = json.loads(o.stdout)
        assert doc["schema"] == "kvpersist.error/1" and doc["exit_code"] == 2, (name, doc)
        problems = doc["problems"]
        assert 1 <= len(problems) <= MAX_PROBLEMS + 1, (name, len(problems))
        assert all(path in p["where"] for p in problems), (name, problems[:2])
        shown = json.dumps(problems)
        assert CASES[name][1] in shown, (name, shown[:2000])
        if "reading stopped" in CASES[name][1]:  # 20 listed, then where it stopped
            assert len(problems) == MAX_PROBLEMS + 1
            assert [p["where"] for p in problems[:2]] == [f"{path}:1", f"{path}:2"]
            assert "more line(s) not checked" in problems[-1]["message"]
        # nothing written: no state file, no token cache, no pins
        assert not (tmp / ".kvpersist").exists(), name
    print("\n" + summary("warmup CONFIG, KVP_WARMUP_FILE", outcomes, len(CASES),
                         tuple(CASES)))


def test_launch_check_refuses_every_hostile_warm_set_before_anything_starts(
        tmp_path: Path, runner: HostileRunner) -> None:
    """Found while hardening: only the warm-up read the warm set, after vLLM served. The
    preflight reads it as the warm-up will: ``launch --check`` (and so ``launch``) refuses a
    bad one with exit 2 naming it, bounded, and writes nothing (vLLM's parser check, the
    slow part, is skipped once a problem is found)."""
    outcomes: list[Outcome] = []
    for i, name in enumerate(CASES):
        tmp = tmp_path / f"case{i}"
        tmp.mkdir()
        path = warm_file(tmp, name)
        o = runner.run("launch", "cpu-demo", "--check", "--json",
                       env=deployment(tmp, path))
        outcomes.append(o)
        assert_all_bounded([o], allowed=(2,))
        doc = json.loads(o.stdout)
        problems = doc.get("problems", [])
        assert doc.get("ok") is False and problems, (name, doc)
        assert any("KVP_WARMUP_FILE" in p or path in p for p in problems), (name, problems)
        assert CASES[name][1] in json.dumps(problems), (name, problems[:3])
        assert not (tmp / ".kvpersist").exists(), name
    print("\n" + summary("launch --check, KVP_WARMUP_FILE", outcomes, len(CASES),
                         tuple(CASES)))


def _bounded() -> None:  # pragma: no cover - runs in the child before exec
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


@pytest.mark.parametrize("name", ["16 MiB of bad lines", "16 MiB of lines nested 100,000 deep",
                                  "a FIFO", "/dev/zero"])
def test_the_warmup_child_refuses_them_the_same_way(tmp_path: Path, name: str) -> None:
    """``python -m kvpersist.cli warmup CONFIG --json`` (the command a launch starts), as its
    own process under the same address-space limit: exit 2, the problems on stderr,
    bounded."""
    path = warm_file(tmp_path, name)
    env = deployment(tmp_path, path)
    r = subprocess.run([sys.executable, "-m", "kvpersist.cli", "warmup", "cpu-demo", "--json"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=60,
                       preexec_fn=_bounded)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr
    assert len(r.stdout) + len(r.stderr) < OUTPUT_LIMIT
    assert r.stderr.startswith("kvp-admin: ") and path in r.stderr
    assert r.stderr.count("\n  - ") <= MAX_PROBLEMS + 1
    assert not (tmp_path / ".kvpersist").exists()


def test_a_good_warm_set_next_to_the_bounds_is_read_whole() -> None:
    """The bounds refuse nothing a warm set may be: 10,000 entries, a line nested 64 deep,
    a long line with brackets in its text."""
    lines = [b'{"prompt": "x"}'] * (MAX_ENTRIES - 2)
    lines.append(b'{"prompt": "' + b"[{" * 100_000 + b'"}')
    lines.append(b'{"messages": [{"role": "user", "content": "x"}], "tools": ['
                 + b'{"a": ' * 62 + b"1" + b"}" * 62 + b"]}")
    ws = parse_warm_set(b"\n".join(lines) + b"\n", "/w.jsonl")
    assert len(ws.entries) == MAX_ENTRIES
    with pytest.raises(ConfigError, match="nested 65 levels"):
        parse_warm_set(b'{"prompt": ' + b"[" * 64 + b"]" * 64 + b"}\n", "/w.jsonl")
