"""Half-loopback binds: refused without their own opt-in (exit 2, naming key and fix), and
once opted in shown by render (text and --json), launch --check and health."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..cli import kvp
from ..conftest import clean_env, free_port


def relocated(tmp_path: Path, **extra: str) -> dict[str, str]:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700, exist_ok=True)
    return {**clean_env(), "KVP_CACHE_ROOT": str(root), "KVP_LMCACHE_PORT": str(free_port()),
            "KVP_LMCACHE_HTTP_PORT": str(free_port()), "KVP_VLLM_PORT": str(free_port()),
            **extra}


@pytest.mark.parametrize("host_key,allow_key", [
    ("KVP_LMCACHE_HOST", "KVP_ALLOW_REMOTE_LMCACHE"),
    ("KVP_LMCACHE_HTTP_HOST", "KVP_ALLOW_REMOTE_LMCACHE_HTTP"),
])
@pytest.mark.parametrize("argv", [["render", "cpu-demo"], ["launch", "cpu-demo", "--check"],
                                  ["health", "cpu-demo", "--no-vllm", "--timeout", "1"]],
                         ids=lambda a: a[0])
def test_half_loopback_bind_alone_is_refused(tmp_path: Path, host_key: str, allow_key: str,
                                             argv: list[str]) -> None:
    res = kvp(*argv, env=relocated(tmp_path, **{host_key: "0.0.0.0"}))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert f"environment {host_key}" in res.stderr and allow_key in res.stderr


OPTED_IN = {"KVP_LMCACHE_HTTP_HOST": "0.0.0.0", "KVP_ALLOW_REMOTE_LMCACHE_HTTP": "10.9.0.0/16"}


def test_render_shows_an_opted_in_bind(tmp_path: Path) -> None:
    env = relocated(tmp_path, **OPTED_IN)
    text = kvp("render", "cpu-demo", env=env)
    assert text.returncode == 0, text.stderr
    assert "NOTE: lmcache_http binds 0.0.0.0:" in text.stderr
    assert "KVP_ALLOW_REMOTE_LMCACHE_HTTP" in text.stderr
    line = [ln for ln in text.stdout.splitlines() if ln.strip().startswith("lmcache_http")]
    assert line and "NOT loopback, peers 10.9.0.0/16" in line[0]
    data = json.loads(kvp("render", "cpu-demo", "--json", env=env).stdout)
    by_name = {lst["component"]: lst for lst in data["listeners"]}
    assert by_name["lmcache_http"] == {
        "component": "lmcache_http", "host": "0.0.0.0", "port": int(env["KVP_LMCACHE_HTTP_PORT"]),
        "loopback": False, "allow_key": "KVP_ALLOW_REMOTE_LMCACHE_HTTP",
        "allowed_peers": ["10.9.0.0/16"]}
    assert by_name["lmcache"]["loopback"] and by_name["vllm"]["loopback"]


def test_launch_check_notes_an_opted_in_bind(tmp_path: Path) -> None:
    res = kvp("launch", "cpu-demo", "--check", "--no-vllm", "--json",
              env=relocated(tmp_path, **OPTED_IN))
    notes = json.loads(res.stdout)["notes"]
    assert [n for n in notes if n.startswith("network: ") and "0.0.0.0" in n
            and "10.9.0.0/16" in n and "NOT loopback" in n], notes


def test_health_shows_an_opted_in_bind(tmp_path: Path) -> None:
    res = kvp("health", "cpu-demo", "--no-vllm", "--json", "--timeout", "1",
              env=relocated(tmp_path, **OPTED_IN))
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["network.lmcache_http"]["status"] == "ok"
    assert "10.9.0.0/16" in checks["network.lmcache_http"]["detail"]
    assert "network.lmcache" not in checks and "network.vllm" not in checks
