"""The fault model against real processes (adapter level; the full-stack rows -- corrupt
files, cache server down -- are in tests/fullstack)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvpersist.demo.kvdriver import connect

from ..conftest import REPO
from ..fullstack._stack import Stack, wait_until

pytestmark = pytest.mark.integration

FRAME_SIZE = 528384  # tiny geometry chunk + aesgcm frame, padded to 4 KiB


def _burst(stack: Stack, ns: str, first: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration._store_burst", stack.rpc, stack.http, ns,
         str(first)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_kill9_during_store_bursts_never_leaves_a_torn_file(stack: Stack) -> None:
    ns = stack.render()["namespace"]
    rng = random.Random(4)
    stored: dict[int, list[str]] = {}
    rounds = 3
    for rnd in range(rounds):
        r = stack.kvp("launch", stack.config, "--no-vllm")  # after kill -9: stale pid file
        assert r.returncode == 0, r.stderr
        if rnd:
            assert "stale pid file" in r.stderr
        pid = int(stack.pid_file.read_text())
        burst = _burst(stack, ns, 1000 * (rnd + 1))
        # wait for the first stores, then kill the server in the middle of the burst
        assert burst.stdout is not None
        first = burst.stdout.readline()
        assert first, "the burst client stored nothing"
        time.sleep(rng.uniform(0.2, 1.2))
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda p=pid: not psutil.pid_exists(p)
                          or psutil.Process(p).status() == psutil.STATUS_ZOMBIE, 20)
        burst.kill()
        out, _ = burst.communicate(timeout=30)
        for line in [first, *out.splitlines()]:
            if line.strip():
                rec = json.loads(line)
                stored[rec["seq"]] = rec["digests"]
        # every file under a final name is complete: authenticated with the deployment's
        # key (size is not integrity)
        _assert_all_authenticate(stack, ns)
    temps = [p for p in stack.root.iterdir() if ".tmp." in p.name]
    report = stack.kvp_json("report", "--root", str(stack.root), "--config", stack.config)
    assert report["temp"]["files"] == len(temps)
    if temps:  # interrupted writes are reported, and prunable explicitly
        r = stack.kvp("prune", "--root", str(stack.root), "--config", stack.config,
                      "--temp-older-than", "0s", "--apply")
        assert r.returncode == 0, r.stderr
        assert not [p for p in stack.root.iterdir() if ".tmp." in p.name]
    # every final file authenticates with the deployment's key
    v = stack.kvp("verify", stack.config, "--json")
    assert v.returncode == 0, v.stdout
    # restart recovers: the index is rebuilt lazily from disk; whatever hits is correct
    stack.launch("--no-vllm")
    full = 0
    with connect(stack.rpc, stack.http, ns) as d:
        for seq, digests in sorted(stored.items()):
            lk, got = d.lookup_and_retrieve(seq)
            if lk.hit_chunks == lk.total_chunks:
                full += 1
                assert got == digests, f"sequence {seq}: retrieved bytes differ"
    assert full >= 1, f"no sequence survived {rounds} crashes ({len(stored)} stored)"


def _assert_all_authenticate(stack: Stack, ns: str) -> None:
    from kvpersist.l2.keys import store as keys
    from tests.l2_roots import verify_at

    key = keys.read_key(stack.state_dir / "keys" / ns / "l2-master.key")
    res = verify_at(stack.root, ns, key=key, rate_mb_s=None)
    assert not res.findings, res.findings
    assert res.authenticated == res.files == len(stack.chunk_files(ns))
    for f in stack.chunk_files(ns):
        assert f.stat().st_size == FRAME_SIZE, f"torn file {f.name}"


def _snapshot(root: Path) -> dict[str, tuple[int, int, int, bytes]]:
    """Every file under ``root``: (inode, mtime_ns, size, bytes); not the frame record
    (``.kvpersist/frames/``), which the launch's check writes as it learns."""
    out = {}
    frames = root / ".kvpersist" / "frames"
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink() and frames not in p.parents:
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_ino, st.st_mtime_ns, st.st_size,
                                             p.read_bytes())
    return out


def test_after_kill9_launch_quarantines_a_bad_full_size_file_before_serving(
        stack: Stack) -> None:
    """kill -9 of the server; a full-size final file of random bytes with a fresh mtime (what
    a crash could leave); the next launch finds the stop unclean, authenticates the files
    written since the last launch and quarantines the bad one before the server starts.
    Every other file is untouched (same inode, mtime and bytes); the first lookup of the
    planted chunk's sequence misses; a clean stop then skips the check."""
    ns = stack.render()["namespace"]
    first = stack.launch("--no-vllm")
    assert first["crash_window"]["unclean"] is False
    with connect(stack.rpc, stack.http, ns) as d:
        stored = {seq: d.store(seq) for seq in (1, 2, 3)}
    assert wait_until(lambda: len(stack.chunk_files(ns)) == 12, 30)
    pid = int(stack.pid_file.read_text())
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not psutil.pid_exists(pid)
                      or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 20)
    # what the crash left: a chunk of sequence 4 published under its final name, full size,
    # random bytes, fresh mtime (the name of a real chunk: store 4 elsewhere to learn it)
    other = Stack(stack.tmp / "other")
    other.root.parent.mkdir(parents=True)
    try:
        other.launch("--no-vllm")
        with connect(other.rpc, other.http, ns) as d:
            d.store(4)
        other.stop()
    finally:
        other.cleanup()
    planted_name = sorted(p.name for p in other.chunk_files(ns))[0]
    planted = stack.root / planted_name
    assert not planted.exists()
    planted.write_bytes(os.urandom(FRAME_SIZE))
    before = _snapshot(stack.root)
    del before[planted_name]

    r = stack.kvp("launch", stack.config, "--no-vllm", "--json")
    assert r.returncode == 0, r.stderr
    cw = json.loads(r.stdout)["crash_window"]
    assert cw["unclean"] and cw["ran"] and cw["complete"], cw
    assert cw["files"] == 13 and cw["authenticated"] == 12 and cw["failed"] == 1, cw
    assert [Path(q).name.split(".auth.")[0] for q in cw["quarantined"]] == [planted_name]
    assert "crash window: unclean stop" in r.stderr and "1 quarantined" in r.stderr
    log = (stack.state_dir / "logs" / "launch.log").read_text().splitlines()
    assert json.loads(log[-1])["crash_window"]["quarantined"] == cw["quarantined"]
    # quarantined before the server started: the server log has no line about the file,
    # and the first lookup of its sequence is a miss for that chunk
    assert not planted.exists()
    q = Path(cw["quarantined"][0])
    assert q.parent == stack.root / ".kvpersist" / "quarantine"
    after = _snapshot(stack.root)
    del after[str(q.relative_to(stack.root))]
    assert after == before, "the check touched another file"
    assert cw["frames"]["authenticated"] == 12 and cw["frames"]["new"] == 12, cw["frames"]
    with connect(stack.rpc, stack.http, ns) as d:
        lk = d.lookup(4)
        assert lk.hit_chunks < lk.total_chunks
        for seq, digests in stored.items():
            lk2, got = d.lookup_and_retrieve(seq)
            assert lk2.hit_chunks == 4 and got == digests
    # a clean stop: the next launch skips the check
    stack.stop()
    again = stack.launch("--no-vllm")
    assert again["crash_window"]["unclean"] is False
    assert again["crash_window"]["reason"].startswith("clean stop")


def test_interrupted_prune_or_missing_file_is_an_ordinary_miss(stack: Stack) -> None:
    ns = stack.render()["namespace"]
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns) as d:
        digests = d.store(5)
    stack.stop()
    files = sorted(stack.chunk_files(ns))
    assert len(files) == 4
    files[2].unlink()  # as if a prune/eviction stopped half way
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns) as d:
        lk, got = d.lookup_and_retrieve(5)
        assert lk.total_chunks == 4 and lk.hit_chunks < 4  # prefix up to the hole
        assert got is None
        # the missing part is recomputed and stored again
        assert d.store(5) == digests
    stack.stop()  # drains the store queue
    assert sorted(stack.chunk_files(ns)) == files


def test_budget_exhausted_is_degraded_and_existing_chunks_still_serve(stack: Stack) -> None:
    ns = stack.render()["namespace"]
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns) as d:
        stored = {seq: d.store(seq) for seq in (1, 2, 3)}
    stack.stop()
    on_disk = sum(f.stat().st_size for f in stack.chunk_files(ns))
    # shrink the budget below what is on disk (as after a restart with files LMCache's own
    # counter does not see)
    stack.env["KVP_L2_BUDGET"] = str(on_disk // 2)
    r = stack.kvp("launch", stack.config, "--no-vllm")
    assert r.returncode == 0, r.stderr
    h = stack.kvp("health", stack.config, "--no-vllm", "--json")
    report = json.loads(h.stdout)
    assert h.returncode == 1 and report["status"] == "degraded", report
    assert any(c["name"] == "cache_root.budget" and c["status"] == "degraded"
               for c in report["checks"])
    with connect(stack.rpc, stack.http, ns) as d:
        for seq, digests in stored.items():
            lk, got = d.lookup_and_retrieve(seq)
            assert lk.hit_chunks == 4 and got == digests


def test_power_loss_torn_files_are_misses_and_verify_quarantines_them(stack: Stack) -> None:
    """LMCache publishes a chunk file by rename without fsync, so after a host crash a final
    file can be empty, cut short, or of full size with zeros where the data never reached the
    disk. With aesgcm each is a miss (recompute), never wrong bytes; verify finds them and
    --apply quarantines them, after which the chunks are stored afresh."""
    ns = stack.render()["namespace"]
    stack.launch("--no-vllm")
    digests: dict[int, list[str]] = {}
    files: dict[int, list[Path]] = {}
    with connect(stack.rpc, stack.http, ns) as d:
        for seq in (1, 2, 3, 4, 5):
            before = set(stack.chunk_files(ns))
            digests[seq] = d.store(seq)
            assert wait_until(lambda b=before: len(set(stack.chunk_files(ns)) - b) == 4, 30)
            files[seq] = sorted(set(stack.chunk_files(ns)) - before)
    stack.stop()

    def zero(path: Path, start: int) -> None:
        with open(path, "r+b") as f:
            f.seek(start)
            f.write(b"\0" * (path.stat().st_size - start))

    torn = {1: files[1][0], 2: files[2][1], 3: files[3][2], 4: files[4][3]}
    os.truncate(torn[1], 0)                                  # the rename landed, no data
    os.truncate(torn[2], torn[2].stat().st_size // 2)        # cut short
    zero(torn[3], 0)                                         # full size, all zeros
    zero(torn[4], torn[4].stat().st_size - 4096)             # the last block never written

    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns) as d:
        for seq in (1, 2, 3, 4):
            lk, got = d.lookup_and_retrieve(seq)
            assert got is None and lk.hit_chunks < 4, (seq, lk)  # a miss, never wrong bytes
        lk, got = d.lookup_and_retrieve(5)
        assert lk.hit_chunks == 4 and got == digests[5]
    stack.stop()

    found = json.loads(stack.kvp("verify", stack.config, "--json").stdout)
    assert sorted(Path(f["path"]).name for f in found["findings"]) == sorted(
        p.name for p in torn.values()), found
    applied = stack.kvp("verify", stack.config, "--apply", "--json")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert len(json.loads(applied.stdout)["quarantined"]) == 4
    assert not any(p.exists() for p in torn.values())

    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns) as d:
        for seq in (1, 2, 3, 4):
            assert d.store(seq) == digests[seq]  # recomputed and stored afresh
    stack.stop()
    assert all(p.exists() for p in torn.values())
    clean = stack.kvp("verify", stack.config, "--json")
    assert clean.returncode == 0 and json.loads(clean.stdout)["findings"] == []
