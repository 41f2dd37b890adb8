"""``kvp-admin forget``: its input (pure), its plan (pure), its NVMe executor on real
directory trees, and its start-up (``--help`` imports neither lmcache nor torch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpersist.actions.forget import ForgetResult, MemoryOutcome, SharedOutcome
from kvpersist.config.warmset import WarmEntry
from kvpersist.errors import ConfigError
from kvpersist.l2.forget.plan import ChunkKey, plan_forget
from kvpersist.l2.forget.remove import FilesOutcome, forget_files
from kvpersist.l2.tree import open_root
from kvpersist.stack.conversation.input import MAX_MESSAGES, conversation_requests, parse_input

from .test_cli_startup import HEAVY, loaded_modules, matching

NS = "kvp-" + "ab" * 16


def key(i: int, *, rank: int = 0x01000100, salt: str = "", ns: str = NS,
        shard: bool = False) -> ChunkKey:
    h = f"{i:02x}" * 32
    name = f"{ns}_{rank:08x}_0_{h}{'@' + salt if salt else ''}.bin"
    rel = f"{h[:2]}/{h[2:4]}/{name}" if shard else name
    wire = f"{ns}@{rank:08x}@0@{h}{'@' + salt if salt else ''}"
    return ChunkKey(1, i, rank, h, salt, rel, wire)


# --------------------------------------------------------------------------- input


def test_a_conversation_becomes_the_requests_it_was_sent_as() -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    inp = parse_input("messages", json.dumps(msgs).encode(), "conv.json")
    got = [(len(e.body["messages"]), e.body["add_generation_prompt"]) for e in inp.entries]
    # turn 1 as sent, turn 1 with its answer (decode KV), the whole conversation as sent
    assert got == [(2, True), (3, False), (4, True)]
    assert [e.line for e in inp.entries] == [1, 2, 3]
    assert all(e.kind == "messages" for e in inp.entries)


def test_a_conversation_ending_with_the_answer_and_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    entry = WarmEntry(1, "messages", {"messages": [
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}],
        "tools": tools})
    reqs = conversation_requests(entry)
    assert [(len(e.body["messages"]), e.body["add_generation_prompt"]) for e in reqs] == \
        [(1, True), (2, False)]  # the same request once
    assert all(e.body["tools"] == tools for e in reqs)


def _turns(n: int) -> bytes:
    return json.dumps([{"role": "user" if i % 2 == 0 else "assistant", "content": ""}
                       for i in range(n)]).encode()


def test_requests_are_built_in_linear_time_and_memory() -> None:
    """Issue 40: 8,000 empty turns took 52 s and 1.5 GB (a slice and a JSON copy of the
    conversation per request), 40,000 ended in MemoryError. At the cap, 2,048 messages: the
    requests are views; building them and walking every one keeps one request's slice at a
    time (twice the turns cost twice, not four times, the memory)."""
    import time
    import tracemalloc

    peaks, times = [], []
    for n in (1024, MAX_MESSAGES):
        tracemalloc.start()
        t0 = time.perf_counter()
        inp = parse_input("messages", _turns(n), "conv.json")
        assert len(inp.entries) == n  # every message but a trailing one ends a request
        assert [len(e.body["messages"]) for e in inp.entries][-2:] == [n - 1, n]
        times.append(time.perf_counter() - t0)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 3 * peaks[0], peaks  # linear (quadratic would be 4x)
    assert max(times) < 5, times


@pytest.mark.parametrize("n", [MAX_MESSAGES + 1, 8000, 40_000])
def test_a_conversation_past_the_cap_is_refused_at_once(n: int) -> None:
    import time

    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as exc:
        parse_input("messages", _turns(n), "conv.json")
    assert f"{n:,} messages, more than the {MAX_MESSAGES:,}" in str(exc.value)
    assert exc.value.exit_code == 2 and time.perf_counter() - t0 < 2
    with pytest.raises(ConfigError):  # the object form too
        parse_input("messages", json.dumps({"messages": json.loads(_turns(n))}).encode(),
                    "conv.json")


def test_the_cli_refuses_a_conversation_past_the_cap(tmp_path: Path) -> None:
    from tests.cli import kvp

    f = tmp_path / "chat.json"
    f.write_bytes(_turns(40_000))  # 1.26 MB of empty turns: MemoryError after 19-33 s
    res = kvp("forget", "cpu-demo", "--messages", str(f), "--json")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema"] == "kvpersist.error/1" and "2,048" in doc["error"]


def test_object_form_prompt_and_token_ids() -> None:
    doc = {"messages": [{"role": "user", "content": "hi"}]}
    assert len(parse_input("messages", json.dumps(doc).encode(), "f").entries) == 1
    p = parse_input("prompt", b"some text", "p.txt")
    assert p.entries == (WarmEntry(1, "prompt", {"prompt": "some text"}),)
    assert parse_input("token_ids", b"[1, 2, 3]", "t").token_ids == (1, 2, 3)
    assert parse_input("token_ids", b'{"token_ids": [7]}', "t").token_ids == (7,)


@pytest.mark.parametrize(("kind", "data", "needle"), [
    ("messages", b'[{"role": "narrator", "content": "x"}]', "narrator"),
    ("messages", b"[]", "non-empty"),
    ("messages", b'{"prompt": "x"}', "--prompt-file"),
    ("messages", b"[1", "not valid JSON"),
    ("messages", b"[" * 100 + b"]" * 100, "nested"),
    ("prompt", b"", "empty"),
    ("prompt", b"\xff\xfe", "not UTF-8"),
    ("token_ids", b"[1, true]", "item 1"),
    ("token_ids", b"[1, 4294967296]", "item 1"),
    ("token_ids", b"[]", "non-empty"),
    ("token_ids", b'"1 2 3"', "non-empty"),
])
def test_bad_input_is_a_config_error_naming_the_file(kind: str, data: bytes,
                                                     needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_input(kind, data, "in.json")
    assert exc.value.exit_code == 2
    assert "in.json" in str(exc.value) and needle in str(exc.value)
    assert "in.json:1" not in str(exc.value)  # the file is one document, not a line


# --------------------------------------------------------------------------- plan


def test_plan_keeps_pins_unless_included_and_drops_duplicates() -> None:
    keys = [key(1), key(2), key(3), key(1)]
    plan = plan_forget(NS, keys, request_tokens=[700], pinned=[key(1).relpath, "other.bin"])
    assert [k.index for k in plan.keys] == [1, 2, 3]
    assert plan.pinned == frozenset({key(1).relpath})
    assert [k.index for k in plan.targets] == [2, 3]
    assert [k.index for k in plan.kept] == [1]
    d = plan.to_dict()
    assert (d["chunks"], d["keys"], d["pinned_keys"], d["target_keys"]) == (3, 3, 1, 2)
    assert d["requests"] == [{"request": 1, "tokens": 700}]
    incl = plan_forget(NS, keys, request_tokens=[700], pinned=[key(1).relpath],
                       include_pinned=True)
    assert len(incl.targets) == 3 and incl.kept == ()


def test_a_held_manifest_keeps_every_key() -> None:
    plan = plan_forget(NS, [key(1), key(2)], request_tokens=[512], pins_held="unreadable")
    assert plan.targets == () and len(plan.kept) == 2


def test_ranks_count_as_keys_of_one_chunk() -> None:
    ks = [key(1, rank=0x02000200), key(1, rank=0x02010201)]
    plan = plan_forget(NS, ks, request_tokens=[256])
    assert (plan.chunks, len(plan.keys)) == (1, 2)


def test_salted_and_sharded_keys_are_accepted() -> None:
    plan = plan_forget(NS, [key(1, salt="tenant-7", shard=True)], request_tokens=[256],
                       salt="tenant-7")
    assert plan.targets[0].relpath.startswith("01/01/")
    assert plan.targets[0].encoded("m")["cache_salt"] == "tenant-7"


@pytest.mark.parametrize(("bad", "salt"), [
    (key(1, ns="kvp-" + "cd" * 16), ""),            # another namespace
    (key(1, salt="other"), "mine"),                 # another salt
    (key(1, salt="mine"), ""),                      # a salt where none was given
    (ChunkKey(1, 0, 1, "ab", "", "not-a-chunk.txt", f"{NS}@00000001@0@ab"), ""),
    (ChunkKey(1, 0, 0x01000100, "0101", "", f"zz/{key(1).name}", key(1).wire_key), ""),
    (ChunkKey(1, 0, 0x01000100, "01" * 32, "", key(1).relpath, "kvp-x@1@0@01"), ""),
    (ChunkKey(1, 0, 0x01000100, "02" * 32, "", key(1).relpath, key(1).wire_key), ""),
])
def test_a_key_that_is_not_the_namespaces_is_refused(bad: ChunkKey, salt: str) -> None:
    with pytest.raises(ValueError):
        plan_forget(NS, [key(2, salt=salt), bad], request_tokens=[512], salt=salt)


# --------------------------------------------------------------------------- NVMe executor


def test_forget_files_dry_run_then_apply(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    for i in (1, 2, 3):
        (root / key(i).relpath).write_bytes(b"x" * (100 * i))
    (root / f"{key(4).name}").mkdir()            # a directory under a chunk's name
    os.symlink(tmp_path / "elsewhere", root / key(5).relpath)  # a link: never followed
    (tmp_path / "elsewhere").write_bytes(b"keep")
    foreign = root / "notes.txt"
    foreign.write_text("keep")
    targets = [key(1), key(2), key(4), key(5), key(6)]
    with open_root(root) as handle:
        dry = forget_files(handle, targets, apply=False, kept=[key(3)])
    assert (dry.found_files, dry.found_bytes, dry.deleted_files) == (2, 300, 0)
    assert (dry.absent, dry.not_regular, dry.kept_pinned_files) == (1, 2, 1)
    assert dry.to_dict()["state"] == "checked"
    assert (root / key(1).relpath).exists() and (root / key(2).relpath).exists()
    with open_root(root) as handle:
        done = forget_files(handle, targets, apply=True, kept=[key(3)])
    assert (done.deleted_files, done.deleted_bytes, done.ok) == (2, 300, True)
    assert not (root / key(1).relpath).exists() and not (root / key(2).relpath).exists()
    assert (root / key(3).relpath).exists() and foreign.exists()
    assert (root / key(4).name).is_dir() and os.path.islink(root / key(5).relpath)
    assert (tmp_path / "elsewhere").read_bytes() == b"keep"
    assert (root / ".kvpersist" / "prune.lock").exists()  # deleting takes the root's lock


def test_forget_files_in_shard_directories_never_through_a_link(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    (root / "01").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    k1 = key(1, shard=True)
    (outside / k1.name).write_bytes(b"victim")
    os.symlink(outside, root / "01" / "01")  # a shard directory swapped for a link
    k2 = key(2, shard=True)
    (root / "02" / "02").mkdir(parents=True)
    (root / k2.relpath).write_bytes(b"y")
    with open_root(root) as handle:
        res = forget_files(handle, [k1, k2], apply=True)
    assert res.deleted_files == 1 and not (root / k2.relpath).exists()
    assert (res.not_regular, res.errors) == (1, [])
    assert (outside / k1.name).read_bytes() == b"victim"


# --------------------------------------------------------------------------- start-up


def test_forget_help_imports_neither_lmcache_nor_torch() -> None:
    code, modules = loaded_modules("forget", "--help")
    assert code == 0
    assert matching(modules, HEAVY) == []


# --------------------------------------------------------------------------- result and output


def result(**memory: object) -> ForgetResult:
    plan = plan_forget(NS, [key(1), key(2)], request_tokens=[600], pinned=[key(1).relpath])
    nvme = FilesOutcome("/cache", False, "deleted", found_files=1, found_bytes=10,
                        deleted_files=1, deleted_bytes=10, kept_pinned_files=1)
    mem = MemoryOutcome("http://127.0.0.1:8080", "deleted", True, 1, 1)
    for k, v in memory.items():
        setattr(mem, k, v)
    return ForgetResult(NS, False, "messages", "conv.json", 1, 256, plan, nvme, mem,
                        SharedOutcome(False))


def test_result_document_exit_code_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpersist.commands.forget import _print

    ok = result()
    doc = ok.to_dict()
    assert doc["schema"] == "kvpersist.forget/1" and doc["exit_code"] == 0
    assert doc["plan"]["target_keys"] == 1 and doc["plan"]["kept_pinned_keys"] == 1
    assert doc["tiers"]["shared"] == {"configured": False, "state": "none", "error": ""}
    assert doc["cache_salt"] is None and doc["problems"] == []
    _print(doc)
    out = capsys.readouterr().out
    assert "1 key(s) shared with the warm set (kept)" in out
    assert "removed 1 file(s), 10 bytes on the NVMe; 1 key(s) dropped from L1" in out
    assert "none (no KVP_SHARED_TIER)" in out
    locked = result(skipped_locked=2)
    assert locked.exit_code == 1 and "in use by a request in flight" in locked.problems[0]
    failed = result(state="failed", error="DELETE /cache/objects (l1) answered 500: x")
    assert failed.exit_code == 1 and "answered 500" in failed.problems[0]
