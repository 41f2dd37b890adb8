"""Shared fixtures: the repository root, relocated deployments, free loopback ports, the
generated tiny demo model (one per session: per test lane)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvpersist.system import procs

if TYPE_CHECKING:
    from tests.integration._redis import Redis

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


#: ``LO-HI``: the ports this pytest process may hand out (scripts/test.sh gives each of its
#: lanes its own range, below the kernel's ephemeral range, so that two lanes never pick the
#: same port and no bind to port 0 anywhere can land on one); unset: any free port
PORT_RANGE = os.environ.get("TEST_PORT_RANGE", "")
_range_next: list[int] = []


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, never one handed out before in this test
    session (:func:`kvpersist.system.procs.free_port`): two listeners of one relocated
    deployment given the same port make its config invalid (exit 2). Under
    ``TEST_PORT_RANGE`` the port comes from that range only (probed by a bind); a range
    handed out in full starts over at its first port, so a port comes back only after every
    other port of the range was handed out (thousands of tests later, its deployment long
    gone; one still listening fails the bind and is skipped)."""
    if not PORT_RANGE:
        return procs.free_port("127.0.0.1")
    lo, hi = (int(x) for x in PORT_RANGE.split("-"))
    if not _range_next:
        _range_next.append(lo)
    for _ in range(hi - lo + 1):
        port = _range_next[0]
        _range_next[0] = lo if port >= hi else port + 1
        if procs.port_bindable("127.0.0.1", port):
            return port
    raise RuntimeError(f"TEST_PORT_RANGE {PORT_RANGE}: no port of it is free")


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


#: test directories whose every test needs a heavy outside piece -> the marker that says so
#: (``tests/infra`` converges a host with ansible-playbook, like ``tests/deploy``)
DIRECTORY_MARKERS = {"fullstack": "fullstack", "deploy": "deploy", "infra": "deploy"}
#: names that, imported by a test module, mean it starts real lmcache server processes
SERVER_HELPERS = frozenset({"Stack", "start_lmcache_server"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark what needs servers, vLLM, systemd or ansible, so that the fast lane
    ``-m "not integration and not fullstack and not deploy"`` selects none of it even if a
    module forgets its ``pytestmark``."""
    for item in items:
        try:
            top = Path(str(item.path)).resolve().relative_to(REPO / "tests").parts[0]
        except ValueError:
            continue
        marker = DIRECTORY_MARKERS.get(top)
        if marker is not None:
            item.add_marker(marker)
        module = getattr(item, "module", None)
        uses_server = "stack" in getattr(item, "fixturenames", ()) or (
            module is not None and SERVER_HELPERS & set(vars(module)))
        if uses_server and marker is None:
            item.add_marker("integration")


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    """A real redis-server (Debian's package) with an ACL user and password on a free loopback
    port, its data under the test's temp dir; stopped after the test."""
    from tests.integration._redis import start_redis

    r = start_redis(tmp_path / "store")
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo model, generated once per session (vLLM serves it in the full stack)."""
    from kvpersist.demo.model import generate_model

    return generate_model("tiny", tmp_path_factory.mktemp("models") / "tiny")
