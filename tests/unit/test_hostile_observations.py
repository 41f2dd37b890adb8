"""Issue 40's four observations, each decided and tested here or next to its code.

1. **A cache root that is itself a symbolic link** (forget, scrub and prune followed it):
   kept, by decision. The root a setting or ``--root`` names is resolved once, when the use
   case opens it (``l2.tree.open_root``: one descriptor, every file below reached relative
   to it and never through a link), exactly as report, verify and metrics do: a symlinked
   mount point (``/var/lib/kvp/cache -> /nvme0/kvp``) is an operator's layout, not an
   attack (report and prune name the resolved path, verify and scrub the configured
   one). What is refused is a root that resolves to a system directory, now by scrub and
   verify too (they did not check it), and every link below the root stays unfollowed
   (tested below).
2. **scrub through a chunk name with a second hard link**: refused (LMCache never links its
   files): tests/unit/test_hostile_chunk_sizes.py.
3. **metrics --textfile LINK**: refused, exit 2: tests/unit/test_metrics.py.
4. **--older-than '30 d' and '30d\\n'**: refused, exit 2 (one token): tests/unit/
   test_exit_codes.py and tests/unit/test_max_age.py."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.l2.layout import ChunkName

from ..cli import kvp
from ..conftest import clean_env, free_port
from ..hostile import HostileRunner, assert_all_bounded

STALE = "kvp-" + "5a" * 16


@pytest.fixture(scope="module")
def runner() -> Iterator[HostileRunner]:
    with HostileRunner() as h:
        yield h


def env_for(tmp: Path, root: Path) -> dict[str, str]:
    key = tmp / "l2-master.key"
    if not key.exists():
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
    env = clean_env()
    env.update({"KVP_CACHE_ROOT": str(root), "KVP_SERDE_KEY_FILE": str(key),
                "KVP_LMCACHE_PORT": str(free_port()), "KVP_LMCACHE_HTTP_PORT": str(free_port()),
                "KVP_VLLM_PORT": str(free_port())})
    return env


def test_a_symlinked_root_is_resolved_once_and_nothing_below_is_followed(
        tmp_path: Path, runner: HostileRunner) -> None:
    real = tmp_path / "nvme0" / "kvp"
    real.mkdir(parents=True, mode=0o700)
    link = tmp_path / "cache"
    link.symlink_to(real)
    outside = tmp_path / "precious.bin"
    outside.write_bytes(b"p" * 4096)
    chunk = real / ChunkName(STALE, 0x01000100, 0, "ab" * 16).filename()
    chunk.write_bytes(os.urandom(4096))
    # a link below the root, named like a chunk of the same namespace: never followed
    (real / ChunkName(STALE, 0x01000100, 0, "cd" * 16).filename()).symlink_to(outside)
    env = env_for(tmp_path, link)
    outcomes = [runner.run("report", "--json", "--root", str(link), env=env),
                runner.run("verify", "cpu-demo", "--apply", "--all-namespaces", "--json",
                           env=env),
                runner.run("scrub", "cpu-demo", "--apply", "--json", env=env),
                runner.run("prune", "--root", str(link), "--namespace", STALE, "--apply",
                           "--json", env=env)]
    assert_all_bounded(outcomes, allowed=(0, 1))
    report, _, scrub, prune = (json.loads(o.stdout) for o in outcomes)
    assert report["root"] == str(real) and prune["root"] == str(real)
    assert report["symlinks"]["files"] == 1 and scrub["root"] == str(link)
    assert prune["deleted"]["files"] == 1 and not chunk.exists()
    assert outside.read_bytes() == b"p" * 4096 and link.is_symlink()


@pytest.mark.parametrize("target", ["/etc", "/usr", "/proc/self"])
def test_a_root_that_resolves_to_a_system_directory_is_refused_by_every_command(
        tmp_path: Path, runner: HostileRunner, target: str) -> None:
    link = tmp_path / "cache"
    link.symlink_to(target)
    env = env_for(tmp_path, link)
    outcomes = [runner.run(*argv, env=env) for argv in (
        ["report", "--root", str(link), "--json"], ["report", "--config", "cpu-demo"],
        ["prune", "--root", str(link), "--namespace", STALE, "--apply", "--json"],
        ["verify", "cpu-demo", "--apply", "--json"], ["scrub", "cpu-demo", "--apply"],
        ["shred", "--root", str(link), "--namespace", STALE, "--apply", "--json"])]
    assert_all_bounded(outcomes, allowed=(2,))
    for o in outcomes:
        assert "system directory" in o.stderr, (o.argv, o.stderr)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(1, 600))))
    # forget reads no root then (a warning) and deletes nothing on it
    forgot = kvp("forget", "cpu-demo", "--token-ids", str(ids), "--apply", "--json", env=env)
    assert "Traceback" not in forgot.stderr, forgot.stderr
    doc = json.loads(forgot.stdout)
    assert any("system directory" in w for w in doc["warnings"]), doc["warnings"]
