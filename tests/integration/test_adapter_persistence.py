"""Persistence at the adapter level: LMCache's own MP client stack on CPU tensors, under the
deployment's namespace, against a real server started by ``kvp-admin launch``."""

from __future__ import annotations

import pytest

from kvpersist.demo.kvdriver import connect

from ..fullstack._stack import Stack

pytestmark = pytest.mark.integration

#: tiny demo geometry: 4 layers x 2 (K,V) x 256 tokens x 2 heads x 64 dims x 2 bytes
PLAIN_CHUNK = 4 * 2 * 256 * 2 * 64 * 2
AESGCM_FRAME = 1 + 12 + 16


def test_store_restart_hit_tp_and_prune(stack: Stack) -> None:
    ns = stack.render()["namespace"]
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns, tp_size=1) as d:
        stored = {seq: d.store(seq) for seq in (1, 2, 3)}
        assert all(len(v) == 4 for v in stored.values())
    with connect(stack.rpc, stack.http, ns, tp_size=2) as d2:
        stored_tp = d2.store(7)
        assert len(stored_tp) == 8  # 4 chunks x 2 ranks
    stack.stop()  # the server flushes its store queue on SIGTERM

    files = stack.chunk_files(ns + "_")
    tp1 = [f for f in files if "_01000100_" in f.name]
    tp2 = [f for f in files if f.name.split("_")[1] in ("02000200", "02010201")]
    assert len(tp1) == 12 and len(tp2) == 8, [f.name for f in files]
    # one file per rank per chunk: the same chunk hashes under both TP ranks
    hashes = {r: {f.name.rsplit("_", 1)[1] for f in tp2 if f"_{r}_" in f.name}
              for r in ("02000200", "02010201")}
    assert hashes["02000200"] == hashes["02010201"] and len(hashes["02000200"]) == 4
    # aesgcm frames, owner-only files
    for f in files:
        frame = PLAIN_CHUNK + AESGCM_FRAME  # simulated ranks each hold the full spec
        assert f.stat().st_size == -(-frame // 4096) * 4096  # padded to 4 KiB
        assert f.stat().st_mode & 0o077 == 0, f"{f} readable by others"

    report = stack.kvp_json("report", "--root", str(stack.root), "--config", stack.config)
    mine = [n for n in report["namespaces"] if n["namespace"] == ns]
    assert mine and mine[0]["files"] == 20 and mine[0]["active"]

    # restart: every chunk hits from disk, and the retrieved bytes equal the stored ones
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns, tp_size=1) as d:
        for seq, digests in stored.items():
            lk, got = d.lookup_and_retrieve(seq)
            assert (lk.hit_chunks, lk.total_chunks) == (4, 4)
            assert got == digests
        assert d.lookup(99).hit_chunks == 0  # never stored
    with connect(stack.rpc, stack.http, ns, tp_size=2) as d2:
        lk, got = d2.lookup_and_retrieve(7)
        assert lk.hit_chunks == 4 and got == stored_tp
    assert "L2" in stack.server_log.read_text()

    # another namespace on the same server sees nothing of ours
    with connect(stack.rpc, stack.http, "kvp-" + "0" * 32) as other:
        assert other.lookup(1).hit_chunks == 0
    stack.stop()

    # prune --apply of the namespace: its files go, lookups miss after the next launch
    dry = stack.kvp_json("prune", "--root", str(stack.root), "--config", stack.config,
                         "--namespace", ns, "--force")
    assert len(stack.chunk_files(ns)) == 20, dry
    r = stack.kvp("prune", "--root", str(stack.root), "--config", stack.config,
                  "--namespace", ns, "--force", "--apply")
    assert r.returncode == 0, r.stderr
    assert stack.chunk_files(ns) == []
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns) as d:
        assert d.lookup(1).hit_chunks == 0
