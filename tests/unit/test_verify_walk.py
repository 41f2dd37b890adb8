"""verify on real trees: what it checks, and that quarantine moves only the file it checked,
never through a symlink."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpersist.errors import KvpError, UsageError
from kvpersist.l2 import frames
from kvpersist.l2.layout import ChunkName, temp_name
from kvpersist.l2.verify import root as verify
from tests.l2_roots import verify_at

NS = "kvp-" + "d4" * 16
MASTER = bytes(range(32))
#: a KV chunk's plaintext is a multiple of 256 bytes (frames.PLAINTEXT_ALIGN): 5 KiB here
PLAIN = 5120


def frame(salt: str | None = None, corrupt: bool = False, plain: int = PLAIN) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    dek = frames._derive(MASTER, salt or "", 16)
    iv = os.urandom(12)
    blob = bytearray(bytes([1]) + iv + AESGCM(dek).encrypt(iv, os.urandom(plain), None))
    if corrupt:
        blob[100] ^= 1
    return bytes(blob) + b"\0" * (-len(blob) % 4096)


def chunk(i: int, salt: str | None = None) -> ChunkName:
    return ChunkName(NS, 0x01000100, 0, f"{i:04x}" + "e" * 12, salt)


def put(path: Path, data: bytes, age_s: float = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))
    return path


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "cache"
    outside = tmp_path / "outside"
    t = {"root": root, "outside": outside}
    for i in range(3):
        put(root / chunk(i).filename(), frame())
    put(root / chunk(3, "tenant").relpath(shard_dirs=True), frame("tenant"))
    t["corrupt"] = put(root / chunk(4).relpath(shard_dirs=True), frame(corrupt=True))
    t["short"] = put(root / chunk(5).filename(), frame()[:4096 - 512])  # truncated
    t["temp"] = put(root / temp_name(chunk(6), "ab" * 16), b"partial", age_s=3600)
    # foreign: a chunk in the wrong shard directory (LMCache never reads it)
    t["wrong_shard"] = put(root / "ff/ff" / chunk(7).filename(), frame(corrupt=True))
    # symlinks named like chunks, and a shard-named symlink, pointing at corrupt files
    t["precious"] = put(outside / "precious.bin", frame(corrupt=True))
    t["link"] = root / chunk(8).filename()  # LMCache would read through it: a finding
    t["link"].symlink_to(t["precious"])
    put(outside / "shard" / chunk(0x1200).filename(), frame(corrupt=True))
    (root / "12").mkdir()
    (root / "12" / "00").symlink_to(outside / "shard")
    return t


def run(root: Path, apply: bool = False,
        progress: Callable[[int, int], None] | None = None) -> verify.VerifyResult:
    return verify_at(root, NS, key=MASTER, apply=apply, rate_mb_s=None,
                              progress=progress)


def test_findings_cover_the_layout_and_nothing_else(tree: dict[str, Path]) -> None:
    res = run(tree["root"])
    assert res.files == 7 and res.authenticated == 4
    kinds = {Path(f.path).name: f.kind for f in res.findings}
    assert kinds == {tree["corrupt"].name: "auth", tree["short"].name: "size",
                     tree["temp"].name: "temp", tree["link"].name: "type"}
    assert {f.path for f in res.findings} == {
        os.path.join(str(tree["root"]), str(tree[k].relative_to(tree["root"])))
        for k in ("corrupt", "short", "temp", "link")}
    assert res.quarantined == [] and res.skipped == []


def test_apply_quarantines_through_descriptors_and_leaves_the_rest(tree: dict[str, Path]) -> None:
    root = tree["root"]
    precious = tree["precious"].read_bytes()
    res = run(root, apply=True)
    q = root / ".kvpersist/quarantine"
    assert sorted(Path(p).parent for p in res.quarantined) == [q] * 4
    assert {p.name.split(".")[0] for p in q.iterdir()} == {
        tree[k].name.split(".")[0] for k in ("corrupt", "short", "temp", "link")}
    for k in ("corrupt", "short", "temp", "link"):
        assert not os.path.lexists(tree[k])
    assert tree["wrong_shard"].exists() and tree["precious"].read_bytes() == precious
    # the link itself was moved, never what it points to
    moved = [p for p in q.iterdir() if p.name.startswith(tree["link"].name)]
    assert len(moved) == 1 and moved[0].is_symlink()
    assert os.readlink(moved[0]) == str(tree["precious"])
    assert len(list((tree["outside"] / "shard").iterdir())) == 1
    # nothing left to find; a second run moves nothing
    again = run(root, apply=True)
    assert again.findings == [] and again.quarantined == []


def test_a_file_changed_after_it_was_checked_is_not_quarantined(tree: dict[str, Path]) -> None:
    root = tree["root"]
    changed: list[str] = []

    def progress(done: int, total: int) -> None:
        # before the last check (a shard directory's): the root's files were checked already
        if done == total and not changed:
            new = tree["temp"].with_name("new")
            new.write_bytes(b"partial")
            os.replace(new, tree["temp"])          # another inode under the name
            with open(tree["short"], "ab") as f:   # same inode, other size
                f.write(b"\0" * 512)
            changed.append("yes")

    res = run(root, apply=True, progress=progress)
    assert changed
    assert sorted(Path(p).name.split(".")[0] for p in res.quarantined) == sorted(
        tree[k].name.split(".")[0] for k in ("corrupt", "link"))
    assert sorted(res.skipped) == sorted(
        f"{os.path.join(str(root), str(tree[k].relative_to(root)))}: changed since it was "
        "checked" for k in ("short", "temp"))
    assert tree["temp"].exists() and tree["short"].exists()


@pytest.mark.parametrize("link", [".kvpersist", ".kvpersist/quarantine"])
def test_a_symlinked_quarantine_is_refused(tree: dict[str, Path], tmp_path: Path,
                                           link: str) -> None:
    root = tree["root"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / link).parent.mkdir(parents=True, exist_ok=True)
    (root / link).symlink_to(elsewhere)
    with pytest.raises(KvpError, match="symbolic link"):
        run(root, apply=True)
    assert list(elsewhere.iterdir()) == []
    assert all(tree[k].exists() for k in ("corrupt", "short", "temp"))


def test_a_missing_root_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot verify .*no such directory"):
        run(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        run(tmp_path / "file")


def dirty_frame(plain: int = PLAIN) -> bytes:
    """A valid frame whose 4 KiB padding holds stale bytes, as LMCache writes it when its L1
    temp buffer reuses memory of another chunk (the serializer never clears the padding)."""
    blob = frame(plain=plain)
    end = len(blob) - (-(1 + 12 + plain + 16) % 4096)
    return blob[:end] + os.urandom(len(blob) - end)


def test_a_valid_frame_with_stale_padding_is_not_a_finding(tmp_path: Path) -> None:
    """Alone (nothing to learn its length from), every file dirty (a small L1 reuses its
    memory all the time: the 60-minute soak's verify quarantined 522 valid files so), first,
    or among clean files: it authenticates; a corrupt frame still fails."""
    root = tmp_path / "cache"
    put(root / chunk(0).filename(), dirty_frame())
    alone = verify_at(root, NS, key=MASTER, rate_mb_s=None)
    assert alone.findings == [] and alone.authenticated == 1
    for i in range(1, 4):
        put(root / chunk(i).filename(), dirty_frame())
    bad = put(root / chunk(4).filename(), frame(corrupt=True))
    res = verify_at(root, NS, key=MASTER, rate_mb_s=None, apply=True)
    assert res.authenticated == 4
    assert [(Path(f.path).name, f.kind) for f in res.findings] == [(bad.name, "auth")]
    assert len(res.quarantined) == 1 and not bad.exists()
    for i in range(5, 8):
        put(root / chunk(i).filename(), frame())
    put(root / chunk(8).filename(), dirty_frame())
    assert verify_at(root, NS, key=MASTER, rate_mb_s=None).authenticated == 8


def test_a_dirty_frame_of_an_unaligned_length_alone_is_the_case_left(tmp_path: Path) -> None:
    """A plaintext length no KV chunk has (not a multiple of 256) with dirty padding and no
    other file to learn the length from fails every length tried: reported, as documented;
    beside one clean file of its length it authenticates."""
    root = tmp_path / "cache"
    put(root / chunk(0).filename(), dirty_frame(plain=5000))
    alone = verify_at(root, NS, key=MASTER, rate_mb_s=None)
    assert [f.kind for f in alone.findings] == ["auth"]
    put(root / chunk(1).filename(), frame(plain=5000))
    assert verify_at(root, NS, key=MASTER, rate_mb_s=None).authenticated == 2


def test_aligned_lengths_are_tried_most_aligned_first() -> None:
    blob = dirty_frame(plain=1 << 20)  # the demo model's chunk: 1 MiB in a 1,052,672-byte file
    assert len(blob) == 1052672
    cands = frames.frame_candidates(blob, None, aligned=True)
    aligned = [n for n in cands if n % 256 == 0]
    assert aligned[0] == 1 << 20 and len(aligned) == 16
    assert all(len(blob) - 4096 < n + 29 <= len(blob) for n in aligned)
    assert frames.frame_candidates(blob, 1 << 20)[0] == 1 << 20
    assert not any(n % 256 == 0 for n in frames.frame_candidates(blob, None))


def test_a_crash_window_checks_only_recent_files_and_learns_from_older_ones(
        tmp_path: Path) -> None:
    root = tmp_path / "cache"
    old = [put(root / chunk(i).filename(), frame(), age_s=3600) for i in range(3)]
    old_bad = put(root / chunk(3).filename(), frame(corrupt=True), age_s=3600)
    since = time.time_ns() - 60 * 10**9
    fresh_dirty = put(root / chunk(4).filename(), dirty_frame())
    fresh_bad = put(root / chunk(5).filename(), os.urandom(len(frame())))
    before = {p: p.stat() for p in [*old, old_bad, fresh_dirty]}
    res = verify_at(root, NS, key=MASTER, rate_mb_s=None, since_ns=since, apply=True)
    assert res.files == 2 and res.authenticated == 1 and res.reference_reads >= 1
    assert [(Path(f.path).name, f.kind) for f in res.findings] == [(fresh_bad.name, "auth")]
    assert not fresh_bad.exists() and len(res.quarantined) == 1
    for p, st in before.items():  # the old corrupt file is outside the window: untouched
        now = p.stat()
        assert (now.st_ino, now.st_mtime_ns, now.st_size) == (st.st_ino, st.st_mtime_ns,
                                                              st.st_size)


def test_a_crash_window_deadline_leaves_files_unchecked(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    for i in range(4):
        put(root / chunk(i).filename(), frame())
    res = verify_at(root, NS, key=MASTER, rate_mb_s=None, since_ns=0, deadline_s=0)
    assert res.unchecked == 4 and res.authenticated == 0 and not res.findings
