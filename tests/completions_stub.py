"""A stand-in for vLLM's ``/v1/completions`` in the unit tests of the warm-up's own requests
(stack/warm_compute, stack/warm_load): it records every request and answers with the status the
test sets. The same requests against real vLLM and a real cache server are in the full-stack
tests (tests/fullstack/test_persistence_e2e.py, tests/fullstack/test_readiness_e2e.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class CompletionsStub(BaseHTTPRequestHandler):
    #: the status of every answer; anything but 200 answers :attr:`refusal`
    status = 200
    refusal = b"too long"
    #: each request: its path and its JSON body
    seen: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        n = int(self.headers.get("Content-Length", "0"))
        type(self).seen.append({"path": self.path, "body": json.loads(self.rfile.read(n))})
        payload = b'{"choices": [{"text": "x"}]}' if self.status == 200 else self.refusal
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


#: a running stub: its base URL and its handler class
Stub = tuple[str, type[CompletionsStub]]


@contextmanager
def completions_stub() -> Iterator[Stub]:
    """A stub on a free loopback port: its base URL and its handler class (``seen``,
    ``status``), fresh for each use."""
    handler = type("Stub", (CompletionsStub,), {"seen": [], "status": 200})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()
