"""The gate between a launch and the warm-up child it starts early (I/O).

A launch starts its warm-up child while vLLM still loads (:func:`kvpersist.stack.warm.
readiness.start_warmup`), so that the child's process start, its imports, the deployment's
load, the warm set's token ids and pins are done before vLLM serves. The child then waits
for vLLM to serve the namespace (:func:`wait_serving`) before its first request to the cache
server (the prefetch of the warm set into L1 runs beside the prime and the canary: it touches
the cache server only), and waits at the gate (:func:`wait_open`) before anything it sends
to vLLM (the loads of the warm set into vLLM's prefix cache): the launch opens the gate
(:func:`open_gate`, ``go``) once the canary has passed, or closes it (``stop: why``) when the
canary failed or vLLM did not come up. Nothing reaches vLLM from the warm-up before the
canary's verdict, as when the warm-up ran after it.

The gate is a small file in the state dir, written atomically by the launch (owner-only;
owned by the service user the child runs as), read by the child as untrusted. A child whose
launch is gone (its parent changed) or that waited :data:`MAX_WAIT_S` stops waiting.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from kvpersist.errors import KvpError
from kvpersist.stack.locate import Location
from kvpersist.stack.processes import vllm_ready
from kvpersist.system.files import atomic_write
from kvpersist.system.untrusted import UnreadableFile, read_bytes

GO = "go"
STOP = "stop"
#: seconds between looks at the gate file, and between readiness polls of vLLM
POLL_S = 0.01
SERVING_POLL_S = 0.05
#: the longest a child waits for vLLM or the gate (a launch waits at most its vLLM timeout)
MAX_WAIT_S = 3600.0
#: the bytes a gate file may hold
MAX_BYTES = 4096


class GateClosed(KvpError):
    """The launch closed the gate (or is gone): the warm-up stops before vLLM."""


def open_gate(path: str, why: str = "", *, ids: tuple[int, int] | None = None) -> None:
    """Open the gate at ``path`` (``why`` empty) or close it (``why``: the reason).
    Raises KvpError when it cannot be written."""
    atomic_write(path, GO if not why else f"{STOP}: {why}")
    if ids is not None:
        os.chown(path, *ids, follow_symlinks=False)


def clear(path: str) -> None:
    """Remove a gate left by an earlier launch (absent: nothing to do)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise KvpError(f"cannot remove the warm-up gate {path}: {exc.strerror}") from exc


def look(path: str) -> str | None:
    """None while the gate is not written; ``''`` when it is open; the reason when it is
    closed (an unreadable gate is closed)."""
    try:
        text = read_bytes(path, max_bytes=MAX_BYTES, follow=False).decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    except UnreadableFile as exc:
        return f"the warm-up gate is unreadable: {exc.why}"
    text = text.strip()
    if text == GO:
        return ""
    return text.removeprefix(f"{STOP}:").strip() or "the launch stopped the warm-up"


def _waited(path: str, done: Callable[[], bool], poll_s: float,
            clock: Callable[[], float] = time.monotonic) -> None:
    """Wait until ``done()``; raise GateClosed when the gate closes, the launch that started
    this process is gone or :data:`MAX_WAIT_S` passed."""
    parent, t0 = os.getppid(), clock()
    while True:
        why = look(path)
        if why:
            raise GateClosed(f"stopped by the launch before the load into vLLM: {why}")
        if done():
            return
        if os.getppid() != parent:
            raise GateClosed("the launch that started the warm-up is gone")
        if clock() - t0 > MAX_WAIT_S:
            raise GateClosed(f"the launch did not open the warm-up gate within "
                             f"{MAX_WAIT_S:.0f} s")
        time.sleep(poll_s)


def wait_serving(loc: Location, path: str) -> float:
    """Wait until ``loc``'s vLLM serves the namespace (the launch closes the gate when it
    does not); the seconds waited. Raises GateClosed."""
    t0 = time.monotonic()
    _waited(path, lambda: vllm_ready(loc, 1.0), SERVING_POLL_S)
    return time.monotonic() - t0


def wait_open(path: str) -> float:
    """Wait until the launch opens the gate; the seconds waited. Raises GateClosed."""
    t0 = time.monotonic()
    _waited(path, lambda: look(path) == "", POLL_S)
    return time.monotonic() - t0


__all__ = ["GO", "MAX_WAIT_S", "STOP", "GateClosed", "clear", "look", "open_gate",
           "wait_open", "wait_serving"]
