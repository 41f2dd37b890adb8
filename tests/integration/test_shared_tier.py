"""The shared tier with real parts: Debian's redis-server (ACL user + password) and two stock
``lmcache server`` processes started by ``kvp-admin launch`` with different cache roots,
standing in for two hosts. LMCache's own MP client stack drives them (kvpersist.demo.kvdriver).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.demo.kvdriver import connect

from ..fullstack._stack import Stack
from ._redis import Redis, start_redis

pytestmark = pytest.mark.integration


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    r = start_redis(tmp_path / "store")
    try:
        yield r
    finally:
        r.stop()


def host(tmp: Path, name: str, redis: Redis) -> Stack:
    d = tmp / name
    d.mkdir(mode=0o700)
    secret = redis.write_secret(d / "shared.secret")
    return Stack(d, KVP_SHARED_TIER=redis.url, KVP_SHARED_TIER_SECRET_FILE=str(secret))


def share_key(a: Stack, b: Stack) -> None:
    src = a.state_dir / "keys" / "l2-master.key"
    dst = b.state_dir / "keys" / "l2-master.key"
    dst.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    b.state_dir.chmod(0o700)
    b.state_dir.parent.chmod(0o700)
    dst.write_bytes(src.read_bytes())
    dst.chmod(0o600)


def proc_as_nobody() -> bytes:
    """Every /proc/*/cmdline and /proc/*/environ that user 65534 can read, concatenated."""
    script = ("for f in /proc/[0-9]*/cmdline /proc/[0-9]*/environ; do cat \"$f\"; "
              "printf '\\n'; done 2>/dev/null; true")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        "sh", "-c", script], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_chunks_stored_on_host_a_hit_on_host_b(tmp_path: Path, redis: Redis) -> None:
    a, b = host(tmp_path, "a", redis), host(tmp_path, "b", redis)
    try:
        ns = a.render()["namespace"]
        assert b.render()["namespace"] == ns  # the same identity on both hosts
        a.launch("--no-vllm")
        with connect(a.rpc, a.http, ns) as d:
            stored = {seq: d.store(seq) for seq in (1, 2)}
        a.stop()
        # the fleet shares one serde key (the role distributes it): B decrypts A's chunks
        share_key(a, b)
        keys = redis.keys(f"{ns}@*")
        assert len(keys) == 8 and len(a.chunk_files(ns + "_")) == 8  # both tiers
        assert redis.keys() == keys  # nothing outside the namespace's pattern

        b.launch("--no-vllm")
        assert b.chunk_files() == []  # host B's NVMe starts empty
        # the secret is nowhere another user can read while both kinds of process run
        seen = proc_as_nobody()
        assert redis.password.encode() not in seen
        assert b"kvpersist.stack.lmcache_exec" in seen  # the launcher is what runs
        with connect(b.rpc, b.http, ns) as d:
            for seq, digests in stored.items():
                lk, got = d.lookup_and_retrieve(seq)
                assert (lk.hit_chunks, lk.total_chunks) == (4, 4)
                assert got == digests  # the same bytes, through the aesgcm serde
        with connect(b.rpc, b.http, "kvp-" + "0" * 32) as other:
            assert other.lookup(1).hit_chunks == 0  # another identity gets nothing
        for text in (b.server_log.read_text(errors="replace"),
                     a.server_log.read_text(errors="replace"),
                     json.dumps(b.render())):
            assert redis.password not in text
        b.stop()
    finally:
        a.cleanup()
        b.cleanup()

