"""What the canary costs a launch: ``restart --only vllm`` with the canary against the same
restart with ``--no-canary``, paired and alternating, on one relocated cpu-demo deployment
(the demo's tiny generated model, vLLM's CPU build, a real lmcache server; no warm set, so the
launch primes vLLM and then runs the canary), plus the canary's own seconds as the launch
reports them (docs/benchmarks.md, "Canary: cost at launch").

usage: python bench/canary_cost.py [--rounds N] [--out FILE]   (about 1 minute a round)
Prints and writes one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvpersist.demo.model import generate_model  # noqa: E402
from tests.fullstack._stack import Stack  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    doc: dict[str, Any] = {"schema": "kvpersist.bench.canary-cost/1", "rounds": []}
    with tempfile.TemporaryDirectory(prefix="kvp-canary-cost-") as tmp:
        model = generate_model("tiny", Path(tmp) / "models" / "tiny")
        (Path(tmp) / "dep" / "cache").mkdir(parents=True, mode=0o700)
        s = Stack(Path(tmp) / "dep", model=model)
        try:
            first = s.launch()
            doc["first_launch_canary"] = first["canary"]

            def restart(*extra: str) -> tuple[float, dict[str, Any]]:
                t0 = time.monotonic()
                out = s.kvp_json("restart", s.config, "--only", "vllm", *extra)
                return time.monotonic() - t0, out["launch"]

            for _ in range(a.rounds):
                with_s, launch = restart()
                without_s, _ = restart("--no-canary")
                c = launch["canary"]
                doc["rounds"].append({
                    "with_canary_s": round(with_s, 3), "without_canary_s": round(without_s, 3),
                    "ratio": round(with_s / without_s, 4), "canary_s": c["seconds"],
                    "canary_state": c["state"], "canary_path": c["path"],
                    "vllm_to_serve_s": launch["vllm"]["seconds_to_ready"]})
                print(json.dumps(doc["rounds"][-1]), flush=True)
            s.stop()
        finally:
            s.cleanup()
    r = doc["rounds"]
    doc["median"] = {
        "with_canary_s": statistics.median(x["with_canary_s"] for x in r),
        "without_canary_s": statistics.median(x["without_canary_s"] for x in r),
        "ratio": statistics.median(x["ratio"] for x in r),
        "canary_s": statistics.median(x["canary_s"] for x in r),
        "canary_share_of_restart": statistics.median(
            x["canary_s"] / x["with_canary_s"] for x in r)}
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
