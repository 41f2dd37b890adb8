"""Issue 40: every reply of the shared tier's store is read with a bound, and one that is not
what Redis/Valkey answers is a store problem, never a traceback.

The store is a real loopback TCP listener this test starts (:class:`HostileStore`), speaking
just enough RESP to be connected to: it reads each command and answers, by mode,

* ``ok``: ``+OK`` to everything (the handshake included: ``AttributeError`` in ``fleet
  status`` before);
* ``bulk``: announces a 2 GiB reply (``$2147483647``) to every data command and streams zeros
  (``MemoryError`` in ``fleet status --json``, ``upgrade plan``, ``metrics`` before);
* ``array``: announces an array of 2**31 items and streams ``:1``;
* ``line``: a status line that never ends;
* ``garbage``: bytes that are no RESP at all.

Every command that talks to the store runs as a user runs it (``kvp-admin`` under
tests/hostile.py: 512 MiB of address space, an alarm, an output bound) and exits with its
documented code: ``fleet status`` 2 (the store unreachable: nothing checked), ``upgrade
plan`` 0 with the store listed as a problem, ``metrics`` 1 (its documented "a store is
down"), ``report``/``prune --tier shared`` 1 naming the store, ``health`` degraded or down,
never a traceback."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from ..conftest import clean_env, free_port
from ..hostile import HostileRunner, Outcome, assert_all_bounded

NS = "kvp-8a8877c212dbb9f802c2eb354e22b53a"  # configs/cpu-demo
MODES = ("ok", "bulk", "array", "line", "garbage")
#: what the handshake gets in the modes that let it through (AUTH, CLIENT SETINFO, PING)
_HANDSHAKE = {b"AUTH": b"+OK\r\n", b"CLIENT": b"+OK\r\n", b"SELECT": b"+OK\r\n",
              b"PING": b"+PONG\r\n"}


def _command(f: BinaryIO) -> list[bytes] | None:
    """One RESP command (an array of bulk strings) from the client, or None at its end."""
    line = f.readline()
    if not line:
        return None
    if not line.startswith(b"*"):
        return [line.strip()]
    out = []
    for _ in range(int(line[1:])):
        n = int(f.readline()[1:])
        out.append(f.read(n + 2)[:-2])
    return out


class HostileStore:
    """A loopback listener answering every connection in ``mode`` (see the module)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sent = 0
        self.commands: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def _handle(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        with contextlib.suppress(OSError, ValueError), conn:
            while (cmd := _command(f)) is not None:
                name = cmd[0].upper()
                self.commands.append(name)
                if self.mode == "ok":
                    self._send(conn, b"+OK\r\n")
                    continue
                if name in _HANDSHAKE:
                    self._send(conn, _HANDSHAKE[name])
                    continue
                head, unit = {"bulk": (b"$2147483647\r\n", b"\0" * 65536),
                              "array": (b"*2147483647\r\n", b":1\r\n" * 16384),
                              "line": (b"+", b"x" * 65536),
                              "garbage": (b"", b"\x00\xff\x13garbage" * 6000)}[self.mode]
                self._send(conn, head)
                for _ in range(2 << 20 if self.mode != "garbage" else 1):  # until dropped
                    self._send(conn, unit)
                if self.mode == "garbage":
                    self._send(conn, b"\r\n")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def runner() -> Iterator[HostileRunner]:
    with HostileRunner() as h:
        yield h


def env_for(tmp_path: Path, port: int) -> dict[str, str]:
    secret = tmp_path / "secret"
    secret.write_text("username=kvp\npassword=pw\n")
    secret.chmod(0o600)
    root = tmp_path / "cache"
    root.mkdir(mode=0o700, exist_ok=True)
    env = clean_env()
    env.update({"KVP_CACHE_ROOT": str(root), "KVP_SHARED_TIER": f"valkey://127.0.0.1:{port}",
                "KVP_SHARED_TIER_SECRET_FILE": str(secret), "KVP_L2_SERDE": "none",
                "KVP_LMCACHE_PORT": str(free_port()), "KVP_LMCACHE_HTTP_PORT": str(free_port()),
                "KVP_VLLM_PORT": str(free_port())})
    return env


#: (argv, the exit codes the command documents for a store that cannot serve)
COMMANDS: list[tuple[list[str], tuple[int, ...]]] = [
    (["fleet", "status", "--config", "cpu-demo", "--json", "--timeout", "2"], (2,)),
    (["fleet", "status", "--config", "cpu-demo", "--timeout", "2"], (2,)),
    (["upgrade", "plan", "cpu-demo", "cpu-demo", "--json"], (0,)),
    (["metrics", "cpu-demo", "--no-vllm", "--timeout", "2"], (1,)),
    (["report", "--tier", "shared", "--config", "cpu-demo", "--json"], (1,)),
    (["prune", "--tier", "shared", "--namespace", NS, "--config", "cpu-demo", "--force",
      "--json"], (1,)),
    (["prune", "--tier", "shared", "--namespace", NS, "--config", "cpu-demo", "--force",
      "--apply", "--json"], (1,)),
    (["health", "cpu-demo", "--no-vllm", "--json", "--timeout", "2"], (1, 2)),
]


@pytest.mark.parametrize("mode", MODES)
def test_every_store_client_bounds_what_the_store_sends(mode: str, tmp_path: Path,
                                                       runner: HostileRunner) -> None:
    store = HostileStore(mode)
    try:
        env = env_for(tmp_path, store.port)
        outcomes: list[Outcome] = []
        for argv, codes in COMMANDS:
            o = runner.run(*argv, env=env, timeout=60)
            outcomes.append(o)
            assert_all_bounded([o], allowed=codes)
            assert "MemoryError" not in o.stderr and "AttributeError" not in o.stderr
            if "--json" in argv:
                doc = json.loads(o.stdout)
                text = json.dumps(doc)
                assert "127.0.0.1" in text or "store" in text, text[:500]
        plan = json.loads(outcomes[2].stdout)
        assert any("shared tier" in p for p in plan["problems"]), plan["problems"]
        fleet = json.loads(outcomes[0].stdout)
        assert fleet["schema"] == "kvpersist.error/1" and fleet["exit_code"] == 2
        if mode in ("bulk", "array", "line"):
            assert "kvpersist reads" in fleet["error"], fleet["error"]
        # no command read more than a bounded part of what the store sent
        assert max(o.maxrss_kb for o in outcomes) < 400_000
    finally:
        store.close()
