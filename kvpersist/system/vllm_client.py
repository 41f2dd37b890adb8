"""vLLM's OpenAI-compatible HTTP API, as kvpersist uses it: readiness (``/health``, which
model and namespace ``/v1/models`` serves), ``/metrics``, completions by token ids and a
streamed chat. Every call follows :mod:`kvpersist.system.http_client`'s policy; nothing else
in kvpersist talks to this port. What the endpoints and metrics are called in each vLLM
release is :mod:`kvpersist.system.vllm_seam`'s business.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from kvpersist.errors import KvpError
from kvpersist.system.http_client import HttpClient, Unreachable, status_error
from kvpersist.system.untrusted import HttpReply


def token_ids(reply: HttpReply) -> list[int] | None:
    """The token ids of a ``/tokenize`` reply: its ``tokens`` when the status is 200 and they
    are all non-negative integers, else None (the caller says why, with the reply)."""
    tokens = reply.object("vLLM's /tokenize").get("tokens")
    if reply.status != 200 or not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        return None
    return tokens


__all__ = ["Unreachable", "VllmClient", "token_ids"]

#: the largest /metrics page read (vLLM's is tens of KiB)
MAX_METRICS_BYTES = 8 << 20


class VllmClient(HttpClient):
    """The API of one vLLM server (``http://host:port``)."""

    def healthy(self, timeout: float | None = None) -> bool:
        """``/health`` answers 200."""
        return self.ok("/health", timeout)

    def models(self, timeout: float | None = None) -> list[dict[str, Any]] | None:
        """``/v1/models``'s entries as ``{"id", "root"}`` (whatever answers on the port may
        send any JSON: only objects are kept); None when it does not answer 200."""
        code, body = self.get_json("/v1/models", timeout)
        if code != 200 or not isinstance(body, dict):
            return None
        data = body.get("data", [])
        return [{"id": m.get("id"), "root": m.get("root")}
                for m in (data if isinstance(data, list) else []) if isinstance(m, dict)]

    def serves(self, namespace: str, served_model_name: str,
               timeout: float | None = None) -> bool:
        """``/health`` answers and ``/v1/models`` lists the served name with the namespace
        as its root: vLLM is up and wired to the namespace (it reaches LMCache under it)."""
        if not self.healthy(timeout):
            return False
        return any(m["root"] == namespace and m["id"] == served_model_name
                   for m in self.models(timeout) or [])

    def metrics_text(self, timeout: float | None = None) -> str:
        """The Prometheus page of ``/metrics``. Raises Unreachable, StatusError for an
        answer that is not 200, KvpError for one past the bound."""
        r = self.request("GET", "/metrics", timeout=timeout, max_bytes=MAX_METRICS_BYTES)
        if r.status != 200:
            raise status_error(r.status, f"{self.base_url}/metrics")
        if r.cut:
            raise KvpError(f"{self.base_url}/metrics answered more than the "
                           f"{MAX_METRICS_BYTES:,} bytes kvpersist reads")
        return r.body.decode("utf-8", "replace")

    def completions(self, body: dict[str, Any], timeout: float | None = None) -> HttpReply:
        """POST ``/v1/completions`` (a prompt of text or token ids)."""
        return self.request("POST", "/v1/completions", json_body=body, timeout=timeout)

    def chat(self, body: dict[str, Any], timeout: float | None = None) -> HttpReply:
        """POST ``/v1/chat/completions`` (not streamed)."""
        return self.request("POST", "/v1/chat/completions", json_body=body, timeout=timeout)

    def tokenize(self, body: dict[str, Any], timeout: float | None = None) -> HttpReply:
        """POST ``/tokenize`` (a prompt, or messages through the chat template)."""
        return self.request("POST", "/tokenize", json_body=body, timeout=timeout)

    @contextlib.contextmanager
    def chat_stream(self, body: dict[str, Any],
                    timeout: float | None = None) -> Iterator[tuple[int, Iterator[bytes]]]:
        """POST ``/v1/chat/completions`` streamed: (status, the server-sent lines)."""
        with self.stream_lines("POST", "/v1/chat/completions", json_body=body,
                               timeout=timeout) as answer:
            yield answer
