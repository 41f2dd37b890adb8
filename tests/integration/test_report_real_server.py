"""The inventory reads files written by a real, stock ``lmcache server`` (no hand-made names)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvpersist.l2.layout import Kind, classify
from tests.cli import kvp

from ._lmcache_server import start_lmcache_server

pytestmark = pytest.mark.integration


def bin_files(root: Path) -> list[Path]:
    return [Path(d) / n for d, _, names in os.walk(root) for n in names if n.endswith(".bin")]


@pytest.mark.parametrize("shard_dirs", [False, True], ids=["flat", "shard_dirs"])
def test_report_and_prune_on_real_lmcache_files(tmp_path: Path, shard_dirs: bool) -> None:
    root = tmp_path / "cache"
    srv = start_lmcache_server(root, l1_size_gb=1, max_capacity_gb="2", shard_dirs=shard_dirs)
    try:
        srv.bench(start=0, end=4)
        status: Any = srv.status()
        stored = status["storage_manager"]["l2_adapters"][0]["stored_object_count"]
    finally:
        srv.stop()
    files = bin_files(root)
    # 4 requests x 1024 tokens / chunk 256 = 16 chunks, one file each
    assert len(files) == 16 == stored
    for f in files:
        shard = tuple(f.parent.relative_to(root).parts) if shard_dirs else None
        assert classify(f.name, shard)[0] is Kind.CHUNK, f  # type: ignore[arg-type]

    r = kvp("report", "--root", str(root), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    [ns] = doc["namespaces"]
    assert ns["prefix"] == "test-model" and ns["namespace"] is None
    assert ns["status"] == "other" and ns["active"] is False
    assert ns["files"] == 16
    assert ns["bytes"] == sum(f.stat().st_size for f in files) == 16 * 4 * 1024**2
    assert ns["tp_sizes"] == [1] and ns["ranks"][0]["kv_rank"] == "01000100"
    assert ns["sharded_files"] == (16 if shard_dirs else 0)
    assert doc["foreign"]["files"] == 0 and doc["temp"]["files"] == 0
    du = subprocess.run(["du", "-s", "--apparent-size", "-b", str(root)], check=True,
                        capture_output=True, text=True).stdout.split()[0]
    assert doc["total_bytes"] == int(du)

    # prune the prefix by name: dry run first, then apply, then nothing is left
    dry = json.loads(kvp("prune", "--root", str(root), "--namespace", "test-model",
                         "--json").stdout)
    assert dry["deleted"] == {"files": 16, "bytes": 16 * 4 * 1024**2}
    assert len(bin_files(root)) == 16
    app = kvp("prune", "--root", str(root), "--namespace", "test-model", "--apply", "--json")
    assert app.returncode == 0, app.stderr
    assert json.loads(app.stdout)["deleted"]["files"] == 16
    assert bin_files(root) == []


def test_server_recomputes_after_its_files_are_pruned(tmp_path: Path) -> None:
    """A pruned chunk is an ordinary miss: a restarted server stores it again."""
    root = tmp_path / "cache"
    srv = start_lmcache_server(root)
    try:
        srv.bench(start=0, end=2)
    finally:
        srv.stop()
    assert len(bin_files(root)) == 8
    assert kvp("prune", "--root", str(root), "--namespace", "test-model",
               "--apply").returncode == 0
    srv = start_lmcache_server(root)
    try:
        srv.bench(start=0, end=2)  # raises if the bench's checks fail
    finally:
        srv.stop()
    assert len(bin_files(root)) == 8
