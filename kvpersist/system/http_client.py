"""The one policy for HTTP to the servers a deployment runs (the LMCache server's admin port,
vLLM's API port): :class:`HttpClient`, the base of :class:`~kvpersist.system.lmcache_client.
LMCacheClient` and :class:`~kvpersist.system.vllm_client.VllmClient`. Nothing else in
kvpersist talks HTTP to them (``tests/unit/test_architecture.py``).

The policy, the same for every call:

* **timeout**: each client has one (:data:`DEFAULT_TIMEOUT` unless given), a call may pass
  a shorter or longer one; it bounds the connection and each read, and twice it the body;
* **bounded replies**: a body is read up to a cap (:data:`~kvpersist.system.untrusted.
  MAX_HTTP_BYTES` unless the call names another) and parsed as untrusted JSON
  (:func:`~kvpersist.system.untrusted.parse_json`): a server is never trusted with memory;
* **errors**: nothing answering (refused, reset, timed out, a body that trickles past the
  bound) raises :class:`Unreachable`, a :class:`~kvpersist.errors.KvpError` naming the URL
  (:class:`Refused` when the connection itself failed: the server is down);
  every answer, whatever its status, is returned for the caller to judge (``/run_script``'s
  404 is the healthy answer);
* **retries**: none here. The few waits that retry (a prefetch refused with 503 until vLLM
  registers, readiness polls) are the caller's, with its own deadline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from kvpersist.errors import KvpError
from kvpersist.system.untrusted import (
    MAX_HTTP_BYTES,
    HttpReply,
    UnreadableFile,
    http,
    http_lines,
)

#: seconds a call may take unless the client or the call says otherwise
DEFAULT_TIMEOUT = 5.0


class Unreachable(KvpError):
    """Nothing answered: the server is down, not listening, or too slow."""


class Refused(Unreachable):
    """The connection itself failed (nothing listens, or it was reset): the server is down."""


class StatusError(KvpError):
    """A server answered with an error status where only success can be used."""


def status_error(status: int, url: str) -> StatusError:
    """The error of an answer ``status`` from ``url`` (worded as HTTP libraries word it:
    ``HTTPError: 503 Server Error for url ...``)."""
    kind = "Server" if status >= 500 else "Client"
    return StatusError(f"HTTPError: {status} {kind} Error for url {url}")


def _unreachable(url: str, exc: Exception) -> Unreachable:
    import requests  # lazy: kvp-admin's start-up stays light

    cls = Refused if isinstance(exc, requests.ConnectionError) else Unreachable
    return cls(f"{type(exc).__name__}: {url} does not answer "
               f"({' '.join(str(exc).split())[:200]})")


class HttpClient:
    """HTTP to one server at ``base_url`` (``http://host:port``) under the policy above."""

    def __init__(self, base_url: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    def request(self, method: str, path: str, *, json_body: Any = None,
                timeout: float | None = None, max_bytes: int = MAX_HTTP_BYTES) -> HttpReply:
        """``method`` on ``path``: the bounded reply. Raises :class:`Unreachable`."""
        import requests  # lazy: kvp-admin's start-up stays light

        url = self.base_url + path
        try:
            return http(method, url, timeout=self.timeout if timeout is None else timeout,
                        json_body=json_body, max_bytes=max_bytes)
        except requests.RequestException as exc:
            raise _unreachable(url, exc) from None

    def ok(self, path: str, timeout: float | None = None) -> bool:
        """True if GET ``path`` answers 200 within the timeout (never raises)."""
        try:
            return self.request("GET", path, timeout=timeout).status == 200
        except Unreachable:
            return False

    def get_json(self, path: str, timeout: float | None = None,
                 method: str = "GET") -> tuple[int | None, Any]:
        """(status, the JSON body or the escaped text of one that is not JSON); (None, why)
        when nothing answers (never raises)."""
        try:
            r = self.request(method, path, timeout=timeout)
        except Unreachable as exc:
            return None, str(exc)
        try:
            return r.status, r.json(self.base_url + path)
        except UnreadableFile:
            return r.status, r.text()

    @contextlib.contextmanager
    def stream_lines(self, method: str, path: str, *, json_body: Any = None,
                     timeout: float | None = None) -> Iterator[tuple[int, Iterator[bytes]]]:
        """A streamed request: (status, its lines, each bounded:
        :func:`~kvpersist.system.untrusted.http_lines`). Raises :class:`Unreachable` for a
        connection that fails, before or while streaming."""
        import requests  # lazy: kvp-admin's start-up stays light

        url = self.base_url + path
        try:
            with requests.request(method, url, json=json_body, stream=True,
                                  timeout=self.timeout if timeout is None else timeout) as r:
                yield r.status_code, http_lines(r)
        except requests.RequestException as exc:
            raise _unreachable(url, exc) from None
