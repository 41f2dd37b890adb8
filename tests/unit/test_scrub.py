"""scrub on real trees: it zeroes exactly the bytes after an authenticated frame, through the
inode it listed, keeps the file's size and times, reads only the padding of a clean file once
the frame length is known, and touches nothing else (no symlink, no other namespace, no file
failing authentication, nothing in a dry run)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvpersist.l2 import frames
from kvpersist.l2.layout import ChunkName, temp_name
from kvpersist.l2.scrub import ScrubResult, scrub_root
from kvpersist.l2.tree import open_root

NS = "kvp-" + "c3" * 16
OTHER = "kvp-" + "a1" * 16
MASTER = bytes(range(32))
PLAIN = 5120  # a multiple of 256 bytes, as a KV chunk's plaintext
SIZE = 8192  # the frame (5,149 bytes) padded to 4 KiB pages
STALE = os.urandom(SIZE)  # "another chunk's" bytes left in the L1 buffer


def frame(salt: str = "", dirty: bool = True, plain: bytes | None = None) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    iv = os.urandom(12)
    body = bytes([1]) + iv + AESGCM(frames.derive_key(MASTER, salt)).encrypt(
        iv, plain if plain is not None else os.urandom(PLAIN), None)
    pad = STALE[len(body):] if dirty else bytes(SIZE - len(body))
    return body + pad


def chunk(i: int, salt: str | None = None, ns: str = NS) -> ChunkName:
    return ChunkName(ns, 0x01000100, 0, f"{i:04x}" + "b" * 12, salt)


def put(path: Path, data: bytes, age_s: float = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t - 5, t))
    return path


def scrub(root: Path, **kw: object) -> ScrubResult:
    with open_root(root) as r:
        return scrub_root(r, NS, MASTER, **kw)  # type: ignore[arg-type]


def padding(path: Path) -> bytes:
    return path.read_bytes()[frames.frame_end(PLAIN):]


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "cache"
    outside = tmp_path / "outside"
    t = {"root": root}
    t["clean"] = put(root / chunk(0).filename(), frame(dirty=False), age_s=7200)
    t["dirty"] = put(root / chunk(1).filename(), frame(), age_s=3600)
    t["salted"] = put(root / chunk(2, "tenant").relpath(shard_dirs=True), frame("tenant"))
    bad = bytearray(frame())
    bad[40] ^= 1
    t["corrupt"] = put(root / chunk(3).filename(), bytes(bad))
    t["other_ns"] = put(root / chunk(4, ns=OTHER).filename(), frame())
    t["temp"] = put(root / temp_name(chunk(5), "cd" * 16), frame())
    t["precious"] = put(outside / "precious.bin", frame())
    t["link"] = root / chunk(6).filename()
    t["link"].symlink_to(t["precious"])
    t["wrong_shard"] = put(root / "ff/ff" / chunk(7).filename(), frame())
    return t


def test_dirty_padding_is_zeroed_past_the_frame_only(tree: dict[str, Path]) -> None:
    plain = os.urandom(PLAIN)
    dirty = put(tree["root"] / chunk(8).filename(), frame(plain=plain), age_s=600)
    head = dirty.read_bytes()[:frames.frame_end(PLAIN)]
    st0 = dirty.stat()  # after the read above (atime)
    res = scrub(tree["root"], apply=True)
    assert (res.files, res.dirty, res.scrubbed, res.clean, res.unauthenticated) == (
        5, 3, 3, 1, 1), res
    assert res.bytes_zeroed == 3 * (SIZE - frames.frame_end(PLAIN)) and res.skipped == []
    for name in ("dirty", "salted"):
        assert not any(padding(tree[name])) and tree[name].stat().st_size == SIZE
    st = dirty.stat()  # before the reads below
    assert dirty.read_bytes()[:frames.frame_end(PLAIN)] == head
    assert frames.decrypt(dirty.read_bytes(), frames.derive_key(MASTER), PLAIN) == plain
    assert (st.st_ino, st.st_size, st.st_mtime_ns, st.st_atime_ns) == (
        st0.st_ino, st0.st_size, st0.st_mtime_ns, st0.st_atime_ns)
    # nothing else was written: a frame failing authentication, another namespace, a temp
    # file, a symlink's target, a chunk in a shard directory LMCache never reads
    for name in ("corrupt", "other_ns", "temp", "precious", "wrong_shard"):
        assert padding(tree[name]) == STALE[frames.frame_end(PLAIN):], name
    assert tree["link"].is_symlink()


def test_a_dry_run_counts_and_writes_nothing(tree: dict[str, Path]) -> None:
    before = {p: p.read_bytes() for p in tree["root"].rglob("*") if p.is_file()}
    res = scrub(tree["root"])
    assert (res.dirty, res.scrubbed) == (2, 0) and res.bytes_zeroed > 0
    assert {p: p.read_bytes() for p in before} == before


def test_a_second_scrub_reads_only_the_padding_and_writes_nothing(
        tree: dict[str, Path]) -> None:
    for i in range(9, 29):
        put(tree["root"] / chunk(i).filename(), frame())
    first = scrub(tree["root"], apply=True)
    assert first.scrubbed == 22
    times = {p: p.stat().st_mtime_ns for p in tree["root"].glob("*.bin")}
    again = scrub(tree["root"], apply=True)
    assert again.scrubbed == 0 and again.dirty == 0 and again.clean == 23
    # one file of each (group, size) read whole to learn the frame length, then the
    # padding alone of every other clean file (the file failing authentication is read whole)
    tail = SIZE - frames.frame_end(PLAIN)
    assert again.bytes_read <= 2 * SIZE + 2 * SIZE + 23 * tail, again
    assert {p: p.stat().st_mtime_ns for p in times} == times


def test_since_limits_the_scrub_to_the_window(tree: dict[str, Path]) -> None:
    res = scrub(tree["root"], apply=True, since_ns=time.time_ns() - 60 * 10**9)
    assert res.scrubbed == 1 and any(padding(tree["dirty"]))  # one hour old: outside
    assert not any(padding(tree["salted"]))


def test_a_file_replaced_after_the_listing_is_left_alone(tree: dict[str, Path]) -> None:
    """LMCache publishes by rename: the inode listed is not the one found at open time (the
    progress callback runs after the listing, before the first file is opened)."""
    replaced = tree["root"] / "replacement"

    def replace(done: int, total: int) -> None:
        if done == 1:
            put(replaced, frame())
            os.rename(replaced, tree["dirty"])

    res = scrub(tree["root"], apply=True, progress=replace)
    assert any("changed since it was listed" in s for s in res.skipped), res.skipped
    assert any(padding(tree["dirty"])) and res.scrubbed == 1


def test_a_deadline_stops_the_scrub_and_counts_the_rest(tree: dict[str, Path]) -> None:
    res = scrub(tree["root"], apply=True, deadline_s=0)
    assert res.unchecked == 4 and res.files == 0 and any(padding(tree["dirty"]))
