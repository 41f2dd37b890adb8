"""``kvp-admin launch --warmup-only --vllm-pid PID`` (the vLLM unit's ExecStartPost with
$MAINPID): the wait for vLLM ends as soon as that process exits, instead of after the whole
deadline. Under the real systemd a vLLM that died while it started kept its unit
"activating (start-post)" for the deadline (29.5 min) and its restart waited as long
(docs/deployment.md, "The vLLM unit")."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from ..cli import kvp, parse_json
from ..conftest import clean_env, free_port


def _env(tmp_path: Path) -> dict[str, str]:
    return dict(clean_env(), KVP_CACHE_ROOT=str(tmp_path / "cache"),
                KVP_VLLM_PORT=str(free_port()), KVP_MODEL_PATH=str(tmp_path))


def test_the_wait_ends_when_the_vllm_process_has_exited(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    args = ("launch", "cpu-demo", "--warmup-only", "--deadline", "600", "--vllm-pid",
            str(dead.pid), "--json")
    t0 = time.monotonic()
    r = kvp(*args, env=_env(tmp_path))
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    warmup = parse_json(args, r)["warmup"]
    assert warmup["state"] == "failed", warmup
    assert warmup["detail"] == (f"vLLM (pid {dead.pid}) exited before it served the "
                                "namespace: not primed"), warmup
    assert took < 60, took  # not the 500 s the deadline leaves for the wait


def test_a_live_vllm_process_is_waited_for_until_the_deadline(tmp_path: Path) -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) as live:
        try:
            args = ("launch", "cpu-demo", "--warmup-only", "--deadline", "5", "--vllm-pid",
                    str(live.pid), "--json")
            r = kvp(*args, env=_env(tmp_path))
        finally:
            live.kill()
    assert r.returncode == 0, r.stderr
    warmup = parse_json(args, r)["warmup"]
    assert warmup["detail"] == "vLLM did not serve the namespace within 1 s: not primed"


def test_vllm_pid_needs_warmup_only(tmp_path: Path) -> None:
    r = kvp("launch", "cpu-demo", "--check", "--vllm-pid", "1", env=_env(tmp_path))
    assert r.returncode == 2
    assert "--vllm-pid goes with --warmup-only" in r.stderr
