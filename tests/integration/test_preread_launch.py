"""The hot-files pre-read at launch, against a real ``lmcache server`` root: ``kvp-admin
launch`` starts it in the background and returns with the server healthy; the pre-read
advises exactly the namespace's chunk files the server wrote, never a symlink, a fifo, an
unparseable name or another namespace; the stored chunks still hit after it."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from kvpersist.demo.kvdriver import connect

from ..conftest import REPO
from ..fullstack._stack import Stack, wait_until

pytestmark = pytest.mark.integration


def preread_record(stack: Stack) -> dict[str, object] | None:
    log = stack.state_dir / "logs" / "preread.log"
    if not log.exists():
        return None
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def buffered_configs(tmp: Path) -> Path:
    """A config dir with cpu-demo and a generic config that reads L2 buffered (the pre-read
    only helps reads through the page cache; the default is O_DIRECT)."""
    cdir = tmp / "configs"
    shutil.copytree(REPO / "configs" / "cpu-demo", cdir / "cpu-demo")
    (cdir / "generic").mkdir()
    text = (REPO / "configs" / "generic" / "lmcache.yaml").read_text()
    assert "  use_direct_io: true" in text
    (cdir / "generic" / "lmcache.yaml").write_text(
        text.replace("  use_direct_io: true", "  use_direct_io: false"))
    return cdir


def test_preread_runs_at_launch_without_blocking(tmp_path: Path) -> None:
    stack = Stack(tmp_path, KVP_PREREAD_RAM_SHARE="0.5",
                  KVP_CONFIG_DIR=str(buffered_configs(tmp_path)))
    try:
        ns = stack.render()["namespace"]
        assert stack.render()["read_path"]["preread"] == "on"
        first = stack.launch("--no-vllm")
        assert any("pre-read started in the background" in n for n in first["notes"])
        with connect(stack.rpc, stack.http, ns) as d:
            stored = {seq: d.store(seq) for seq in (1, 2)}
        stack.stop()
        real = stack.chunk_files(ns + "_")
        assert len(real) == 8

        # what the pre-read must leave alone, beside the real chunk files
        outside = tmp_path / "outside.bin"
        outside.write_bytes(b"secret" * 1000)
        (stack.root / f"{ns}_01000100_0_{'ab' * 16}.bin").symlink_to(outside)
        os.mkfifo(stack.root / f"{ns}_01000100_0_{'cd' * 16}.bin")
        (stack.root / f"{ns}_not-a-chunk.bin").write_bytes(b"x" * 100)
        (stack.root / f"kvp-{'0' * 32}_01000100_0_{'ef' * 16}.bin").write_bytes(b"o" * 100)
        log = stack.state_dir / "logs" / "preread.log"
        log.unlink()

        info = stack.launch("--no-vllm")  # returns once the server is healthy
        note = next(n for n in info["notes"] if "pre-read" in n)
        m = re.search(r"pid (\d+)", note)
        assert m, note
        assert stack.kvp_json("status", stack.config)["lmcache"]["healthy"]

        assert wait_until(lambda: preread_record(stack) is not None, 120)
        rec = preread_record(stack)
        assert rec is not None
        assert rec["schema"] == "kvpersist.preread/1" and rec["errors"] == []
        assert rec["candidates"] == rec["advised_files"] == len(real)
        assert rec["advised_bytes"] == sum(p.stat().st_size for p in real)
        assert rec["share"] == 0.5 and rec["cap_bytes"] == int(0.5 * int(rec["mem_available"]))

        # the pre-read changed nothing the server relies on: every chunk still hits
        with connect(stack.rpc, stack.http, ns) as d:
            for seq, want in stored.items():
                lk, got = d.lookup_and_retrieve(seq)
                assert lk.hit_chunks == lk.total_chunks == 4 and got == want
        assert outside.read_bytes() == b"secret" * 1000
    finally:
        stack.cleanup()


def test_preread_off_by_default_and_with_direct_io(tmp_path: Path) -> None:
    stack = Stack(tmp_path)  # the defaults: share 0, O_DIRECT reads
    try:
        assert stack.render()["read_path"]["use_direct_io"] is True
        info = stack.launch("--no-vllm")
        assert any("pre-read off (KVP_PREREAD_RAM_SHARE is 0)" in n for n in info["notes"])
        stack.stop()
        stack.env["KVP_PREREAD_RAM_SHARE"] = "0.5"
        info = stack.launch("--no-vllm")
        assert any("pre-read off (l2.use_direct_io reads bypass the page cache)" in n
                   for n in info["notes"])
        assert not (stack.state_dir / "logs" / "preread.log").exists()
    finally:
        stack.cleanup()
