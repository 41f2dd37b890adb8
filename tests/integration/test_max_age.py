"""Maximum age against a real ``lmcache server`` started by ``kvp-admin launch``.

Chunks are stored by LMCache's own MP client stack on CPU tensors (``kvpersist.demo.kvdriver``:
what vLLM's workers send, under the deployment's namespace); half of them are then aged with
``os.utime`` (their mtime, the time LMCache published them, moved 40 days back). ``report``,
``metrics`` and ``prune --older-than`` / ``--max-age`` see exactly those; after ``--apply``
and a restart, the server misses on them and still hits on the young ones, with the bytes it
stored. Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpersist.demo.kvdriver import connect

from ..fullstack._stack import Stack, wait_until

pytestmark = pytest.mark.integration

DAY = 86400


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("maxage"), model=demo_model, KVP_L2_MAX_AGE="30d")
    try:
        yield s
    finally:
        s.cleanup()


def names(stack: Stack, ns: str) -> set[str]:
    return {p.name for p in stack.chunk_files(ns + "_")}


def store(stack: Stack, ns: str, d: Any, seqs: range, before: set[str]) -> tuple[
        set[str], dict[int, list[str]]]:
    """Store ``seqs`` (4 chunks each); wait until their files are published; return the new
    file names and each sequence's per-chunk digests."""
    digests = {seq: d.store(seq) for seq in seqs}
    want = len(before) + 4 * len(seqs)
    assert wait_until(lambda: len(names(stack, ns)) >= want, 120), names(stack, ns)
    return names(stack, ns) - before, digests


def test_older_than_selects_the_old_chunks_and_the_server_misses_only_on_them(
        stack: Stack) -> None:
    ns = stack.render()["namespace"]
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns) as d:
        old, _ = store(stack, ns, d, range(0, 2), set())
        young, digests = store(stack, ns, d, range(2, 4), old)
    stack.stop()  # the server flushes what it queued
    assert len(old) == len(young) == 8 and names(stack, ns) == old | young

    # age the first two sequences: written 40 days ago (LMCache never rewrites a key it
    # has indexed, so the mtime is the time it published the file)
    then = time.time() - 40 * DAY
    for n in old:
        os.utime(stack.root / n, (time.time(), then))

    rep = stack.kvp_json("report", "--config", stack.config)
    (row,) = [r for r in rep["namespaces"] if r["namespace"] == ns]
    assert rep["max_age_s"] == 30 * DAY
    assert row["past_max_age"]["files"] == 8 and rep["past_max_age"]["files"] == 8
    assert {b["label"]: b["files"] for b in row["ages"]} == {
        "1h": 8, "1d": 0, "7d": 0, "30d": 0, "90d": 8, "365d": 0, "older": 0}
    assert row["salt_usage"] == [{"salt": None, "files": 16, "bytes": row["bytes"]}]
    metrics = stack.kvp("metrics", stack.config).stdout
    m = re.search(r'^kvpersist_l2_past_max_age_files\{[^}]*namespace="' + ns + r'"[^}]*\} '
                  r'(\S+)$', metrics, re.M)
    assert m and float(m.group(1)) == 8.0, metrics
    assert re.search(r"^kvpersist_l2_max_age_seconds\{[^}]*\} 2\.592e\+06$", metrics, re.M)

    # the dry run lists exactly the old files, by either option; nothing goes
    dry = stack.kvp_json("prune", "--config", stack.config, "--older-than", "30d", "--list")
    assert set(dry["files"]) == old and dry["dry_run"]
    configured = stack.kvp_json("prune", "--config", stack.config, "--max-age", "--list")
    assert set(configured["files"]) == old
    assert names(stack, ns) == old | young

    applied = stack.kvp_json("prune", "--config", stack.config, "--older-than", "30d",
                             "--apply")
    assert applied["deleted"]["files"] == 8 and not applied["errors"]
    assert names(stack, ns) == young

    # a fresh server (empty L1 and index): the old sequences miss, the young ones hit whole
    # from disk with the bytes that were stored
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns) as d:
        for seq in (0, 1):
            assert d.lookup(seq).hit_chunks == 0
        for seq in (2, 3):
            lk, got = d.lookup_and_retrieve(seq)
            assert (lk.hit_chunks, lk.total_chunks) == (4, 4)
            assert got == digests[seq]
    after = stack.kvp_json("report", "--config", stack.config)
    assert after["past_max_age"] == {"files": 0, "bytes": 0}
    assert json.loads(stack.kvp("prune", "--config", stack.config, "--max-age",
                                "--json").stdout)["deleted"]["files"] == 0
