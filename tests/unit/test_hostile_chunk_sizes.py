"""Issue 40: a chunk file is read with the bound its format allows, and streamed.

After a kill -9, a 50 GB sparse file named like a chunk of the namespace made the crash-window
check (``launch``) and ``scrub`` read it whole (``MemoryError``; a 1 GiB one cost 1.08 GB of
RSS) and no other file was scrubbed. Now a chunk file larger than what LMCache can write for
the namespace's geometry (:func:`kvpersist.l2.frames.max_chunk_file_bytes`) is never read:
``verify`` calls it a ``size`` finding and quarantines it with ``--apply`` (a rename), the
crash-window check does the same, ``scrub`` names it and scrubs every other file; a file
under the bound is authenticated in blocks (memory a block's, not the file's). The commands
run as a user runs them (``kvp-admin`` under tests/hostile.py: 512 MiB of address space), the
crash-window check through the function ``launch`` calls."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.config.loader import load_deployment
from kvpersist.l2 import frames
from kvpersist.l2.layout import ChunkName
from kvpersist.stack import crash_window
from kvpersist.stack.locate import locate
from kvpersist.stack.stops import CrashWindow

from ..conftest import clean_env, free_port
from ..hostile import HostileRunner, assert_all_bounded

NS = "kvp-8a8877c212dbb9f802c2eb354e22b53a"  # configs/cpu-demo
MASTER = bytes(range(32))
PLAIN = 5120
GB = 1 << 30
#: cpu-demo's geometry (2 KV heads of 64, bfloat16, TP 1, chunks of 256 tokens)
LIMIT = frames.max_chunk_file_bytes({"num_kv_heads": 2, "head_dim": 64,
                                     "tensor_parallel_size": 1, "kv_cache_dtype": "bfloat16"},
                                    256)


def chunk(i: int) -> ChunkName:
    return ChunkName(NS, 0x01000100, 0, f"{i:04x}" + "ab" * 14)


def frame(plain_len: int = PLAIN, dirty: bool = True) -> bytes:
    """An aesgcm frame of cpu-demo's namespace under MASTER, padded to 4 KiB pages with
    stale bytes (dirty) or zeros."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    iv = os.urandom(12)
    body = bytes([1]) + iv + AESGCM(frames.derive_key(MASTER)).encrypt(
        iv, bytes(plain_len), None)
    size = -(-len(body) // 4096) * 4096
    return body + (os.urandom(size - len(body)) if dirty else bytes(size - len(body)))


def sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.fixture(scope="module")
def runner() -> Iterator[HostileRunner]:
    with HostileRunner() as h:
        yield h


@pytest.fixture
def demo(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """cpu-demo on a temp cache root with the key MASTER (KVP_SERDE_KEY_FILE, 0600)."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    key = tmp_path / "keys" / "l2-master.key"
    key.parent.mkdir(mode=0o700)
    key.write_bytes(MASTER)
    key.chmod(0o600)
    env = clean_env()
    env.update({"KVP_CACHE_ROOT": str(root), "KVP_SERDE_KEY_FILE": str(key),
                "KVP_LMCACHE_PORT": str(free_port()), "KVP_LMCACHE_HTTP_PORT": str(free_port()),
                "KVP_VLLM_PORT": str(free_port())})
    return root, env


def test_the_bound_is_the_geometrys() -> None:
    """cpu-demo: 256 tokens x 1,024 layers x K and V x 2 heads x 64 x 2 bytes, plus the
    frame, in whole pages; the measured case (4,194,304 bytes of KV in a 4,198,400-byte
    file) fits the same formula; an unknown geometry gets the global cap."""
    assert LIMIT == 256 * 1024 * 2 * 2 * 64 * 2 + 4096
    assert load_deployment("cpu-demo").identity is not None
    assert frames.max_chunk_file_bytes({}, 256) == frames.MAX_CHUNK_FILE_BYTES
    assert frames.max_chunk_file_bytes({"num_kv_heads": 8, "head_dim": 128,
                                        "tensor_parallel_size": 2,
                                        "kv_cache_dtype": "fp8_e4m3"}, 256) == \
        256 * 1024 * 2 * 4 * 128 + 4096
    # (4 MiB + the frame's 29 bytes) in whole 4 KiB pages
    assert -(-(4_194_304 + frames.FRAME_OVERHEAD) // 4096) * 4096 == 4_198_400


def test_scrub_and_verify_pass_a_50_gb_sparse_chunk(demo: tuple[Path, dict[str, str]],
                                                   runner: HostileRunner) -> None:
    root, env = demo
    huge = sparse(root / chunk(0).filename(), 50 * GB)
    gib = sparse(root / chunk(1).filename(), GB)
    dirty = root / chunk(2).filename()
    dirty.write_bytes(frame())
    big = root / chunk(3).filename()  # under the bound, larger than one block: streamed
    big.write_bytes(frame(40 << 20))
    scrubbed = runner.run("scrub", "cpu-demo", "--apply", "--json", env=env)
    assert_all_bounded([scrubbed], allowed=(0,))
    doc = json.loads(scrubbed.stdout)
    # before: MemoryError within 0.2 s, and no other file scrubbed
    assert (doc["files"], doc["scrubbed"], doc["dirty"]) == (2, 2, 2), doc
    skipped = " ".join(doc["skipped"])
    assert huge.name in skipped and gib.name in skipped and f"{LIMIT:,}" in skipped
    assert doc["bytes_read"] < 3 * (40 << 20), doc
    assert huge.stat().st_size == 50 * GB and huge.stat().st_blocks == 0  # never written
    assert not any(dirty.read_bytes()[frames.frame_end(PLAIN):])
    checked = runner.run("verify", "cpu-demo", "--json", env=env)
    assert_all_bounded([checked], allowed=(1,))
    doc = json.loads(checked.stdout)
    sized = {Path(f["path"]).name: f for f in doc["findings"]}
    assert set(sized) == {huge.name, gib.name}, doc["findings"]
    assert all(f["kind"] == "size" and "more than the" in f["detail"] for f in sized.values())
    assert doc["authenticated"] == 2 and doc["bytes_read"] < 3 * (40 << 20), doc
    # peak memory: far below the 40 MiB file read whole, let alone 1 or 50 GB
    assert max(scrubbed.maxrss_kb, checked.maxrss_kb) < 400_000, (scrubbed.maxrss_kb,
                                                                   checked.maxrss_kb)
    applied = runner.run("verify", "cpu-demo", "--apply", "--no-scrub", "--json", env=env)
    assert_all_bounded([applied], allowed=(0,))
    assert len(json.loads(applied.stdout)["quarantined"]) == 2
    assert not huge.exists() and not gib.exists() and dirty.exists() and big.exists()


def test_the_crash_window_check_passes_a_50_gb_sparse_chunk(
        demo: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Through :func:`kvpersist.stack.crash_window.check`, what ``launch`` calls after an
    unclean stop: the huge file is a finding, quarantined by a rename, never read; the
    other files of the window are authenticated and scrubbed."""
    root, env = demo
    for k, v in env.items():
        if k.startswith("KVP_"):
            monkeypatch.setenv(k, v)
    loc = locate(load_deployment("cpu-demo"))
    assert loc.chunk_max_bytes == LIMIT
    huge = sparse(root / chunk(0).filename(), 50 * GB)
    good = root / chunk(1).filename()
    good.write_bytes(frame())
    res = crash_window.check(loc, CrashWindow(True, 0, "the server was killed"))
    assert res.ran and res.complete and res.failed == 1 and res.authenticated == 1, res
    assert res.findings[0]["kind"] == "size" and res.bytes_read < 1 << 20, res
    assert len(res.quarantined) == 1 and not huge.exists() and good.exists()
    assert res.scrubbed == 1


def test_a_time_bound_stops_in_the_middle_of_a_file(tmp_path: Path) -> None:
    """A file under the bound but slow to authenticate: the crash window's time bound stops
    the read between blocks and counts it unchecked (it is never condemned half-read)."""
    from kvpersist.l2.tree import open_root
    from kvpersist.l2.verify.root import verify_root

    root = tmp_path / "cache"
    root.mkdir()
    (root / chunk(0).filename()).write_bytes(b"\x01" + os.urandom((64 << 20) - 1))  # garbage
    with open_root(root) as r:
        res = verify_root(r, NS, key=MASTER, rate_mb_s=50, since_ns=0, deadline_s=0.3,
                          max_bytes_for=lambda _p: LIMIT)
    assert res.unchecked == 1 and res.findings == [] and res.seconds < 5, res


def test_scrub_never_writes_a_file_with_a_second_hard_link(tmp_path: Path) -> None:
    """Decided (issue 40): LMCache never links its files, so a chunk name that shares its
    inode with a name outside the root is someone else's file: scrub names it and writes
    nothing (before, the zeros landed in the other name too)."""
    from kvpersist.l2.scrub import scrub_root
    from kvpersist.l2.tree import open_root

    root = tmp_path / "cache"
    root.mkdir()
    outside = tmp_path / "precious.bin"
    outside.write_bytes(frame())
    before = outside.read_bytes()
    os.link(outside, root / chunk(0).filename())
    (root / chunk(1).filename()).write_bytes(frame())
    with open_root(root) as r:
        res = scrub_root(r, NS, MASTER, apply=True)
    assert outside.read_bytes() == before
    assert res.scrubbed == 1 and any("hard links" in s for s in res.skipped), res
