"""Ownership is checked as sshd checks its keys: a cache root, state dir or key that another
user owns, or that sits under a directory others can write, is refused; and what kvpersist
creates itself is owner-only."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvpersist.system.files import atomic_write, trust_problems

from ..cli import kvp
from ..conftest import clean_env, free_port

OTHER = 65534


@pytest.fixture(autouse=True)
def _as_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("these tests chown files to another user: run them as root (CI does)")


def test_own_path_under_a_sane_tree_is_trusted(tmp_path: Path) -> None:
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    assert trust_problems(d) == []
    assert trust_problems(d / "not-yet") == []  # a path to create later


def test_a_path_owned_by_another_user(tmp_path: Path) -> None:
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    os.chown(d, OTHER, OTHER)
    [why] = trust_problems(d)
    assert f"uid {OTHER}" in why and "not to this user" in why
    below = d / "keys" / "k"
    assert any(f"belongs to uid {OTHER}" in w for w in trust_problems(below))


def test_world_writable_parent_without_sticky_bit(tmp_path: Path) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o777)
    (parent / "cache").mkdir(mode=0o700)
    problems = trust_problems(parent / "cache")
    assert len(problems) == 1 and "writable by group or others" in problems[0]
    os.chmod(parent, 0o1777)  # sticky, like /tmp: others cannot replace our entries
    assert trust_problems(parent / "cache") == []
    os.chmod(parent, 0o775)
    assert "writable by group or others" in trust_problems(parent / "cache")[0]


def test_a_symlink_is_reported_not_followed(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert "symbolic link" in trust_problems(tmp_path / "link")[0]


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = clean_env()
    env.update({"KVP_CACHE_ROOT": str(root), "KVP_LMCACHE_PORT": str(free_port()),
                "KVP_LMCACHE_HTTP_PORT": str(free_port()), "KVP_VLLM_PORT": str(free_port()),
                **extra})
    return env


def test_launch_refuses_a_root_and_key_planted_by_another_user(tmp_path: Path) -> None:
    """The issue's case: a 0700 root owned by uid 65534 with a 0600 key that user planted."""
    root = tmp_path / "cache"
    key = root / ".kvpersist" / "keys" / "l2-master.key"
    key.parent.mkdir(parents=True)
    key.write_bytes(os.urandom(32))
    os.chmod(key, 0o600)
    for p in (root, root / ".kvpersist", key.parent, key):
        os.chown(p, OTHER, OTHER)
    os.chmod(root, 0o700)
    res = kvp("launch", "cpu-demo", "--check", "--no-vllm", env=_env(root))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert f"belongs to uid {OTHER}" in res.stderr and "KVP_SERDE_KEY_FILE" in res.stderr
    res = kvp("verify", "cpu-demo", env=_env(root))  # a configuration error: 2 (issue 40)
    assert res.returncode == 2 and "cannot be trusted" in res.stderr, res.stderr


def test_launch_refuses_a_root_under_a_world_writable_parent(tmp_path: Path) -> None:
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)
    res = kvp("launch", "cpu-demo", "--check", "--no-vllm", env=_env(parent / "cache"))
    assert res.returncode == 2 and "writable by group or others" in res.stderr, res.stderr


def test_atomic_write_creates_every_missing_directory_owner_only(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "state" / ".kvpersist" / "cache" / "budget.json", "{}")
    finally:
        os.umask(old)
    for d in ("state", "state/.kvpersist", "state/.kvpersist/cache"):
        assert stat.S_IMODE((tmp_path / d).stat().st_mode) == 0o700, d
    (tmp_path / "open").mkdir(mode=0o755)
    atomic_write(tmp_path / "open" / "x", "1")  # an existing directory is left as it is
    assert stat.S_IMODE((tmp_path / "open").stat().st_mode) == 0o755
