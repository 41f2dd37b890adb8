"""Frames bound to their names, with real LMCache files (issue 38, item 4).

A stock ``lmcache server`` (the argv kvpersist renders for a relocated cpu-demo: aesgcm,
``nixl_store_dynamic`` on POSIX) started and stopped through ``kvp-admin launch`` and
``stop``; sequences stored through LMCache's own client (:mod:`kvpersist.demo.kvdriver`).
The launch after a clean stop learns every chunk file's frame (its first 13 bytes). Then:

* one chunk file is deleted while the server runs, L1 is cleared and the sequence stored
  again: LMCache writes that chunk afresh (a new file, a fresh IV) -- a legitimate rewrite.
  Observed: it writes the sequence's three other chunk files again too (temp file and
  rename over the name, fresh IVs), so four chunks are rewritten by LMCache;
* the server is stopped cleanly and one chunk file of another sequence is renamed (``mv``)
  over a chunk file of a third: a valid frame under the wrong name, with its old mtime
  (outside any crash window), which authentication cannot tell from the right one.

The next ``kvp-admin launch`` quarantines the renamed frame before the server starts, and
only it: the rewritten chunk is learned, not flagged; every other file is untouched. With
the server up, no lookup returns other bytes than the ones stored: the renamed chunk is a
miss, the rest hits with its stored digests. ``verify`` then finds nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import requests

from kvpersist.demo.kvdriver import connect

from ..fullstack._stack import Stack, wait_until

pytestmark = pytest.mark.integration

TOKENS = 1024  # connect()'s default: 4 chunks of 256 tokens per sequence


def chunk_names(stack: Stack, ns: str, seq: int) -> list[str]:
    """The chunk file names of sequence ``seq``, in chunk order, by LMCache's key code."""
    from lmcache.cli.commands.bench.server_bench.helpers import _build_token_ids

    from kvpersist.stack.launch_plan import prepare_launch
    from kvpersist.stack.warm import chunk_keys as warm_keys

    scheme = warm_keys.key_scheme(prepare_launch(stack.config, environ=stack.env)
                                  .plan.server_argv)
    names, _ = warm_keys.chunk_files(scheme, ns, 1, _build_token_ids(seq, TOKENS))
    return list(names)


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
            for p in root.glob("*.bin")}


def test_a_rename_over_another_chunk_is_quarantined_by_the_next_launch(stack: Stack) -> None:
    ns = stack.render()["namespace"]
    first = stack.launch("--no-vllm")
    assert first["crash_window"]["frames"]["files"] == 0, first["crash_window"]
    names = {s: chunk_names(stack, ns, s) for s in (1, 2, 3)}
    with connect(stack.rpc, stack.http, ns) as d:
        stored = {s: d.store(s) for s in names}
    every = [n for s in names for n in names[s]]
    assert wait_until(lambda: all((stack.root / n).exists() for n in every), 60)
    stack.stop()

    learned = stack.launch("--no-vllm")["crash_window"]
    assert learned["unclean"] is False and learned["quarantined"] == [], learned
    assert learned["frames"]["new"] == 12 and learned["frames"]["read"] == 12, learned

    # LMCache stores a chunk again: deleted, L1 cleared, the sequence stored once more
    again = stack.root / names[3][3]
    old_ivs = [(stack.root / n).read_bytes()[1:13] for n in names[3]]
    again.unlink()
    requests.post(f"{stack.http}/cache/clear", timeout=30).raise_for_status()
    with connect(stack.rpc, stack.http, ns) as d:
        assert d.store(3) == stored[3]
    assert wait_until(again.exists, 60)
    stack.stop()
    new_ivs = [(stack.root / n).read_bytes()[1:13] for n in names[3]]
    assert new_ivs[3] != old_ivs[3]  # a fresh IV: LMCache's serializer draws one per write
    rewritten = sum(a != b for a, b in zip(old_ivs, new_ivs, strict=True))
    print(f"\nLMCache wrote {rewritten} of sequence 3's 4 chunk files again")

    # a valid frame renamed over another chunk's name: sequence 1's third chunk over 2's
    src, dst = stack.root / names[1][2], stack.root / names[2][2]
    moved_frame = src.read_bytes()
    os.rename(src, dst)
    before = snapshot(stack.root)
    del before[dst.name]

    r = stack.kvp("launch", stack.config, "--no-vllm", "--json")
    assert r.returncode == 0, r.stderr
    cw = json.loads(r.stdout)["crash_window"]
    frames = cw["frames"]
    assert cw["unclean"] is False, cw  # a clean stop: no crash window, the record checked
    assert (frames["moved"], frames["rewritten"]) == (1, rewritten), frames
    assert frames["read"] == 1 + rewritten and frames["unchanged"] == 10 - rewritten, frames
    assert [f["kind"] for f in cw["findings"]] == ["moved"], cw["findings"]
    assert Path(cw["findings"][0]["path"]).name == dst.name
    assert src.name in cw["findings"][0]["detail"]
    assert [Path(q).name.split(".moved.")[0] for q in cw["quarantined"]] == [dst.name]
    q = Path(cw["quarantined"][0])
    assert q.parent == stack.root / ".kvpersist" / "quarantine"
    assert q.read_bytes() == moved_frame and not dst.exists()
    assert "frame record:" in r.stderr and "1 under another chunk's name" in r.stderr
    assert snapshot(stack.root) == before, "the check touched another file"

    # served after the check: never the moved frame's bytes under sequence 2's name
    with connect(stack.rpc, stack.http, ns) as d:
        lk, got = d.lookup_and_retrieve(2, prefix=True)
        assert lk.hit_chunks == 2 and got == stored[2][:2], (lk, got)
        lk, got = d.lookup_and_retrieve(1, prefix=True)
        assert lk.hit_chunks == 2 and got == stored[1][:2], (lk, got)
        lk, got = d.lookup_and_retrieve(3)
        assert lk.hit_chunks == 4 and got == stored[3], (lk, got)
    v = stack.kvp_json("verify", stack.config)
    assert v["findings"] == [] and v["frames"]["moved"] == 0, v
