"""The LMCache server's HTTP admin API, as kvpersist uses it (LMCache 0.5.6's MP server):
health, status, the ``/run_script`` probe, prefetches (L2 -> L1 by token ids) and object
deletion. Every call follows :mod:`kvpersist.system.http_client`'s policy; nothing else in
kvpersist talks to this port.
"""

from __future__ import annotations

from typing import Any

from kvpersist.system.http_client import HttpClient, Unreachable
from kvpersist.system.untrusted import HttpReply

__all__ = ["LMCacheClient", "Unreachable"]


class LMCacheClient(HttpClient):
    """The admin API of one ``lmcache server`` (``http://host:http_port``)."""

    def healthy(self, timeout: float | None = None) -> bool:
        """``/healthcheck`` answers 200."""
        return self.ok("/healthcheck", timeout)

    def status(self, timeout: float | None = None) -> dict[str, Any] | None:
        """``/status`` (L1 usage, the L2 adapters' health, object counts), or None when it
        does not answer 200 with a JSON object."""
        code, body = self.get_json("/status", timeout)
        return body if code == 200 and isinstance(body, dict) else None

    def run_script_status(self, timeout: float | None = None) -> int | None:
        """The status of a POST to ``/run_script`` without a body: 404 while the endpoint is
        disabled (as kvpersist runs the server), 422 when enabled; nothing is ever executed.
        None when nothing answers."""
        code, _ = self.get_json("/run_script", timeout, method="POST")
        return code

    def submit_prefetch(self, body: dict[str, Any], timeout: float | None = None) -> HttpReply:
        """POST ``/cache/prefetches``: 202 with a request id (or ``noop``), 503 until a vLLM
        worker registered the model's KV layout."""
        return self.request("POST", "/cache/prefetches", json_body=body, timeout=timeout)

    def prefetch_status(self, request_id: str, timeout: float | None = None) -> HttpReply:
        """GET ``/cache/prefetches/ID``: ``pending`` or ``completed`` with found/total keys."""
        return self.request("GET", f"/cache/prefetches/{request_id}", timeout=timeout)

    def delete_objects(self, body: dict[str, Any], timeout: float | None = None) -> HttpReply:
        """DELETE ``/cache/objects`` (keys, a tier, an adapter, ``force``)."""
        return self.request("DELETE", "/cache/objects", json_body=body, timeout=timeout)
