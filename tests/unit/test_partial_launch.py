"""Restarting one component: ``launch`` starts whatever of the cache server and vLLM does not
run (they are independent processes), ``stop``/``restart --only`` name one of them. The
decision is pure (``Running.to_start``); the full stack proves the processes
(tests/fullstack/test_traffic_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpersist.errors import CheckFailed
from kvpersist.stack.launch import Running
from kvpersist.system.procs import PidState

from ..cli import kvp_in_process
from ..conftest import clean_env, free_port

UP = PidState("running", 11, pid_file="/s/server.pid")
VUP = PidState("running", 22, pid_file="/s/vllm.pid")
DOWN = PidState("absent")
STALE = PidState("stale", 33, "not ours")


@pytest.mark.parametrize(("server", "vllm", "with_vllm", "mode", "want"), [
    (DOWN, DOWN, True, "process", (True, True)),
    (STALE, STALE, True, "process", (True, True)),
    (UP, DOWN, True, "process", (False, True)),       # vLLM alone, beside the server
    (DOWN, VUP, True, "process", (True, False)),      # the server alone; vLLM reconnects
    (DOWN, None, False, "process", (True, False)),    # --no-vllm
    (DOWN, None, True, "container", (True, True)),
    (UP, None, True, "container", None),              # a container is not tracked: refused
    (UP, VUP, True, "process", None),
    (UP, None, False, "process", None),
])
def test_launch_starts_what_does_not_run(server: PidState, vllm: PidState | None,
                                         with_vllm: bool, mode: str,
                                         want: tuple[bool, bool] | None) -> None:
    running = Running(server, vllm if mode == "process" and with_vllm else None)
    if want is None:
        with pytest.raises(CheckFailed, match="already running: the cache server \\(pid 11"):
            running.to_start(with_vllm=with_vllm, vllm_mode=mode)
    else:
        assert running.to_start(with_vllm=with_vllm, vllm_mode=mode) == want


def test_stop_and_restart_refuse_what_cannot_work(tmp_path: Path) -> None:
    env = {**clean_env(), "KVP_CACHE_ROOT": str(tmp_path / "cache"),
           "KVP_LMCACHE_PORT": str(free_port()), "KVP_LMCACHE_HTTP_PORT": str(free_port()),
           "KVP_VLLM_PORT": str(free_port())}
    r = kvp_in_process("stop", "cpu-demo", "--no-vllm", "--only", "vllm", env=env)
    assert r.returncode == 2 and "--no-vllm stops only the cache server" in r.stderr
    r = kvp_in_process("restart", "cpu-demo", "--only", "both", env=env)
    assert r.returncode == 2 and "'both' is not one of 'vllm', 'server'" in r.stderr
    r = kvp_in_process("restart", "cpu-demo", "--only", "vllm", env={
        **env, "KVP_IMAGE": "vllm/vllm-openai:v0.32.0", "KVP_CONTAINER_NAME": "kvp-test",
        "KVP_DEVICE": "cuda"})
    assert r.returncode == 2 and "--only needs vLLM as a process" in r.stderr, r.stderr
    # nothing runs: stop --only names one process and stops nothing else
    doc = kvp_in_process("stop", "cpu-demo", "--only", "vllm", "--json", env=env)
    assert doc.returncode == 0, doc.stderr
    assert '"what": "vLLM"' in doc.stdout and "lmcache server" not in doc.stdout
