"""Shared fixtures: the repository root, relocated deployments, free loopback ports."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def relocated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point every deployment at a temp cache root and free ports, via the environment
    (deployment keys only; identity keys cannot be overridden)."""
    env = {
        "KVP_CACHE_ROOT": str(tmp_path / "cache"),
        "KVP_LMCACHE_PORT": str(free_port()),
        "KVP_LMCACHE_HTTP_PORT": str(free_port()),
        "KVP_VLLM_PORT": str(free_port()),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def clean_env() -> dict[str, str]:
    """os.environ without any KVP_ variables (for subprocesses)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
