"""The cache server's warm-prefetch API (I/O, HTTP): ``POST /cache/prefetches`` and
``GET /cache/prefetches/{id}`` (LMCache 0.5.6, ``lmcache/v1/multiprocess/http_apis/
cache_api.py``).

A submit answers 202 with ``{"request_id", "chunks", "status": "submitted"}``, or
``{"chunks": 0, "status": "noop"}`` for fewer tokens than one chunk; 503 until a vLLM worker
has registered the model's KV layout (and while the server is starting), which is retried
until the deadline. A poll answers ``pending`` or, once, ``completed`` with ``found_keys`` and
``total_keys`` (keys: one per chunk and TP rank); the completed job is then forgotten.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpersist.errors import KvpError
from kvpersist.system.http_client import Unreachable
from kvpersist.system.lmcache_client import LMCacheClient
from kvpersist.system.untrusted import HttpReply

#: seconds between retries of a 503 / refused connection, and the longest between polls
#: (the first polls come sooner: FIRST_POLL_S, doubled each time up to POLL_S)
RETRY_S = 1.0
POLL_S = 0.2
FIRST_POLL_S = 0.01


class PrefetchFailed(KvpError):
    """The server refused, failed, or did not answer in time."""


@dataclass(frozen=True)
class Submitted:
    """One accepted prefetch: its id (None for a noop) and the chunks it asked for."""

    request_id: str | None
    chunks: int


@dataclass(frozen=True)
class Completed:
    """One finished prefetch, in keys (one per chunk and TP rank)."""

    found_keys: int
    total_keys: int


def submit(base_url: str, model_name: str, world_size: int, token_ids: Sequence[int], *,
           deadline: float, on_wait: Callable[[str], None] | None = None,
           clock: Callable[[], float] = time.monotonic) -> Submitted:
    """Submit a warm prefetch; retry 503 and refused connections until ``deadline`` (a
    ``clock`` value). Raises PrefetchFailed on any other answer or at the deadline."""
    client = LMCacheClient(base_url)
    body = {"model_name": model_name, "world_size": world_size,
            "token_ids": list(token_ids), "cache_salt": ""}
    last = ""
    while True:
        try:
            r = client.submit_prefetch(body, timeout=max(1.0, min(30.0, deadline - clock())))
        except Unreachable as exc:
            last = str(exc)
        else:
            if r.status == 202:
                doc = r.object()
                if doc.get("status") == "noop":
                    return Submitted(None, 0)
                rid, chunks = doc.get("request_id"), doc.get("chunks")
                if isinstance(rid, str) and isinstance(chunks, int):
                    return Submitted(rid, chunks)
                raise PrefetchFailed("unexpected answer to POST /cache/prefetches: "
                                     f"{str(doc)[:300]}")
            if r.status != 503:
                raise PrefetchFailed(f"POST /cache/prefetches answered {r.status}: "
                                     f"{_detail(r)}")
            last = f"the cache server answers 503: {_detail(r)}"
        if clock() + RETRY_S > deadline:
            raise PrefetchFailed(f"gave up waiting: {last}")
        if on_wait is not None:
            on_wait(last)
        time.sleep(RETRY_S)


def wait_completed(base_url: str, request_id: str, *, deadline: float,
                   clock: Callable[[], float] = time.monotonic) -> Completed:
    """Poll one prefetch until it completes. Raises PrefetchFailed at the deadline, on an
    unknown id or an unexpected answer."""
    client = LMCacheClient(base_url)
    pause = FIRST_POLL_S
    while True:
        try:
            r = client.prefetch_status(request_id,
                                       timeout=max(1.0, min(30.0, deadline - clock())))
        except Unreachable as exc:
            raise PrefetchFailed(f"polling prefetch {request_id}: {exc}") from None
        if r.status != 200:
            raise PrefetchFailed(f"GET /cache/prefetches/{request_id} answered "
                                 f"{r.status}: {_detail(r)}")
        doc = r.object()
        if doc.get("status") == "completed":
            found, total = doc.get("found_keys"), doc.get("total_keys")
            if isinstance(found, int) and isinstance(total, int) and _count(found) \
                    and _count(total):
                return Completed(found, total)
            raise PrefetchFailed(f"unexpected answer for prefetch {request_id}: "
                                 f"{str(doc)[:300]}")
        if clock() + pause > deadline:
            raise PrefetchFailed(f"prefetch {request_id} still {doc.get('status')} at the "
                                 "deadline (--wait)")
        time.sleep(pause)
        pause = min(POLL_S, pause * 2)


def _count(value: Any) -> bool:
    """A count a reply may hold: a whole number from 0 to 2**63 - 1."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def _detail(r: HttpReply) -> str:
    doc = r.object()
    detail = doc.get("detail", doc.get("error"))
    return str(detail)[:300] if detail is not None else r.text()
