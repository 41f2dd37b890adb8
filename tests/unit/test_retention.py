"""Retention ordering (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvpersist.errors import UsageError
from kvpersist.l2.retention import (
    ACTIVE,
    BUCKET_NS,
    OTHER,
    STALE,
    TEMP,
    UNPINNED,
    category,
    plan_explicit,
    plan_retention,
)

H = BUCKET_NS
NOW = 1000 * H
ACT = "kvp-" + "a" * 32
OLD1 = "kvp-" + "b" * 32
OLD2 = "kvp-" + "c" * 32
UNP = "kvp-unpinned-" + "d" * 32


@dataclass
class U:
    """A stand-in for kvpersist.l2.usage.Usage: hist = {hour bucket: [files, bytes]}."""

    use_hist: dict[int, list[int]] = field(default_factory=dict)

    @property
    def files(self) -> int:
        return sum(f for f, _ in self.use_hist.values())

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.use_hist.values())

    @property
    def last_use_ns(self) -> int:
        return (max(self.use_hist) * H) if self.use_hist else 0


def tree() -> tuple[dict[str, U], U]:
    prefixes = {
        ACT: U({990: [10, 100], 999: [10, 100]}),
        OLD1: U({900: [5, 50], 950: [5, 50]}),      # newest use 950
        OLD2: U({800: [5, 50]}),                    # least recently used stale
        UNP: U({998: [2, 20]}),
        "test-model": U({100: [1, 1000]}),
    }
    temp = U({990: [1, 7], 999: [1, 3]})
    return prefixes, temp


def test_categories() -> None:
    assert category(ACT, {ACT}) == ACTIVE
    assert category(OLD1, {ACT}) == STALE
    assert category(UNP, set()) == UNPINNED
    assert category("test-model", set()) == OTHER


def test_order_temp_unpinned_stale_lru() -> None:
    p, t = tree()
    plan = plan_retention(p, t, active={ACT}, need_bytes=10**6, now_ns=NOW)
    kinds = [(s.kind, s.prefix) for s in plan.selections]
    assert kinds == [(TEMP, None), (UNPINNED, UNP), (STALE, OLD2), (STALE, OLD1)]
    assert plan.selections[0].bytes == 7  # only the temp file older than an hour
    assert not plan.satisfied
    assert any("--force" in n for n in plan.notes)
    assert any("test-model" in n for n in plan.notes)
    assert all(s.prefix != ACT for s in plan.selections)


def test_stops_when_goal_reached_and_trims_the_last_stale_namespace() -> None:
    p, t = tree()
    plan = plan_retention(p, t, active={ACT}, need_bytes=7 + 20 + 50 + 10, now_ns=NOW)
    last = plan.selections[-1]
    assert last.prefix == OLD1
    assert last.before_ns == 901 * H  # only the bucket used at hour 900
    assert (last.files, last.bytes) == (5, 50)
    assert plan.satisfied
    assert last.matches(OLD1, 900 * H + 5) and not last.matches(OLD1, 950 * H)


def test_active_only_when_allowed_and_lru_first() -> None:
    p, t = tree()
    plan = plan_retention(p, t, active={ACT}, need_bytes=7 + 20 + 150 + 100, now_ns=NOW,
                          allow_active=True)
    act = [s for s in plan.selections if s.kind == ACTIVE]
    assert len(act) == 1 and act[0].before_ns == 991 * H and act[0].bytes == 100
    assert plan.satisfied


def test_nothing_to_free() -> None:
    p, t = tree()
    assert plan_retention(p, t, active=set(), need_bytes=0, now_ns=NOW).selections == ()


def test_explicit_targets() -> None:
    p, t = tree()
    plan = plan_explicit(p, t, active={ACT}, now_ns=NOW, stale=True)
    assert {s.prefix for s in plan.selections} == {OLD1, OLD2}
    plan = plan_explicit(p, t, active={ACT}, now_ns=NOW, unpinned=True,
                         namespaces=("test-model",), temp_older_than_s=0)
    assert {s.prefix for s in plan.selections} == {UNP, "test-model", None}
    plan = plan_explicit(p, t, active=set(), now_ns=NOW, namespaces=("kvp-" + "9" * 32,))
    assert plan.bytes == 0 and "no files" in plan.notes[0]


def test_active_namespace_refused_without_force() -> None:
    p, t = tree()
    with pytest.raises(UsageError, match="--force"):
        plan_explicit(p, t, active={ACT}, now_ns=NOW, namespaces=(ACT,))
    plan = plan_explicit(p, t, active={ACT}, now_ns=NOW, namespaces=(ACT,), force=True)
    assert plan.selections[0].kind == ACTIVE and plan.selections[0].before_ns is None
