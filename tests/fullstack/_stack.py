"""Test helpers for tests that start real processes through ``kvp-admin``.

``Stack`` is one relocated deployment (temp cache root, free loopback ports, an optional
model directory) driven through the real CLI in subprocesses. Its ``cleanup`` stops what
the deployment started and then kills, by pid, any process still carrying the unique temp
cache root in its command line or environment-derived paths (never by name).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from .. import cli
from ..conftest import clean_env, free_port

KVP_ADMIN = cli.KVP_ADMIN


class Stack:
    def __init__(self, tmp: Path, config: str = "cpu-demo", model: Path | None = None,
                 root: Path | None = None, **extra: str) -> None:
        self.tmp = tmp
        self.root = root or tmp / "cache"
        self.config = config
        self.env = dict(clean_env())
        self.env.update({
            "KVP_CACHE_ROOT": str(self.root),
            "KVP_LMCACHE_PORT": str(free_port()),
            "KVP_LMCACHE_HTTP_PORT": str(free_port()),
            "KVP_VLLM_PORT": str(free_port()),
            "KVP_L1_SIZE_GB": "1",
            "KVP_L2_BUDGET": "2G",
            "KVP_L2_RESERVE": "1M",
        })
        if model is not None:
            self.env["KVP_MODEL_PATH"] = str(model)
        self.env.update(extra)
        #: what every ``kvp-admin`` call runs under (``ip netns exec NS``: another host)
        self.wrapper: tuple[str, ...] = ()

    # -- CLI
    def kvp(self, *args: str, check: bool = False,
            timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return cli.kvp(*args, env=self.env, timeout=timeout, check=check,
                       wrapper=self.wrapper)

    def kvp_json(self, *args: str, check: bool = True) -> Any:
        """The command's JSON document; an AssertionError showing the exit code, stdout and
        stderr when stdout is not JSON or is the error document (kvpersist.error/1)."""
        r = self.kvp(*args, "--json", check=check)
        try:
            doc = json.loads(r.stdout)
        except json.JSONDecodeError as exc:
            doc, why = None, f"stdout is not JSON ({exc})"
        else:
            why = "an error document" if isinstance(doc, dict) and \
                doc.get("schema") == "kvpersist.error/1" else ""
        if why:
            raise AssertionError(f"kvp-admin {' '.join(args)} --json -> {r.returncode}: {why}"
                                 f"\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}")
        return doc

    def launch(self, *args: str) -> Any:
        return self.kvp_json("launch", self.config, *args)

    def stop(self) -> Any:
        return self.kvp_json("stop", self.config)

    # -- facts
    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.env['KVP_LMCACHE_HTTP_PORT']}"

    @property
    def rpc(self) -> str:
        return f"tcp://127.0.0.1:{self.env['KVP_LMCACHE_PORT']}"

    @property
    def vllm_url(self) -> str:
        return f"http://127.0.0.1:{self.env['KVP_VLLM_PORT']}"

    @property
    def state_dir(self) -> Path:
        """KVP_STATE_DIR, by default beside the cache root."""
        default = self.root.parent / ".kvpersist" / self.root.name
        return Path(self.env.get("KVP_STATE_DIR", str(default)))

    @property
    def pid_file(self) -> Path:
        """The cache server's pid file: per deployment, in its state dir."""
        return self.state_dir / "pids" / f"{Path(self.config).name}.lmcache.pid"

    @property
    def server_log(self) -> Path:
        return self.state_dir / "logs" / "lmcache-server.log"

    @property
    def vllm_log(self) -> Path:
        return self.state_dir / "logs" / "vllm.log"

    def connector_degraded(self) -> bool:
        """Whether vLLM's LMCache connector is in its degraded mode now (serving without the
        cache: no lookups, no stores): each of its heartbeats (the scheduler's and the
        worker's) logs its entry into the mode and its recovery, so more entries than
        recoveries in vLLM's log means one is still degraded."""
        text = self.vllm_log.read_text(errors="replace") if self.vllm_log.exists() else ""
        return text.count("entering degraded mode") > text.count("resuming normal operation")

    def render(self) -> Any:
        return self.kvp_json("render", self.config)

    def chunk_files(self, prefix: str = "") -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir()
                      if p.name.endswith(".bin") and p.name.startswith(prefix))

    # -- teardown
    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.kvp("stop", self.config, timeout=120)
        marker = str(self.root)
        mine = []
        for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                cwd = p.info.get("cwd") or ""
            except (psutil.Error, TypeError):
                continue
            if p.pid != os.getpid() and (marker in cmd or cwd.startswith(marker)):
                mine.append(p)
        for p in mine:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(mine, timeout=10)


def wait_until(pred: Any, timeout: float, interval: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def vllm_metric(base_url: str, name: str) -> float:
    """Sum of a Prometheus counter from vLLM's /metrics (0 if absent)."""
    import requests

    total = 0.0
    for line in requests.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def l2_hits_in_log(log: Path) -> list[int]:
    """Per-request L2 hit counts the cache server logged (``... (x L1, y L2)``)."""
    return l2_hits_in_text(log.read_text(errors="replace") if log.exists() else "")


def l2_hits_in_text(text: str) -> list[int]:
    """Per-request L2 hit counts in the cache server's log ``text``."""
    import re

    return [int(m) for m in re.findall(r"retained keys \(\d+ L1, (\d+) L2\)", text)]
