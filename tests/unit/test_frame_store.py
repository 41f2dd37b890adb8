"""The frame record on a real cache root (issue 38, item 4): written owner-only and
atomically under ``.kvpersist/frames/``, read bounded (a huge, foreign, linked or damaged
record is refused with a warning, never loaded whole or trusted), and checked by verify, by
the launch's check (after a clean stop too: a rename keeps the file's old mtime, outside any
crash window) and by scrub, which learn from the frames they already read."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from kvpersist.config.loader import load_deployment
from kvpersist.l2.tree import open_root
from kvpersist.l2.verify import frame_record as fr
from kvpersist.l2.verify import frame_store
from kvpersist.l2.verify.frame_record import FrameRecord, judge
from kvpersist.l2.verify.root import VerifyResult, verify_root
from kvpersist.stack import crash_window
from kvpersist.stack.locate import locate
from kvpersist.stack.stops import CrashWindow
from tests.cli import kvp

from ..l2_roots import prune_at
from .test_hostile_chunk_sizes import NS, chunk, demo, frame  # noqa: F401  (the fixture)

__all__ = ["demo"]


def records(root: Path) -> Path:
    return root / ".kvpersist" / "frames"


def verify(root: Path, record: FrameRecord | None = None, *, save: bool = True,
           **kw: object) -> VerifyResult:
    """verify_root with the namespace's record (loaded from the root unless given), saved
    after, as ``kvp-admin verify`` does."""
    from tests.unit.test_hostile_chunk_sizes import MASTER

    with open_root(root) as r:
        if record is None:
            record, warning = frame_store.load(r, NS)
            assert warning == ""
        res = verify_root(r, NS, key=MASTER, rate_mb_s=None, record=record, **kw)  # type: ignore[arg-type]
        if save:
            frame_store.save(r, record)
    return res


def tree(root: Path, n: int = 4) -> list[Path]:
    root.mkdir(mode=0o700, exist_ok=True)
    files = []
    for i in range(n):
        p = root / chunk(i).filename()
        p.write_bytes(frame(dirty=False))
        files.append(p)
    return files


def kinds(res: VerifyResult) -> dict[str, str]:
    return {Path(f.path).name: f.kind for f in res.findings}


# --------------------------------------------------------------------------- the file


def test_the_record_is_owner_only_atomic_and_round_trips(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    files = tree(root)
    res = verify(root)
    assert res.frames is not None and res.frames.new == 4 and res.findings == []
    rec_file = records(root) / f"{NS}.frames"
    assert stat.S_IMODE(rec_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(records(root).stat().st_mode) == 0o700
    assert [p.name for p in records(root).iterdir()] == [rec_file.name]  # no temp left
    assert ".tmp." not in rec_file.name  # LMCache's stop deletes such names under the root
    with open_root(root) as r:
        rec, warning = frame_store.load(r, NS)
        assert warning == "" and len(rec) == 4 and not rec.changed
        assert frame_store.save(r, rec) == (0, "")  # unchanged: not written again
    assert {n for n in rec.live} == {p.name for p in files}
    again = verify(root)
    assert again.frames is not None and again.frames.unchanged == 4


@pytest.mark.parametrize("kind", ["huge", "fifo", "symlink", "group-writable", "garbage",
                                  "directory", "other-namespace"])
def test_a_record_that_cannot_be_trusted_is_refused_and_replaced(tmp_path: Path,
                                                                 kind: str) -> None:
    root = tmp_path / "cache"
    tree(root, 2)
    records(root).mkdir(parents=True, mode=0o700)
    target = records(root) / f"{NS}.frames"
    elsewhere = tmp_path / "elsewhere.frames"
    elsewhere.write_bytes(fr.encode(FrameRecord(NS)))
    if kind == "huge":  # sparse: never read, refused by its size
        with open(target, "wb") as f:
            f.truncate(fr.MAX_RECORD_BYTES + 1)
    elif kind == "fifo":
        os.mkfifo(target, 0o600)
    elif kind == "symlink":
        target.symlink_to(elsewhere)
    elif kind == "group-writable":
        target.write_bytes(elsewhere.read_bytes())
        target.chmod(0o620)
    elif kind == "garbage":
        target.write_bytes(os.urandom(4096))
    elif kind == "directory":
        target.mkdir()
    else:
        target.write_bytes(fr.encode(FrameRecord("kvp-" + "0" * 32)))
    t0 = time.monotonic()
    with open_root(root) as r:
        rec, warning = frame_store.load(r, NS)
    assert time.monotonic() - t0 < 5  # a FIFO never blocks the open
    assert f"frame record {target}" in warning and "refused" in warning, warning
    assert len(rec) == 0 and rec.changed
    if kind in ("fifo", "directory"):
        return  # not replaced by a rename (a directory cannot be, a FIFO is left as it is)
    res = verify(root, rec)
    assert res.frames is not None and res.frames.new == 2
    assert stat.S_ISREG(target.lstat().st_mode) and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert elsewhere.read_bytes() == fr.encode(FrameRecord(NS))  # a link is replaced, not followed


def test_a_symlinked_frames_directory_is_never_written_through(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tree(root, 1)
    (root / ".kvpersist").mkdir(mode=0o700)
    outside = tmp_path / "outside"
    outside.mkdir()
    records(root).symlink_to(outside)
    with open_root(root) as r:
        rec, warning = frame_store.load(r, NS)
        assert "refused" in warning
        verify_root(r, NS, key=bytes(range(32)), rate_mb_s=None, record=rec)
        size, unwritten = frame_store.save(r, rec)
    assert size == 0 and "not written" in unwritten and "symbolic link" in unwritten
    assert list(outside.iterdir()) == []


# --------------------------------------------------------------------------- verify


def test_verify_finds_a_rename_over_another_chunk_and_quarantines_it(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    a, b, c, d = tree(root)
    verify(root)  # learns
    os.rename(a, b)  # mv A B: one valid frame, under the wrong name
    res = verify(root, apply=True)
    assert kinds(res) == {b.name: "moved"}, res.findings
    detail = res.findings[0].detail
    assert f"recorded under {a.name}" in detail and "is gone" in detail
    assert res.authenticated == 3 and res.frames is not None
    assert (res.frames.moved, res.frames.gone) == (1, 1)
    assert [Path(q).name.split(".moved.")[0] for q in res.quarantined] == [b.name]
    assert not a.exists() and not b.exists() and c.exists() and d.exists()
    assert verify(root).findings == []  # nothing left to find


def test_verify_finds_a_swap_and_a_rename_to_a_new_name(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    a, b, c, d = tree(root)
    verify(root)
    tmp = root / "swap"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    fresh = root / chunk(9).filename()
    os.rename(c, fresh)
    res = verify(root)
    assert kinds(res) == {a.name: "moved", b.name: "moved", fresh.name: "moved"}


def test_a_chunk_stored_again_and_an_old_copy_of_itself_are_not_findings(
        tmp_path: Path) -> None:
    """What LMCache does after a quarantine or an eviction: a new file under the name, with a
    fresh IV. And a restore of the chunk's own older file: the same chunk's KV."""
    root = tmp_path / "cache"
    a, b, *_ = tree(root)
    verify(root)
    old = a.read_bytes()
    a.unlink()
    a.write_bytes(frame(dirty=False))  # stored again
    res = verify(root)
    assert res.findings == [] and res.frames is not None and res.frames.rewritten == 1
    a.write_bytes(old)  # its own older frame, back from a backup
    res = verify(root)
    assert res.findings == [] and res.frames is not None and res.frames.restored == 1


def test_a_copy_is_still_dup_under_both_names_in_verify(tmp_path: Path) -> None:
    """verify reads every file: a frame under two names is the dup rule's (both quarantined,
    as before the record); the record neither learns nor judges them."""
    root = tmp_path / "cache"
    a, b, *_ = tree(root)
    verify(root)
    b.write_bytes(a.read_bytes())
    res = verify(root)
    assert kinds(res) == {a.name: "dup", b.name: "dup"}
    assert res.frames is not None and res.frames.moved == 0


def test_serde_none_has_no_frame_record(demo: tuple[Path, dict[str, str]]) -> None:
    root, env = demo
    (root / chunk(0).filename()).write_bytes(frame())
    r = kvp("verify", "cpu-demo", "--json", env={**env, "KVP_L2_SERDE": "none"})
    doc = json.loads(r.stdout)
    assert doc["frames"]["applies"] is False and "serde none" in doc["frames"]["reason"], doc
    assert not records(root).exists()


def test_the_verify_command_reports_moved_and_records_it(
        demo: tuple[Path, dict[str, str]]) -> None:
    root, env = demo
    a, b = (root / chunk(i).filename() for i in (0, 1))
    a.write_bytes(frame())
    b.write_bytes(frame())
    first = json.loads(kvp("verify", "cpu-demo", "--json", env=env).stdout)
    assert first["frames"]["new"] == 2 and first["findings"] == [], first
    os.rename(a, b)
    r = kvp("verify", "cpu-demo", env=env)
    assert r.returncode == 1 and "moved" in r.stdout and "dry run" in r.stdout, r.stdout
    r = kvp("verify", "cpu-demo", "--apply", "--json", env=env)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and [f["kind"] for f in doc["findings"]] == ["moved"], doc
    assert len(doc["quarantined"]) == 1 and not b.exists()
    runs = json.loads((root / ".kvpersist" / "runs" / "verify.json").read_text())
    assert runs["counts"]["moved"] == 1


# --------------------------------------------------------------------------- the launch


def test_the_launch_check_after_a_clean_stop_quarantines_a_rename(
        demo: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A clean stop: no crash window, but the frame record is checked; ``mv`` keeps the
    file's mtime (it would be outside any window) and moves its ctime, so the launch reads
    that file's 13 first bytes and no other."""
    root, env = demo
    for k, v in env.items():
        if k.startswith("KVP_"):
            monkeypatch.setenv(k, v)
    loc = locate(load_deployment("cpu-demo"))
    files = [root / chunk(i).filename() for i in range(5)]
    for p in files:
        p.write_bytes(frame())
    old = time.time() - 3600
    for p in files:
        os.utime(p, (old, old))
    clean = CrashWindow(False, None, "clean stop at ...")
    first = crash_window.check(loc, clean)
    assert not first.ran and first.frames is not None, first
    assert (first.frames.new, first.frames.read, first.quarantined) == (5, 5, [])
    assert first.bytes_read == 0  # nothing authenticated after a clean stop
    again = crash_window.check(loc, clean)
    assert again.frames is not None and (again.frames.read, again.frames.unchanged) == (0, 5)
    os.rename(files[0], files[1])
    res = crash_window.check(loc, clean)
    assert res.frames is not None and (res.frames.read, res.frames.moved) == (1, 1), res
    assert [f["kind"] for f in res.findings] == ["moved"]
    assert [Path(q).name.split(".moved.")[0] for q in res.quarantined] == [files[1].name]
    assert not files[1].exists() and all(p.exists() for p in files[2:])
    assert "1 under another chunk's name, 1 quarantined" in res.frames_line()
    assert json.loads(json.dumps(res.to_dict()))["frames"]["moved"] == 1


def test_the_launch_check_after_an_unclean_stop_reuses_the_window_reads(
        demo: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    root, env = demo
    for k, v in env.items():
        if k.startswith("KVP_"):
            monkeypatch.setenv(k, v)
    loc = locate(load_deployment("cpu-demo"))
    old_files = [root / chunk(i).filename() for i in range(3)]
    for p in old_files:
        p.write_bytes(frame())
        os.utime(p, (time.time() - 3600,) * 2)
    crash_window.check(loc, CrashWindow(False, None, "clean"))
    since = time.time_ns()
    new = root / chunk(7).filename()
    new.write_bytes(frame())
    os.rename(old_files[0], old_files[1])  # old mtime: outside the window
    res = crash_window.check(loc, CrashWindow(True, since, "the server was killed"))
    assert res.ran and res.authenticated == 1 and res.frames is not None, res
    # the window's file came from authentication; the renamed one was read for its header
    assert (res.frames.authenticated, res.frames.read, res.frames.new) == (1, 1, 1), res.frames
    assert [f["kind"] for f in res.findings] == ["moved"] and not old_files[1].exists()


def test_the_launch_check_honours_its_time_bound(demo: tuple[Path, dict[str, str]],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    root, env = demo
    for k, v in env.items():
        if k.startswith("KVP_"):
            monkeypatch.setenv(k, v)
    loc = locate(load_deployment("cpu-demo"))
    for i in range(3):
        (root / chunk(i).filename()).write_bytes(frame())
    res = crash_window.check(loc, CrashWindow(False, None, "clean"), deadline_s=0)
    assert res.frames is not None and (res.frames.unchecked, res.frames.read) == (3, 0)
    assert "NOT read" in res.frames_line()
    res = crash_window.check(loc, CrashWindow(False, None, "clean"))  # the next launch
    assert res.frames is not None and res.frames.new == 3


# --------------------------------------------------------------------------- scrub, prune


def test_scrub_learns_what_it_authenticates_and_names_a_moved_frame(tmp_path: Path) -> None:
    from kvpersist.l2.scrub import scrub_root
    from tests.unit.test_hostile_chunk_sizes import MASTER

    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    a, b = (root / chunk(i).filename() for i in (0, 1))
    a.write_bytes(frame())
    b.write_bytes(frame())
    with open_root(root) as r:
        rec = FrameRecord(NS)
        res = scrub_root(r, NS, MASTER, apply=True, record=rec)
        assert res.scrubbed == 2 and len(rec) == 2 and res.moved == []
        # scrubbed in place: the record holds the files as the scrub left them
        assert all(rec.known(p.name, p.stat().st_ino, p.stat().st_ctime_ns) for p in (a, b))
        os.rename(a, b)
        res = scrub_root(r, NS, MASTER, apply=True, record=rec)
        assert res.moved == [b.name] and rec.owner(rec.live[b.name].identity) == b.name


def test_pruning_a_whole_namespace_removes_its_record(tmp_path: Path) -> None:
    from kvpersist.l2.retention import Selection

    root = tmp_path / "cache"
    tree(root, 2)
    verify(root)
    assert (records(root) / f"{NS}.frames").exists()
    res = prune_at(root, [Selection("ns", NS, None, 2, 0, "named", named=True)],
                   dry_run=False)
    assert res.frame_records_removed == [NS] and not (records(root) / f"{NS}.frames").exists()


def test_judge_and_learn_cost_is_linear_enough() -> None:
    """A smoke bound, not a benchmark (bench/frame_record_cost.py measures): 20,000 names
    learned, encoded and decoded in well under the time the launch allows."""
    names = {chunk(i).filename(): os.urandom(12) for i in range(20000)}
    t0 = time.monotonic()
    rec = FrameRecord(NS)
    rec.learn(judge(rec, names, set(names)), names, {n: (1, 2) for n in names})
    back = fr.decode(fr.encode(rec), NS)
    assert len(back) == 20000 and time.monotonic() - t0 < 10
