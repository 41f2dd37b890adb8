"""What a valid frame of another chunk under a chunk's name does to vLLM's answer, and that
``kvp-admin verify --apply`` undoes it (docs/lmcache-failure-paths.md, section 5).

One relocated cpu-demo deployment (the demo's tiny generated model, vLLM's CPU build, greedy
decoding), all through ``kvp-admin launch``/``stop``:

1. a long chat, cold; stop;
2. launch, the same chat: from disk, the same answer (the control);
3. stop; one of the chat's chunk files replaced (rename over) by a copy of another chunk file
   of the same chat, as a restore or a sync tool could leave it; launch, the same chat: every
   chunk still comes from disk, and the answer;
4. ``kvp-admin verify CONFIG --apply``: what it finds; stop, launch, the same chat.

usage: python bench/planted_frame_vllm.py [--out FILE]   (about 6 minutes on 2 cores)
Prints and writes (``--out``) one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvpersist.demo.chat import chat_completion, long_chat  # noqa: E402
from kvpersist.demo.model import generate_model  # noqa: E402
from tests.fullstack._stack import Stack, vllm_metric  # noqa: E402

CHAT = long_chat(turns=8, words_per_turn=150, seed=11)
HITS = "vllm:external_prefix_cache_hits_total"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    out: dict[str, Any] = {"schema": "kvpersist.bench.planted-frame-vllm/1"}
    with tempfile.TemporaryDirectory(prefix="kvp-planted-") as tmp:
        model = generate_model("tiny", Path(tmp) / "models" / "tiny")
        (Path(tmp) / "dep").mkdir()
        s = Stack(Path(tmp) / "dep", model=model)

        def chat() -> Any:
            return chat_completion(s.vllm_url, "cpu-demo", CHAT, max_tokens=24)

        try:
            ns = s.launch()["namespace"]
            cold = chat()
            s.stop()
            files = s.chunk_files(ns + "_01000100_")
            out.update(prompt_tokens=cold.prompt_tokens, chunk_files=len(files),
                       cold=cold.text)
            s.launch()
            control = chat()
            out.update(restart_same_answer=control.text == cold.text,
                       restart_tokens_from_disk=vllm_metric(s.vllm_url, HITS))
            s.stop()
            target, donor = files[0], files[1]
            tmp_file = target.with_name("planted~")
            tmp_file.write_bytes(donor.read_bytes())
            os.rename(tmp_file, target)
            s.launch()
            planted = chat()
            out.update(planted=planted.text, planted_same_answer=planted.text == cold.text,
                       planted_tokens_from_disk=vllm_metric(s.vllm_url, HITS))
            doc = json.loads(s.kvp("verify", s.config, "--apply", "--json").stdout)
            out["verify"] = [{"file": "the copy" if Path(f["path"]).name == target.name else
                              "its source" if Path(f["path"]).name == donor.name else "other",
                              "kind": f["kind"]} for f in doc["findings"]]
            out["quarantined"] = len(doc["quarantined"])
            s.stop()
            s.launch()
            after = chat()
            out.update(after_verify_same_answer=after.text == cold.text,
                       after_verify_tokens_from_disk=vllm_metric(s.vllm_url, HITS))
            s.stop()
        finally:
            s.cleanup()
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
