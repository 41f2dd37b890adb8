"""The shared tier end to end: real vLLM (CPU build) + real lmcache servers started by
``kvp-admin launch`` on two cache roots ("host A", "host B") sharing one redis-server with
an ACL user. Host B answers host A's long chat from the shared tier with identical output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpersist.demo.chat import chat_completion, long_chat

from ..integration._redis import Redis
from ..integration.test_shared_tier import host, proc_as_nobody, share_key
from ._stack import l2_hits_in_log, vllm_metric

pytestmark = pytest.mark.fullstack

CHAT = long_chat(turns=8, words_per_turn=150, seed=23)
HITS = "vllm:external_prefix_cache_hits_total"


def test_host_b_answers_host_a_chat_from_the_shared_tier(tmp_path: Path, redis: Redis,
                                                         demo_model: Path) -> None:
    a, b = host(tmp_path, "a", redis), host(tmp_path, "b", redis)
    for s in (a, b):
        s.env["KVP_MODEL_PATH"] = str(demo_model)
    try:
        ns = a.launch()["namespace"]
        cold = chat_completion(a.vllm_url, "cpu-demo", CHAT, max_tokens=24)
        assert cold.prompt_tokens and cold.prompt_tokens > 5 * 256 and cold.text
        a.stop()
        full_chunks = cold.prompt_tokens // 256
        assert len(redis.scan_keys(f"{ns}@*")) >= full_chunks

        share_key(a, b)
        b.launch()
        assert b.chunk_files() == []  # B's NVMe is fresh: every hit comes from the store
        warm = chat_completion(b.vllm_url, "cpu-demo", CHAT, max_tokens=24)
        assert warm.text == cold.text
        assert vllm_metric(b.vllm_url, HITS) >= full_chunks * 256
        assert max(l2_hits_in_log(b.server_log)) >= full_chunks
        assert redis.password.encode() not in proc_as_nobody()
        (tmp_path / "ttft.json").write_text(json.dumps(
            {"cold_a_s": cold.ttft_s, "fresh_b_from_shared_s": warm.ttft_s}))
        print(f"TTFT cold on A {cold.ttft_s:.3f} s, fresh B from the shared tier "
              f"{warm.ttft_s:.3f} s")

        # the store dies mid-run: B keeps serving the same answer; health says degraded
        redis.kill()
        again = chat_completion(b.vllm_url, "cpu-demo", CHAT, max_tokens=24)
        assert again.text == cold.text
        h = b.kvp("health", b.config, "--json")
        doc = json.loads(h.stdout)
        assert h.returncode == 1 and doc["status"] == "degraded", doc
        assert doc["components"]["shared_tier"] == "degraded"
        redis.restart()
        assert b.kvp("health", b.config, "--json").returncode == 0

        # prune exactly this namespace on the shared tier
        redis.nodes[0].cli("set", "kvp-" + "e" * 32 + "@01000100@0@ab", "x")
        done = b.kvp_json("prune", "--tier", "shared", "--config", b.config,
                          "--namespace", ns, "--apply", "--force")
        assert done["deleted_keys"] >= full_chunks
        assert redis.scan_keys(f"{ns}@*") == []
        # what is left: the other namespace's key, and the fleet record of B (still serving
        # the namespace: the reason the prune needed --force) with its index
        left = redis.scan_keys()
        assert [k for k in left if not k.startswith("kvpersist-fleet:")] == [
            "kvp-" + "e" * 32 + "@01000100@0@ab"], left
        assert all(k.startswith(f"kvpersist-fleet:{ns}") for k in left
                   if k.startswith("kvpersist-fleet:")), left
        b.stop()
    finally:
        a.cleanup()
        b.cleanup()
