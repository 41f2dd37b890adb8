"""A full filesystem and a read-only one, for real (the fault model's "disk full" and
"read-only filesystem" rows).

The cache root of a relocated cpu-demo deployment lies on a loop-mounted ext4 or XFS image of
512 MiB (tests/integration/_loopfs.py); its real ``lmcache server`` (O_DIRECT, the default)
is launched with ``kvp-admin launch --no-vllm`` and driven through LMCache's own client under
the deployment's namespace (kvpersist.demo.kvdriver): KV bytes are compared by the digest of
every chunk, as stored and as retrieved (no vLLM here: too slow for this lane). A real
node_exporter and Prometheus (one pair for the module) evaluate monitoring/kvpersist-rules.yml
on what ``kvp-admin metrics --textfile`` writes.

One server process per filesystem serves through every phase:

1. chunks of three sequences are stored: 12 files on disk;
2. another file takes every free block: the L2 writes of new chunks fail (the server log
   says how: ext4 ``POSIX transfer failed``, XFS ``No space left on device``), no file
   appears, nothing is torn or left as a temp file (``verify`` clean), new chunks are served
   from L1 and, with L1 cleared, the chunks on disk from L2, with the digests stored;
   ``health`` is degraded naming the free space while the server's own checks stay ok,
   ``KvpersistFreeSpaceBelowReserve`` fires;
3. remounted read-only: writes fail with EROFS, the server serves on (L1, and L2 with L1
   cleared), ``health`` names read-only, ``launch --check`` refuses the root,
   ``kvpersist_filesystem_readonly`` is 1 and ``KvpersistCacheRootReadOnly`` fires; one
   more sequence is stored and stays in L1;
4. remounted read-write and the filler deleted: without a restart (same pid) a new sequence
   and a sequence recomputed after its miss are written, ``health`` is healthy again and
   both alerts resolve; the sequence still in L1 from phase 3 is not written (LMCache does
   not retry a failed write, and a store of a resident chunk is a no-op): with L1 cleared,
   every chunk written hits from disk with its digests and the three sequences whose
   writes failed miss;
5. a clean stop leaves no temp file, and every file on disk (20) authenticates.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from kvpersist.demo.kvdriver import KVDriver, connect

from ..cli import kvp
from ..fullstack._stack import Stack, l2_hits_in_text, wait_until
from ._loopfs import LoopFs, loop_filesystem
from ._prometheus import Monitoring, monitoring, short_for_rules

pytestmark = pytest.mark.integration

FILESYSTEMS = ("ext4", "xfs")
CHUNKS = 4  # per sequence: 1,024 + 1 tokens in 256-token chunks
FAILED = "Dynamic NIXL store failed"
#: how each filesystem's ENOSPC reaches the server log: XFS refuses the temp file itself,
#: ext4 creates it and the write fails inside NIXL's POSIX backend, which keeps no errno
ENOSPC_IN_LOG = {"ext4": ("POSIX transfer failed", "nixlBackendError('NIXL_ERR_BACKEND')"),
                 "xfs": ("OSError(28, 'No space left on device')",)}
EROFS_IN_LOG = "OSError(30, 'Read-only file system')"


@pytest.fixture(scope="module")
def mon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitoring]:
    """node_exporter (textfile) and Prometheus for the module; every ``for:`` cut to 0 s (the
    rules' ``for:`` are tested by promtool, monitoring/tests/)."""
    work = tmp_path_factory.mktemp("mon")
    with monitoring(work, rules=short_for_rules(work / "rules.yml", for_="0s")) as m:
        yield m


@pytest.fixture(params=FILESYSTEMS)
def on_loop_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[LoopFs, Stack]]:
    """The filesystem and the deployment whose cache root is on it; the state dir (logs, pid
    files, key) stays off it. Everything the deployment started is stopped before the
    filesystem is unmounted, also on failure."""
    with loop_filesystem(request.param, tmp_path / "fs") as fs:
        stack = Stack(tmp_path, root=fs.mountpoint / "kv", KVP_STATE_DIR=str(tmp_path / "state"),
                      KVP_L2_BUDGET="320M", KVP_L2_RESERVE="32M")
        stack.env["KVP_CACHE_ROOT"] = str(stack.root)
        try:
            yield fs, stack
        finally:
            stack.cleanup()


class Server:
    """The server's log since a mark, and the L1 clear (``POST /cache/clear``: L1 only)."""

    def __init__(self, stack: Stack) -> None:
        self.stack, self.mark = stack, 0

    def since(self) -> str:
        return self.stack.server_log.read_text(errors="replace")[self.mark:]

    def set_mark(self) -> None:
        self.mark = self.stack.server_log.stat().st_size

    def failures(self) -> list[str]:
        return [line for line in self.since().splitlines() if FAILED in line]

    def clear_l1(self) -> None:
        r = requests.post(f"{self.stack.http}/cache/clear", timeout=10)
        assert r.status_code == 200, r.text


def _files(stack: Stack, ns: str) -> set[str]:
    return {p.name for p in stack.chunk_files(ns + "_")}


def _temps(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp." in p.name]


def _health(stack: Stack) -> tuple[int, dict[str, dict[str, str]]]:
    r = stack.kvp("health", stack.config, "--no-vllm", "--json")
    doc = json.loads(r.stdout)
    return r.returncode, {c["name"]: c for c in doc["checks"]}


def _server_healthy(checks: dict[str, dict[str, str]]) -> None:
    """The server answers /healthcheck and reports its L2 adapter healthy in /status: a
    write that fails leaves no failed state behind."""
    for name in ("lmcache.healthcheck", "lmcache.l2_adapter"):
        assert checks[name]["status"] == "ok", checks[name]


def _metrics(stack: Stack, mon: Monitoring) -> None:
    r = stack.kvp("metrics", stack.config, "--no-vllm", "--textfile", str(mon.textfile_dir))
    assert r.returncode == 0, r.stderr


def _alert_for(mon: Monitoring, alert: str, root: str) -> bool:
    return any(a.get("root") == root for a in mon.firing(alert))


def _serves(d: KVDriver, digests: dict[int, list[str]], seqs: tuple[int, ...]) -> int:
    """Every sequence of ``seqs`` hits in full and retrieves its stored bytes; the chunks
    compared."""
    for seq in seqs:
        lk, got = d.lookup_and_retrieve(seq)
        assert lk.hit_chunks == CHUNKS and got == digests[seq], (seq, lk)
    return CHUNKS * len(seqs)


def _misses(d: KVDriver, seqs: tuple[int, ...]) -> None:
    for seq in seqs:
        assert d.lookup(seq).hit_chunks == 0, seq


def test_full_then_read_only_then_space_back(on_loop_fs: tuple[LoopFs, Stack],
                                             mon: Monitoring) -> None:
    fs, stack = on_loop_fs
    t0 = time.monotonic()
    for old in mon.textfile_dir.iterdir():  # the other filesystem's series go stale
        old.unlink()
    info: Any = stack.launch("--no-vllm")
    ns, pid = info["namespace"], info["lmcache"]["pid"]
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    adapter = json.loads(argv[argv.index("--l2-adapter") + 1])
    assert adapter["backend_params"]["use_direct_io"] == "true"  # O_DIRECT, the default
    root = os.path.realpath(stack.root)
    srv = Server(stack)
    digests: dict[int, list[str]] = {}
    compared = 0

    # 1. three sequences on disk
    with connect(stack.rpc, stack.http, ns) as d:
        for seq in (1, 2, 3):
            digests[seq] = d.store(seq)
    assert wait_until(lambda: len(_files(stack, ns)) == 12 and not _temps(stack.root), 30)
    before = _files(stack, ns)

    # 2. another file takes every free block while the server serves
    assert fs.fill() > 256 << 20 and fs.avail_bytes < 1 << 20
    _metrics(stack, mon)  # first: Prometheus scrapes and evaluates while the server is driven
    srv.set_mark()
    with connect(stack.rpc, stack.http, ns) as d:
        for seq in (4, 5):
            digests[seq] = d.store(seq)  # into L1; the writes to disk fail
        assert wait_until(lambda: len(srv.failures()) == 2 * CHUNKS, 30), srv.since()[-3000:]
        for needle in ENOSPC_IN_LOG[fs.fstype]:
            assert needle in srv.since(), (needle, srv.since()[-3000:])
        assert _files(stack, ns) == before and not _temps(stack.root)
        compared += _serves(d, digests, (4, 5))      # from L1
        srv.clear_l1()
        srv.set_mark()
        compared += _serves(d, digests, (1, 2, 3))   # from the full disk
        assert l2_hits_in_text(srv.since()) == [CHUNKS] * 3, srv.since()[-2000:]
        _misses(d, (4, 5))  # never persisted, no longer in L1
    v = stack.kvp("verify", stack.config, "--json")  # nothing torn
    doc = json.loads(v.stdout)
    assert v.returncode == 0 and doc["authenticated"] == doc["files"] == 12, v.stdout
    code, checks = _health(stack)
    assert code == 1, checks
    free = checks["cache_root.free_space"]
    assert free["status"] == "degraded" and "ENOSPC" in free["detail"], free
    assert checks["cache_root.read_only"]["status"] == "ok"
    _server_healthy(checks)
    avail, reserve = (f'kvpersist_{n}_bytes{{root="{root}"}}'
                      for n in ("filesystem_avail", "l2_reserve"))
    assert mon.wait_value(avail, lambda v: v < 1 << 20) < mon.values(reserve)[0] == 32 << 20
    mon.wait_for(f'kvpersist_component_health{{component="cache_root",namespace="{ns}"}}',
                 lambda r: [float(s["value"][1]) for s in r] == [1])
    assert wait_until(lambda: _alert_for(mon, "KvpersistFreeSpaceBelowReserve", root), 30)

    # 3. remounted read-only while the server serves
    fs.remount(read_only=True)
    _metrics(stack, mon)
    srv.set_mark()
    ro_mark = srv.mark
    with connect(stack.rpc, stack.http, ns) as d:
        digests[6] = d.store(6)
        assert wait_until(lambda: len(srv.failures()) == CHUNKS, 30), srv.since()[-3000:]
        compared += _serves(d, digests, (6,))
        srv.clear_l1()
        srv.set_mark()
        compared += _serves(d, digests, (1, 2, 3))   # from the read-only disk
        assert l2_hits_in_text(srv.since()) == [CHUNKS] * 3, srv.since()[-2000:]
        _misses(d, (6,))
        digests[8] = d.store(8)  # stays in L1 across the remount below
        srv.mark = ro_mark  # every failure since the remount
        assert wait_until(lambda: len(srv.failures()) == 2 * CHUNKS, 30), srv.since()[-3000:]
        assert all(EROFS_IN_LOG in line for line in srv.failures()), srv.failures()
    assert _files(stack, ns) == before and not _temps(stack.root)
    code, checks = _health(stack)
    ro = checks["cache_root.read_only"]
    assert code == 1 and ro["status"] == "degraded" and "read-only" in ro["detail"], checks
    _server_healthy(checks)
    refused = stack.kvp("launch", stack.config, "--no-vllm", "--check")
    assert refused.returncode == 2 and "mounted read-only" in refused.stderr, refused.stderr
    mon.wait_value(f'kvpersist_filesystem_readonly{{root="{root}"}}', lambda v: v == 1)
    assert wait_until(lambda: _alert_for(mon, "KvpersistCacheRootReadOnly", root), 30)

    # 4. space comes back: writes resume in the same server process
    fs.remount(read_only=False)
    fs.unfill()
    _metrics(stack, mon)
    code, checks = _health(stack)
    assert code == 0, checks
    # the same root read-only only in a sandbox's view (what systemd's ProtectSystem=strict
    # does to the health unit: a read-only bind mount in its own mount namespace): the
    # filesystem is read-write, so no read-only alarm and no permission complaint
    r = kvp("health", stack.config, "--no-vllm", "--json", env=stack.env, wrapper=[
        "unshare", "--mount", "--propagation", "private", "sh", "-c",
        'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"',
        str(stack.root)])
    doc = json.loads(r.stdout)
    seen = {c["name"]: c for c in doc["checks"]}
    assert r.returncode == 0 and doc["cache_root"]["read_only_here"], (r.stderr, seen)
    assert "sandbox" in seen["cache_root.read_only"]["detail"], seen["cache_root.read_only"]
    assert seen["cache_root.permissions"]["status"] == "ok", seen["cache_root.permissions"]
    srv.set_mark()
    with connect(stack.rpc, stack.http, ns) as d:
        assert d.store(8) == digests[8]          # resident in L1 since its write failed
        digests[7] = d.store(7)                  # a new sequence
        assert d.store(4) == digests[4]          # recomputed after its miss, stored again
        assert wait_until(lambda: len(_files(stack, ns)) == 20 and not _temps(stack.root), 30)
        assert not srv.failures(), srv.failures()
        compared += _serves(d, digests, (4, 7, 8))   # 8 from L1: never written
        srv.clear_l1()
        srv.set_mark()
        compared += _serves(d, digests, (1, 2, 3, 4, 7))  # from disk, written or not
        assert l2_hits_in_text(srv.since()) == [CHUNKS] * 5, srv.since()[-2000:]
        _misses(d, (5, 6, 8))  # their writes failed; LMCache never wrote them later
    assert int(stack.pid_file.read_text()) == pid and psutil.pid_exists(pid)  # no restart
    mon.wait_value(f'kvpersist_filesystem_readonly{{root="{root}"}}', lambda v: v == 0)
    assert wait_until(lambda: not _alert_for(mon, "KvpersistCacheRootReadOnly", root)
                      and not _alert_for(mon, "KvpersistFreeSpaceBelowReserve", root), 30)

    # 5. a clean stop leaves no temp file, and every file authenticates
    stack.stop()
    assert not _temps(stack.root)
    v = stack.kvp("verify", stack.config, "--json")
    doc = json.loads(v.stdout)
    assert v.returncode == 0 and doc["authenticated"] == doc["files"] == 20, v.stdout
    assert compared == 68  # chunks whose retrieved bytes equal the stored ones
    assert time.monotonic() - t0 < 150
