"""A chat client in a child process, so that it can run inside a host's network namespace
(``ip netns exec NS``) next to that host's vLLM, which listens on the namespace's own
loopback. The test talks to it over stdin/stdout, one JSON object per line::

    {"op": "chat", "messages": [...], "max_tokens": 24}
        -> {"text": "...", "ttft_s": 0.41, "total_s": 0.52, "prompt_tokens": 1790}
    {"op": "metric", "name": "vllm:external_prefix_cache_hits_total"}  -> {"value": 1792.0}
    {"op": "post", "path": "/reset_prefix_cache"}                      -> {"status": 200}
    {"op": "references", "requests": [[uid, round, messages], ...]}
        -> {"answers": [[uid, round, "..."], ...]}   (bench.traffic.references: each alone,
                                                      cold, under a cache salt of its own)
    {"op": "storm", "requests": [...], "phase": "p", "spread_s": 1.0}
        -> {"records": [{...}, ...]}                 (bench.traffic.storm: all at once)

An error (vLLM refused, a timeout) comes back as ``{"error": "..."}``; the child stays.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ..childproc import JsonLineChild


def serve(base_url: str) -> None:
    import requests

    from kvpersist.demo.chat import chat_completion

    from ._stack import vllm_metric

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        out: dict[str, Any]
        try:
            if cmd["op"] == "chat":
                r = chat_completion(base_url, cmd.get("model", "cpu-demo"), cmd["messages"],
                                    max_tokens=int(cmd.get("max_tokens", 24)))
                out = {"text": r.text, "ttft_s": r.ttft_s, "total_s": r.total_s,
                       "prompt_tokens": r.prompt_tokens}
            elif cmd["op"] == "metric":
                out = {"value": vllm_metric(base_url, cmd["name"])}
            elif cmd["op"] in ("references", "storm"):
                from bench import traffic

                reqs = [(int(u), int(r), m) for u, r, m in cmd["requests"]]
                if cmd["op"] == "references":
                    refs = traffic.references(base_url, cmd.get("model", "cpu-demo"), reqs,
                                              max_tokens=int(cmd.get("max_tokens", 16)))
                    out = {"answers": [[u, r, t] for (u, r), t in refs.items()]}
                else:
                    recs = traffic.storm(base_url, cmd.get("model", "cpu-demo"), reqs,
                                         phase=str(cmd.get("phase", "")),
                                         spread_s=float(cmd.get("spread_s", 1.0)),
                                         max_tokens=int(cmd.get("max_tokens", 16)))
                    out = {"records": [asdict(r) for r in recs]}
            elif cmd["op"] == "post":
                resp = requests.post(f"{base_url}{cmd['path']}", timeout=60)
                out = {"status": resp.status_code}
            else:
                out = {"error": f"unknown op {cmd['op']!r}"}
        except Exception as exc:  # reported to the test, which asserts on it
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)


class NsClient(JsonLineChild):
    """``with NsClient(wrap, vllm_url) as c: c.chat(messages)``."""

    def __init__(self, wrap: Sequence[str], base_url: str) -> None:
        super().__init__([*wrap, sys.executable, "-m", "tests.fullstack._nsclient", base_url])
        if not self.read().get("ready"):
            self.close()
            raise RuntimeError("the namespace's chat client did not start")

    def call(self, **cmd: Any) -> dict[str, Any]:
        out = self.send(cmd)
        if "error" in out:
            raise AssertionError(f"{cmd['op']} in the namespace: {out['error']}")
        return out

    def chat(self, messages: list[dict[str, str]], max_tokens: int = 24) -> dict[str, Any]:
        return self.call(op="chat", messages=messages, max_tokens=max_tokens)

    def metric(self, name: str) -> float:
        return float(self.call(op="metric", name=name)["value"])

    def post(self, path: str) -> int:
        return int(self.call(op="post", path=path)["status"])


if __name__ == "__main__":
    serve(sys.argv[1])
