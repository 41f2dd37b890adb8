"""A real ``lmcache server`` started from the rendered argv is healthy and uses our L2."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import requests

from ..cli import kvp_json
from ..conftest import VENV_BIN, clean_env, free_port

pytestmark = pytest.mark.integration


def test_rendered_server_starts_healthy_with_nixl_store_dynamic(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    env = dict(clean_env(), KVP_CACHE_ROOT=str(root), KVP_LMCACHE_PORT=str(free_port()),
               KVP_LMCACHE_HTTP_PORT=str(free_port()), KVP_L1_SIZE_GB="1",
               KVP_L2_BUDGET="1G")
    r = kvp_json("render", "cpu-demo", "--json", env=env)
    argv = [str(VENV_BIN / "lmcache"), *r["lmcache_server_argv"][1:]]
    # The cache root and the serde key exist before the server starts (launch's job).
    root.mkdir(mode=0o700)
    key = Path(r["l2_adapter"]["serde"]["master_key_path"])
    key.parent.mkdir(parents=True, mode=0o700)
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    http_port = int(env["KVP_LMCACHE_HTTP_PORT"])
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(env, LMCACHE_DISABLE_BANNER="1"))
    try:
        base = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 90
        health = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                health = requests.get(f"{base}/healthcheck", timeout=2)
                if health.status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        assert health is not None and health.status_code == 200, "server never became healthy"
        adapters = requests.get(f"{base}/config/adapters", timeout=5)
        assert adapters.status_code == 200
        assert "nixl_store_dynamic" in adapters.text
        # /run_script stays disabled
        assert requests.post(f"{base}/run_script", timeout=5).status_code in (404, 405)
        # admin and request ports listen on loopback only
        listening = {(c.laddr.ip, c.laddr.port) for c in
                     psutil.Process(proc.pid).net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN}
        ports = {http_port, int(env["KVP_LMCACHE_PORT"])}
        bound = {ip for ip, port in listening if port in ports}
        assert bound == {"127.0.0.1"}, listening
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
