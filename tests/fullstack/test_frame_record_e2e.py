"""A chunk file renamed over another is quarantined before the next launch serves: real vLLM
(CPU build) and a real lmcache server through ``kvp-admin launch``/``stop``, the tiny
generated model, greedy decoding (issue 38, item 4).

A long chat is served cold (its chunk files written by LMCache as vLLM computed them); after a
clean stop ``kvp-admin verify`` learns every frame; one of the chat's chunk files is renamed
(``mv``) over another of its chunk files: a valid frame under the wrong name, which
authentication cannot tell (served, it changes vLLM's answer: bench/planted_frame_vllm.py).
The next ``kvp-admin launch`` quarantines it before the cache server starts, and the same
chat then gets the cold answer. vLLM starts twice.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.demo.chat import chat_completion, long_chat
from kvpersist.stack.warm.chunk_keys import chunk_files, key_scheme

from ._stack import Stack

pytestmark = pytest.mark.fullstack

CHAT = long_chat(turns=8, words_per_turn=150, seed=11)


@pytest.fixture
def stack(tmp_path: Path, demo_model: Path) -> Iterator[Stack]:
    hub = demo_model.parents[2]
    shutil.copytree(hub, tmp_path / "hub", symlinks=True)
    s = Stack(tmp_path, model=tmp_path / "hub" / demo_model.relative_to(hub))
    try:
        yield s
    finally:
        s.cleanup()


def test_a_renamed_chunk_is_quarantined_before_the_next_launch_serves(stack: Stack) -> None:
    ns = stack.render()["namespace"]
    stack.launch()
    cold = chat_completion(stack.vllm_url, "cpu-demo", CHAT, max_tokens=24)
    stack.stop()
    files = stack.chunk_files(ns + "_01000100_")
    assert len(files) >= 5, files
    learned = stack.kvp_json("verify", stack.config)
    assert learned["findings"] == [] and learned["frames"]["new"] == len(files), learned

    # two of the chat's chunks (sorted by hash, any two), not the canary's: the launch's
    # canary would store its own chunk again under the quarantined name (docs/canary.md)
    record = json.loads((stack.state_dir / "canary" / f"{ns}.json").read_text())
    canary, _ = chunk_files(key_scheme(stack.render()["lmcache_server_argv"]), ns, 1,
                            record["prompt"]["tokens"])
    chat = [f for f in files
            if str(f.relative_to(stack.root)) not in set(canary) and "@" not in f.name]
    assert len(chat) >= 3, (files, canary)
    src, dst = chat[0], chat[2]
    os.rename(src, dst)
    info = stack.launch()
    cw = info["crash_window"]
    assert cw["unclean"] is False and cw["frames"]["moved"] == 1, cw
    assert [p.split("/")[-1].split(".moved.")[0] for p in cw["quarantined"]] == [dst.name]
    assert not dst.exists() and not src.exists()
    warm = chat_completion(stack.vllm_url, "cpu-demo", CHAT, max_tokens=24)
    assert warm.text == cold.text  # the moved frame was never served
    stack.stop()
