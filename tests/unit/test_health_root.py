"""The cache root's health checks (pure, table-driven): a full filesystem and a read-only one
are *degraded*, each named with its cause and the operator's fix, and say that writes resume
without a restart (what LMCache 0.5.6 does: tests/integration/test_full_filesystem.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpersist.stack import health
from kvpersist.stack.health_root import RESUME, RootFacts, root_checks

MIB = 1 << 20
OK = RootFacts(exists=True, mode=0o700, writable=True, avail_bytes=10 << 30,
               reserve_bytes=64 * MIB,
               budget={"on_disk_bytes": 1, "own_bytes": 1, "limit_bytes": 10,
                       "l2_max_capacity_bytes": 10, "within_budget": True})


def _by_name(r: RootFacts) -> dict[str, tuple[str, str]]:
    return {name: (status, detail) for name, status, detail in root_checks(r)}


def test_a_healthy_root_says_read_write_and_free_space() -> None:
    got = _by_name(OK)
    assert list(got) == ["cache_root.permissions", "cache_root.read_only",
                         "cache_root.free_space", "cache_root.budget"]
    assert all(status == "ok" for status, _ in got.values())
    assert got["cache_root.permissions"][1] == "mode 0700, writable"
    assert got["cache_root.read_only"][1] == "mounted read-write"
    assert got["cache_root.free_space"][1] == "10240 MiB free, reserve 64 MiB"


@pytest.mark.parametrize(("facts", "degraded", "words"), [
    # a full filesystem: free space at (or under) the reserve, ENOSPC named
    (replace(OK, avail_bytes=0), {"cache_root.free_space"},
     ["0 MiB free, reserve 64 MiB", "ENOSPC", "serving continues", RESUME]),
    (replace(OK, avail_bytes=64 * MIB), {"cache_root.free_space"}, ["ENOSPC"]),
    # read-only: access(W_OK) fails too, but the cause is named once, as read-only
    (replace(OK, writable=False, read_only=True), {"cache_root.read_only"},
     ["mounted read-only", "EROFS", "mount -o remount,rw", RESUME]),
    # both at once (a full filesystem remounted read-only)
    (replace(OK, writable=False, read_only=True, avail_bytes=0),
     {"cache_root.read_only", "cache_root.free_space"}, ["EROFS", "ENOSPC"]),
    # not writable for another reason: a permission problem, not read-only
    (replace(OK, writable=False), {"cache_root.permissions"}, ["not writable"]),
], ids=["full", "at-reserve", "read-only", "full-and-read-only", "not-writable"])
def test_full_and_read_only_are_degraded_naming_the_cause(
        facts: RootFacts, degraded: set[str], words: list[str]) -> None:
    got = _by_name(facts)
    assert {n for n, (s, _) in got.items() if s == "degraded"} == degraded, got
    details = " ".join(got[n][1] for n in degraded)
    for word in words:
        assert word in details, (word, details)
    if facts.read_only:
        assert got["cache_root.permissions"] == ("ok", "mode 0700, on a read-only filesystem")


def test_a_missing_root_is_down_and_nothing_else_is_judged() -> None:
    assert root_checks(RootFacts()) == [("cache_root", "down", "cache root missing")]


def test_unread_free_space_gives_no_free_space_check() -> None:
    assert "cache_root.free_space" not in _by_name(replace(OK, avail_bytes=None))


def test_health_verdict_carries_the_read_only_fact() -> None:
    """``health.verdict`` passes the gathered fact through: a read-only root is degraded,
    exit 1, in the cache_root component."""
    f = health.Facts(expect_vllm=False, root_exists=True, root_mode=0o700,
                     root_writable=False, fs_read_only=True, fs_avail_bytes=1 << 30,
                     reserve_bytes=MIB)
    _, checks = health.verdict(f)
    [ro] = [c for c in checks if c.name == "cache_root.read_only"]
    assert ro.status == "degraded" and "EROFS" in ro.detail
    assert health.component_of(ro.name) == "cache_root"
    assert health.component_status(checks)["cache_root"] == "degraded"


def test_a_root_read_only_only_in_a_sandbox_is_ok_and_says_so() -> None:
    """The health unit's ProtectSystem=strict makes the root read-only in its own view
    (access(W_OK) fails too); the filesystem is read-write: no alarm, no permission
    complaint, and the detail says why the view is read-only."""
    got = _by_name(replace(OK, writable=False, sandboxed=True))
    assert all(status == "ok" for status, _ in got.values()), got
    assert "sandbox" in got["cache_root.read_only"][1]
    assert got["cache_root.permissions"][1] == (
        "mode 0700, write access not testable from a read-only sandbox")
