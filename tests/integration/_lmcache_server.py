"""Start a real, stock ``lmcache server`` with the nixl_store_dynamic L2 adapter for tests.

Usage::

    srv = start_lmcache_server(tmp_path / "cache")
    try:
        srv.bench(start=0, end=4)      # drive it like vLLM's workers do (model "test-model")
        ...
    finally:
        srv.stop()

Reusable by any test module; nothing here is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from ..conftest import free_port

VENV_BIN = Path(sys.executable).parent
LMCACHE = str(VENV_BIN / "lmcache")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    env["LMCACHE_DISABLE_BANNER"] = "1"
    return env


@dataclass
class LMCacheServer:
    """A running server: its ports, cache root, log file, and process."""

    root: Path
    port: int
    http_port: int
    log_path: Path
    proc: subprocess.Popen[bytes]
    argv: list[str] = field(default_factory=list)

    @property
    def rpc_url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def bench(self, start: int = 0, end: int = 4, num_tokens: int = 1024,
              shape: str = "(2,256,16,8,128):float16:4",
              timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Store and retrieve through the MP protocol with ``lmcache bench server``
        (model name ``test-model``). Raises CalledProcessError if the bench fails."""
        argv = [LMCACHE, "bench", "server", "--mode", "cpu", "--transfer-mode", "lmcache_driven",
                "--rpc-url", self.rpc_url, "--url", self.http_url,
                "--num-tokens", str(num_tokens), "--start", str(start), "--end", str(end),
                "--kvcache-shape-spec", shape]
        return subprocess.run(argv, env=_env(), capture_output=True, text=True,
                              timeout=timeout, check=True)

    def status(self) -> dict[str, object]:
        r = requests.get(f"{self.http_url}/status", timeout=5)
        r.raise_for_status()
        return dict(r.json())

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def server_argv(root: Path, port: int, http_port: int, *, l1_size_gb: float = 1,
                max_capacity_gb: str = "2", shard_dirs: bool = False,
                chunk_size: int = 256) -> list[str]:
    """The server command line kvpersist renders (configs/generic/lmcache.yaml: loopback ports,
    auto transfer mode, LRU 0.9/0.1 in L1 and L2, nixl_store_dynamic on POSIX with
    persist_enabled), without a serde, for a cache root."""
    params = {"file_path": str(root), "use_direct_io": "false",
              "max_capacity_gb": max_capacity_gb}
    if shard_dirs:
        params["shard_dirs"] = "true"
    adapter = {"type": "nixl_store_dynamic", "backend": "POSIX", "backend_params": params,
               "persist_enabled": True,
               "eviction": {"eviction_policy": "LRU", "trigger_watermark": 0.9,
                            "eviction_ratio": 0.1}}
    return [LMCACHE, "server", "--host", "127.0.0.1", "--port", str(port),
            "--http-host", "127.0.0.1", "--http-port", str(http_port),
            "--supported-transfer-mode", "auto", "--chunk-size", str(chunk_size),
            "--l1-size-gb", f"{l1_size_gb:g}", "--eviction-policy", "LRU",
            "--eviction-trigger-watermark", "0.9", "--eviction-ratio", "0.1",
            "--l2-adapter", json.dumps(adapter)]


def start_lmcache_server(root: Path, *, l1_size_gb: float = 1, max_capacity_gb: str = "2",
                         shard_dirs: bool = False, log_path: Path | None = None,
                         ready_timeout: float = 120) -> LMCacheServer:
    """Start ``lmcache server`` on free loopback ports with L2 files under ``root`` and wait
    until ``/healthcheck`` answers 200. Raises RuntimeError (with the log tail) if it exits or
    never becomes healthy; the process is stopped in that case."""
    root.mkdir(parents=True, exist_ok=True)
    port, http_port = free_port(), free_port()
    while http_port == port:
        http_port = free_port()
    argv = server_argv(root, port, http_port, l1_size_gb=l1_size_gb,
                       max_capacity_gb=max_capacity_gb, shard_dirs=shard_dirs)
    log_path = log_path or root.parent / f"lmcache-server-{port}.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                start_new_session=True)
    srv = LMCacheServer(root, port, http_port, log_path, proc, argv)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lmcache server exited with {proc.returncode}:\n{srv.log()}")
        try:
            if requests.get(f"{srv.http_url}/healthcheck", timeout=2).status_code == 200:
                return srv
        except requests.RequestException:
            pass
        time.sleep(0.3)
    srv.stop()
    raise RuntimeError(f"lmcache server not healthy after {ready_timeout} s:\n{srv.log()}")
