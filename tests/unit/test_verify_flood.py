"""verify never condemns an authentic chunk: the read order (pure) and floods of garbage files
named like the namespace's chunks, on real trees (full verify, crash window, a deadline)."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvpersist.l2.layout import ChunkName
from kvpersist.l2.verify import root as verify
from kvpersist.l2.verify.order import ReadOrder, failed_verdict
from kvpersist.system.untrusted import ChunkFile

from ..l2_roots import verify_at
from .test_verify_walk import MASTER, NS, dirty_frame, frame, put

G = (NS, 1)


def drain(order: ReadOrder[str], fails: set[str]) -> list[str]:
    """Pop every item, reporting each as authentic unless its name is in ``fails``; items are
    named ``<size>:<label>``."""
    out = []
    while (item := order.pop()) is not None:
        out.append(item)
        size = int(item.split(":")[0])
        order.learned((G, size), item not in fails)
    return out


def test_the_walk_order_stays_while_no_size_fails() -> None:
    order: ReadOrder[str] = ReadOrder()
    items = ["8:a", "8:b", "3:c", "8:d"]
    for it in items:
        order.add(it, (G, int(it[0])))
    assert len(order) == 4
    assert drain(order, {"3:c"}) == items and len(order) == 0


def test_a_size_that_failed_waits_behind_the_other_sizes() -> None:
    """One garbage file of the common size is read; its siblings wait behind every other
    size (the authentic files)."""
    order: ReadOrder[str] = ReadOrder()
    walk = ["4:g0", "4:g1", "8:a0", "4:g2", "4:g3", "8:a1", "4:g4", "8:a2"]
    for it in walk:
        order.add(it, (G, int(it[0])))
    got = drain(order, {f"4:g{i}" for i in range(5)})
    assert got == ["4:g0", "8:a0", "8:a1", "8:a2", "4:g1", "4:g2", "4:g3", "4:g4"]


def test_failed_sizes_take_turns_until_one_authenticates() -> None:
    """Garbage of the authentic size read first: both sizes fail, they take turns, and the
    first authentic file brings the rest of its size forward."""
    order: ReadOrder[str] = ReadOrder()
    walk = ["4:g0", "8:x0", "8:x1", "4:g1", "4:g2", "8:a0", "4:g3", "8:a1", "4:g4", "8:a2"]
    for it in walk:
        order.add(it, (G, int(it[0])))
    got = drain(order, {"4:g0", "4:g1", "4:g2", "4:g3", "4:g4", "8:x0", "8:x1"})
    assert got == ["4:g0", "8:x0", "4:g1", "8:x1", "4:g2", "8:a0", "8:a1", "8:a2",
                   "4:g3", "4:g4"]


def test_pins_first_and_unauthenticated_groups_last() -> None:
    order: ReadOrder[str] = ReadOrder()
    order.add("plain:1", None)
    order.add("8:a", (G, 8))
    order.add("8:pin", (G, 8), pinned=True)
    order.add("plain:2", None, pinned=True)
    got = []
    while (item := order.pop()) is not None:
        got.append(item)
    assert got == ["8:pin", "plain:2", "8:a", "plain:1"]


@pytest.mark.parametrize(("size", "authentic", "usual", "kind"), [
    (4096, Counter({8192: 3}), 4096, "size"),   # the flood's size is the most common one
    (8192, Counter({8192: 3}), 4096, "auth"),   # the authentic size, but it fails
    (4096, Counter(), 4096, "auth"),            # nothing authenticates: the usual size
    (3584, Counter(), 8192, "size"),
    (4096, Counter(), None, "auth"),
])
def test_the_kind_of_a_failed_file(size: int, authentic: Counter[int], usual: int | None,
                                   kind: str) -> None:
    got, detail = failed_verdict(size, authentic, usual)
    assert got == kind and "authentication" in detail


# ------------------------------------------------------------------------------ real trees
AUTHENTIC, SMALL, RIGHT_SIZE, ODD = 30, 400, 10, 5


def name(i: int, prefix: str = NS) -> str:
    return ChunkName(prefix, 0x01000100, 0, f"{i:06x}" + "c" * 10, None).filename()


def flood(root: Path, *, age_s: float = 0) -> dict[str, set[Path]]:
    """Authentic frames (one with stale padding) among garbage named like chunks of the
    namespace: many of one small size, some of the authentic size, a few of another."""
    size = len(frame())
    out: dict[str, set[Path]] = {"authentic": set(), "small": set(), "right": set(),
                                 "odd": set()}
    n = 0
    for kind, count, make in (
            ("authentic", AUTHENTIC, lambda j: dirty_frame() if j == 0 else frame()),
            ("small", SMALL, lambda j: os.urandom(4096)),
            ("right", RIGHT_SIZE, lambda j: bytes([1]) + os.urandom(size - 1)),
            ("odd", ODD, lambda j: os.urandom(3 * 4096))):
        for j in range(count):
            out[kind].add(put(root / name(n), make(j), age_s=age_s))
            n += 1
    return out


def check(root: Path, planted: dict[str, set[Path]], res: verify.VerifyResult) -> None:
    assert all(p.exists() for p in planted["authentic"])
    assert res.authenticated == AUTHENTIC
    kinds = {Path(f.path).name: f.kind for f in res.findings}
    assert kinds == {**{p.name: "size" for p in planted["small"] | planted["odd"]},
                     **{p.name: "auth" for p in planted["right"]}}
    assert len(res.quarantined) == SMALL + RIGHT_SIZE + ODD
    assert not any(p.exists() for k in ("small", "right", "odd") for p in planted[k])
    assert sorted(os.listdir(root)) == sorted([".kvpersist",
                                               *(p.name for p in planted["authentic"])])


def test_a_flood_never_condemns_an_authentic_file(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    planted = flood(root)
    res = verify_at(root, NS, key=MASTER, apply=True, rate_mb_s=None)
    check(root, planted, res)


def test_a_crash_window_flood_keeps_the_authentic_files(tmp_path: Path) -> None:
    """Everything in the window (the authentic files too: written since the last launch)."""
    root = tmp_path / "cache"
    since = time.time_ns() - 10**9
    planted = flood(root)
    res = verify_at(root, NS, key=MASTER, apply=True, rate_mb_s=None, since_ns=since,
                             deadline_s=60)
    assert res.unchecked == 0 and res.files == AUTHENTIC + SMALL + RIGHT_SIZE + ODD
    check(root, planted, res)


def recording(monkeypatch: pytest.MonkeyPatch, clock: Any = None) -> list[tuple[str, int]]:
    """Record (name, size) of every file verify reads; with ``clock``, each read of a small
    garbage file costs one second of its time."""
    reads: list[tuple[str, int]] = []
    real = verify._open

    def opened(dfd: int, name: str, **kw: Any) -> ChunkFile:
        f = real(dfd, name, **kw)
        reads.append((name, f.size))
        if clock is not None and f.size == 4096:
            clock.t += 1.0
        return f

    monkeypatch.setattr(verify, "_open", opened)
    return reads


def test_the_authentic_files_are_read_before_the_flood(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "cache"
    planted = flood(root)
    reads = recording(monkeypatch)
    verify_at(root, NS, key=MASTER, rate_mb_s=None)
    good = {p.name for p in planted["authentic"]}
    last = max(i for i, (n, _) in enumerate(reads) if n in good)
    small_before = sum(1 for n, size in reads[:last] if size == 4096)
    # one small file to learn its size fails, then one per garbage file of the right size
    assert small_before <= 1 + RIGHT_SIZE, small_before


class _Clock:
    """verify's ``time`` with a monotonic clock the test moves."""

    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t

    def __getattr__(self, attr: str) -> Any:
        return getattr(time, attr)


def test_a_deadline_in_a_flood_leaves_garbage_unchecked_not_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the small garbage files is slow (one second each), the deadline 20 s: the
    authentic files are all checked and kept, what is left unchecked is the flood."""
    root = tmp_path / "cache"
    planted = flood(root)
    clock = _Clock()
    monkeypatch.setattr(verify, "time", clock)
    recording(monkeypatch, clock)
    res = verify_at(root, NS, key=MASTER, apply=True, rate_mb_s=None, since_ns=0,
                             deadline_s=20)
    assert res.authenticated == AUTHENTIC
    assert all(p.exists() for p in planted["authentic"])
    assert res.unchecked >= SMALL - 20
    garbage = {p.name for k in ("small", "right", "odd") for p in planted[k]}
    assert {Path(f.path).name for f in res.findings} <= garbage
    assert len(res.findings) + res.unchecked + res.authenticated == res.files


def test_another_namespace_keeps_an_authentic_file_of_an_odd_size(tmp_path: Path) -> None:
    """Files of another namespace are compared with its most common size: with the key, one of
    another size is read and kept when it authenticates; garbage of the common size is left
    alone (not ours to judge), garbage of another size is condemned."""
    root = tmp_path / "cache"
    other = "kvp-" + "e5" * 16
    kept = put(root / name(0, other), frame())
    common = [put(root / name(i, other), os.urandom(4096)) for i in range(1, 6)]
    odd = put(root / name(9, other), os.urandom(3 * 4096))
    res = verify_at(root, NS, key=MASTER, apply=True, rate_mb_s=None)
    assert [(Path(f.path).name, f.kind) for f in res.findings] == [(odd.name, "size")]
    assert kept.exists() and all(p.exists() for p in common) and not odd.exists()
    assert res.authenticated == 1
