"""The 5-minute soak (issue 21): bench/soak.py as it runs for an hour in docs/benchmarks.md, cut
to five minutes — real vLLM (CPU build, float32) and a real lmcache server, rounds of returning
and new users, and beside them, at random, restarts of both, of vLLM only and of the server
only, kill -9 of each, warm-ups; on timers ``prune --to-budget --apply`` and ``verify
--apply``; L1 and the L2 budget smaller than the working set (LMCache's LRU evicts while
prefetches run). Asserted from its summary: every output equal to its reference (0 wrong),
every request served in the end, errors only of the restart window's kinds, the planted
operator files untouched, the bytes under the root never past the budget + reserve (or the
worst case a start of the server announced, counted in the summary)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import REPO, clean_env

pytestmark = [pytest.mark.integration, pytest.mark.fullstack]

MINUTES = 5


def test_five_minute_soak_never_changes_an_output(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--minutes",
                        str(MINUTES), "--workdir", str(tmp_path / "work"), "--out", str(out),
                        "--users", "6", "--turnover", "2", "--prune-every", "20",
                        "--verify-every", "30", "--seed", "5"],
                       cwd=REPO, env=clean_env(), capture_output=True, text=True,
                       timeout=MINUTES * 60 + 900)
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    s = doc["summary"]
    print("\n" + json.dumps({k: v for k, v in s.items() if k != "phases"}, indent=1))
    assert s["wrong_outputs"] == 0, doc["wrong"][:5]
    assert s["unserved"] == 0 and s["outputs_compared"] > 0, s
    assert not s["aborted"], s["aborted"]
    # the restart window's errors (docs/persistence.md, "Production traffic"): every such
    # request was sent again and then got its reference answer
    assert set(s["errors"]) <= {"connect", "reset", "stream", "http-500", "finish-abort",
                                "finish-None"}, s["errors"]
    assert s["foreign_touched"] == [], s["foreign_touched"]
    # the budget + reserve, or the worst case a start of the server announced (its warning)
    bound = max(s["budget_bytes"] + s["reserve_bytes"], s["announced_worst_bytes"])
    assert s["disk_high_water_bytes"] <= bound, s
    assert s["prunes"] >= 1 and s["verifies"] >= 1, s
    assert not s["prune_failures"] and not s["verify_failures"], s
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
