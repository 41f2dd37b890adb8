"""``kvp-admin forget`` against a real ``lmcache server`` (started by ``kvp-admin launch``) with
a real redis-server shared tier.

Two conversations share one system prompt; the warm set is that system prompt. Their requests
are tokenized by vLLM's own renderer on the generated tiny demo model (as the deployment
does) and stored through LMCache's own MP client stack (``kvpersist.demo.kvdriver``: what
vLLM's workers send), so L1, the NVMe files and the shared tier's keys all hold them. Then
``forget`` runs through the real CLI: the dry run deletes nothing; ``--apply`` on one
conversation makes its lookups miss on every tier past the warm set's chunks, while the
other still hits as far as the chunks the two really share survive. Nothing is mocked.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.shared_tier import ACL_RULES
from kvpersist.config.warmset import WarmEntry
from kvpersist.demo.kvdriver import KVDriver, connect

from ..fullstack._stack import Stack, wait_until
from ._redis import Redis, start_redis

pytestmark = pytest.mark.integration

CHUNK = 256
SYSTEM = ("You are the support assistant of a team that keeps vLLM's KV cache on local NVMe. "
          "Answer in short sentences and name the handbook section you rely on. " * 10)
A_TURN1 = ("My deployment restarted overnight and the first request was slow again; the disk "
           "report shows the files are still there. What should I check first? " * 5)
A_ANSWER = "Check that the namespace did not change: kvp-admin identity show CONFIG. " * 3
A_TURN2 = ("The namespace is the same. The health check says degraded; the warm-up log says "
           "it timed out after two minutes. How do I make it wait longer? " * 5)
B_TURN1 = ("Which user may read the chunk files, and what mode do the directories get when "
           "kvp-admin launch creates the cache root? Please be precise. " * 5)

CONV_A = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": A_TURN1},
          {"role": "assistant", "content": A_ANSWER}, {"role": "user", "content": A_TURN2}]
CONV_B = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": B_TURN1}]
WARM = [{"role": "system", "content": SYSTEM}]


def prefix_keys(ids: Sequence[int]) -> list[tuple[int, ...]]:
    """What identifies each complete chunk under LMCache's prefix-chained hash: the tokens
    from the start to its end (an independent model of the key, not LMCache's code)."""
    return [tuple(ids[:CHUNK * (j + 1)]) for j in range(len(ids) // CHUNK)]


def leading_hits(ids: Sequence[int], gone: set[tuple[int, ...]]) -> int:
    """Chunks a lookup of ``ids`` hits when the chunks ``gone`` were removed: a prefix lookup
    stops at the first missing chunk."""
    return next((j for j, k in enumerate(prefix_keys(ids)) if k in gone),
                len(ids) // CHUNK)


_serial = itertools.count()


def lookup(d: KVDriver, ids: Sequence[int]) -> int:
    """Chunks hit by a lookup of ``ids`` (L1, then the NVMe, then the shared tier), through
    LMCache's client as vLLM's workers ask it; the chunks that hit are then loaded, as vLLM
    does, which releases the lookup's read locks."""
    client = d._client
    base = client.create_request(0, f"kvp-forget-lookup-{next(_serial)}", "retrieve")
    block = base.num_full_tokens // base.num_blocks
    full = len(ids) // CHUNK * CHUNK
    req = dataclasses.replace(base, token_ids=tuple(ids), num_full_tokens=full,
                              total_chunks=full // CHUNK, block_offset=0,
                              num_blocks=full // block)
    res = client.lookup(req)
    assert res.succeeded, res.error
    hits = int(res.hit_chunks)
    if hits:
        out = client.retrieve(req, 0, hits * CHUNK)
        assert out is not None and out.succeeded, out
    client.end_session(req)
    return hits


@dataclasses.dataclass
class World:
    stack: Stack
    redis: Redis
    ns: str
    #: token ids of each request the clients sent, by name
    ids: dict[str, list[int]]
    a_file: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[World]:
    from kvpersist.stack.warm.tokens import tokenize

    tmp = tmp_path_factory.mktemp("forget")
    tmp.chmod(0o700)
    redis = start_redis(tmp / "store", acl=ACL_RULES)
    secret = redis.write_secret(tmp / "shared.secret")
    warm = tmp / "warm.jsonl"
    warm.write_text(json.dumps({"messages": WARM}) + "\n")
    stack = Stack(tmp, model=demo_model, KVP_SHARED_TIER=redis.url,
                  KVP_SHARED_TIER_SECRET_FILE=str(secret), KVP_WARMUP_FILE=str(warm))
    a_file = tmp / "conversation-a.json"
    a_file.write_text(json.dumps(CONV_A))
    try:
        rendered = stack.render()
        # the requests the clients sent, tokenized by vLLM's renderer as the deployment does
        requests = {
            "a1": {"messages": CONV_A[:2]},
            "a1+answer": {"messages": CONV_A[:3], "add_generation_prompt": False},
            "a2": {"messages": CONV_A},
            "b1": {"messages": CONV_B},
            "warm": {"messages": WARM},
        }
        tok = tokenize(rendered["vllm_argv"], str(demo_model),
                       [WarmEntry(i, "messages", b) for i, b in enumerate(requests.values())],
                       expected_template_sha256=None, source="test")
        ids = dict(zip(requests, tok.token_ids, strict=True))
        stack.launch("--no-vllm", "--no-warmup")
        yield World(stack, redis, rendered["namespace"], ids, a_file)
    finally:
        stack.cleanup()
        redis.stop()


def forget(w: World, *args: str) -> dict[str, Any]:
    doc: dict[str, Any] = w.stack.kvp_json("forget", w.stack.config, *args)
    assert doc["schema"] == "kvpersist.forget/1"
    return doc


def test_forget_one_conversation_on_every_tier(world: World) -> None:
    w, stack, ns = world, world.stack, world.ns
    ids = w.ids
    a_reqs = [ids["a1"], ids["a1+answer"], ids["a2"]]
    a_keys = {k for r in a_reqs for k in prefix_keys(r)}
    b_keys = set(prefix_keys(ids["b1"]))
    warm_keys = set(prefix_keys(ids["warm"]))
    stored = a_keys | b_keys
    assert len(prefix_keys(ids["a2"])) >= 4 and len(b_keys) >= 3
    shared_ab = a_keys & b_keys  # the leading chunks wholly inside the common prefix
    pinned = a_keys & warm_keys
    assert pinned and pinned <= shared_ab  # the system prompt's chunks are the warm set's
    targets = a_keys - warm_keys

    with connect(stack.rpc, stack.http, ns) as d:
        # the warm-up pins the system prompt's chunk files (a layout is registered now)
        r = stack.kvp("warmup", stack.config, "--wait", "30")
        assert r.returncode == 0, r.stderr
        for name in ("a1", "a1+answer", "a2", "b1"):
            d.store_tokens(ids[name])
        # L2 writes are asynchronous: every chunk on the NVMe and on the shared tier
        assert wait_until(lambda: len(stack.chunk_files(ns + "_")) == len(stored), 60), \
            (len(stack.chunk_files(ns + "_")), len(stored))
        assert wait_until(lambda: len(w.redis.scan_keys(f"{ns}@*")) == len(stored), 60)
        files_before = {p.name for p in stack.chunk_files(ns + "_")}
        keys_before = w.redis.scan_keys(f"{ns}@*")
        assert lookup(d, ids["a2"]) == len(prefix_keys(ids["a2"]))

        # the dry run: the report, and nothing deleted anywhere
        t0 = time.monotonic()
        dry = forget(w, "--messages", str(w.a_file))
        dry_s = time.monotonic() - t0
        assert dry["dry_run"] is True and dry["namespace"] == ns and dry["exit_code"] == 0
        assert [r["tokens"] for r in dry["plan"]["requests"]] == [len(x) for x in a_reqs]
        plan, tiers = dry["plan"], dry["tiers"]
        assert (plan["chunks"], plan["keys"]) == (len(a_keys), len(a_keys))  # TP 1
        assert (plan["pinned_chunks"], plan["target_keys"]) == (len(pinned), len(targets))
        assert tiers["nvme"]["found"]["files"] == len(targets)
        assert tiers["nvme"]["kept_pinned"]["files"] == len(pinned)
        assert tiers["nvme"]["deleted"]["files"] == 0 and tiers["nvme"]["absent"] == 0
        size = (stack.root / next(iter(files_before))).stat().st_size
        assert tiers["nvme"]["found"]["bytes"] == len(targets) * size
        assert tiers["shared"]["configured"] is True and tiers["shared"]["state"] == "checked"
        assert tiers["shared"]["found"]["keys"] == len(targets)
        assert tiers["shared"]["kept_pinned"]["keys"] == len(pinned)
        assert tiers["memory"]["state"] == "dry_run" and tiers["memory"]["server_answers"]
        assert {p.name for p in stack.chunk_files(ns + "_")} == files_before
        assert w.redis.scan_keys(f"{ns}@*") == keys_before
        assert lookup(d, ids["a2"]) == len(prefix_keys(ids["a2"]))  # still whole in L1

        # another cache salt names other chunks: a salted forget finds and deletes nothing
        tid = stack.tmp / "a2.tokens.json"
        tid.write_text(json.dumps(ids["a2"]))
        salted = forget(w, "--token-ids", str(tid), "--cache-salt", "tenant-7", "--apply")
        assert salted["cache_salt"] == "tenant-7" and salted["exit_code"] == 0
        assert salted["plan"]["pinned_keys"] == 0  # the warm set's chunks are unsalted
        assert salted["tiers"]["nvme"]["deleted"]["files"] == 0
        assert salted["tiers"]["nvme"]["absent"] == len(prefix_keys(ids["a2"]))
        assert salted["tiers"]["shared"]["deleted"]["keys"] == 0
        assert salted["tiers"]["memory"]["deleted_keys"] == 0
        assert {p.name for p in stack.chunk_files(ns + "_")} == files_before

        # --apply: the conversation's chunks leave the NVMe, the shared tier and L1
        t0 = time.monotonic()
        done = forget(w, "--messages", str(w.a_file), "--apply")
        apply_s = time.monotonic() - t0
        tiers = done["tiers"]
        assert done["dry_run"] is False and done["exit_code"] == 0, done["problems"]
        assert tiers["nvme"]["deleted"]["files"] == len(targets)
        assert tiers["nvme"]["deleted"]["bytes"] == len(targets) * size
        assert tiers["shared"]["deleted"]["keys"] == len(targets)
        mem = tiers["memory"]
        assert mem["state"] == "deleted" and mem["requested_keys"] == len(targets)
        assert mem["deleted_keys"] == len(targets) and mem["skipped_locked"] == 0
        assert mem["index_dropped_keys"] == len(targets)
        left = {p.name for p in stack.chunk_files(ns + "_")}
        assert len(left) == len(stored) - len(targets) and left < files_before
        assert len(w.redis.scan_keys(f"{ns}@*")) == len(stored) - len(targets)

        # A's lookups: the warm set's chunks still hit, nothing after them on any tier
        for r in a_reqs:
            assert lookup(d, r) == leading_hits(r, targets)
        assert lookup(d, ids["a2"]) == len(pinned) < len(prefix_keys(ids["a2"]))
        # B hits as far as its chunks survive: the warm set's, then up to the first chunk it
        # shared with A that was not pinned (prefix-chained keys: what follows is unreachable)
        b_hits = leading_hits(ids["b1"], targets)
        assert lookup(d, ids["b1"]) == b_hits >= len(pinned)
        if shared_ab - warm_keys:
            assert b_hits < len(b_keys)
        else:
            assert b_hits == len(b_keys)

        # again, by the last request's token ids: nothing more to delete
        again = forget(w, "--token-ids", str(tid), "--apply")
        a2_targets = set(prefix_keys(ids["a2"])) - warm_keys
        assert again["tiers"]["nvme"]["deleted"]["files"] == 0
        assert again["tiers"]["nvme"]["absent"] == len(a2_targets)
        assert again["tiers"]["shared"]["deleted"]["keys"] == 0
        assert again["tiers"]["shared"]["absent"] == len(a2_targets)

        # --include-pinned: the system prompt's chunks go too, and with them every hit of B
        # (its first chunk is gone)
        pins = forget(w, "--token-ids", str(tid), "--include-pinned", "--apply")
        assert pins["tiers"]["nvme"]["deleted"]["files"] == len(pinned)
        assert pins["tiers"]["shared"]["deleted"]["keys"] == len(pinned)
        assert pins["tiers"]["memory"]["deleted_keys"] == len(pinned)
        assert lookup(d, ids["b1"]) == 0
        assert lookup(d, ids["a2"]) == 0
    print(f"\nforget --messages: dry run {dry_s:.1f} s, --apply {apply_s:.1f} s; "
          f"A {len(a_keys)} chunks ({len(pinned)} pinned), B {len(b_keys)} chunks, "
          f"{len(shared_ab)} shared by A and B, B hits {b_hits} after A is forgotten")


def test_usage_and_input_errors_exit_2(world: World) -> None:
    stack = world.stack
    r = stack.kvp("forget", stack.config)
    assert r.returncode == 2 and "exactly one of" in r.stderr
    bad = stack.tmp / "bad.json"
    bad.write_text(json.dumps([{"role": "narrator", "content": "x"}]))
    r = stack.kvp("forget", stack.config, "--messages", str(bad), "--json")
    assert r.returncode == 2 and "narrator" in r.stderr
    assert json.loads(r.stdout)["schema"] == "kvpersist.error/1"
    ids = stack.tmp / "ids.json"
    ids.write_text("[1, 2, -3]")
    r = stack.kvp("forget", stack.config, "--token-ids", str(ids))
    assert r.returncode == 2 and "item 2" in r.stderr
    ids.write_text(json.dumps(list(range(300))))
    r = stack.kvp("forget", stack.config, "--token-ids", str(ids), "--cache-salt", "a/b")
    assert r.returncode == 2 and "LMCache cannot key it" in r.stderr
