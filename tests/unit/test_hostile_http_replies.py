"""Issue 40: an HTTP reply of the cache server or vLLM is read with a bound and parsed as
untrusted JSON (:func:`kvpersist.system.untrusted.http`, ``http_lines``).

A real loopback HTTP server this test starts answers every request, by mode, with a body of
64 MiB, a JSON document holding ``NaN`` and a count of ``1e400``, a 100,000-deep document,
or a streamed line that never ends. ``health`` (the cache server's ``/status``),
``forget``'s L1 delete, the warm-up's prefetch poll, vLLM's readiness and the prime read
at most :data:`~kvpersist.system.untrusted.MAX_HTTP_BYTES` of it and report an answer they
cannot use; none raises anything but their documented error, none reads it whole."""

from __future__ import annotations

import json
import resource
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvpersist.errors import KvpError
from kvpersist.stack.conversation import l1 as forget_l1
from kvpersist.stack.warm import prefetch
from kvpersist.system.untrusted import MAX_HTTP_BYTES, UnreadableFile, http

from ..cli import kvp
from ..conftest import clean_env, free_port

MODES = ("huge", "nan", "deep", "endless")


def _handler(mode: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(n)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            try:
                if mode == "huge":
                    block = b" " * (1 << 20)
                    self.wfile.write(b'{"ok": true, "pad": "')
                    for _ in range(64):
                        self.wfile.write(block)
                elif mode == "nan":
                    self.wfile.write(b'{"ok": true, "deleted": NaN, "skipped": 1e400, '
                                     b'"status": "completed", "found_keys": NaN, '
                                     b'"total_keys": 1e400, "data": NaN}')
                elif mode == "deep":
                    self.wfile.write(b"[" * 100_000 + b"]" * 100_000)
                else:  # a streamed line that never ends (64 MiB of it)
                    for _ in range(64):
                        self.wfile.write(b"data: " + b"x" * (1 << 20))
            except OSError:
                pass  # the client stopped reading: what it should do

        do_GET = do_POST = do_DELETE = _answer

    return Handler


@pytest.fixture(params=MODES)
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(request.param))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield request.param, f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_every_reader_bounds_the_reply(server: tuple[str, str]) -> None:
    mode, url = server
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = http("GET", f"{url}/status", timeout=5)
    assert len(r.body) <= MAX_HTTP_BYTES and r.cut == (mode in ("huge", "endless"))
    with pytest.raises(UnreadableFile):
        r.json("the reply")
    assert r.object() == {} and r.text().isprintable()
    with pytest.raises(KvpError) as exc:
        forget_l1.delete_objects(url, [{"k": 1}], tier="l1", timeout=5)
    assert "answered" in str(exc.value)
    with pytest.raises(prefetch.PrefetchFailed):
        prefetch.wait_completed(url, "r1", deadline=__import__("time").monotonic() + 5)
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kb < 64 * 1024, grown_kb  # never the 64 MiB body


def test_health_reads_a_hostile_cache_server(server: tuple[str, str]) -> None:
    mode, url = server
    env = clean_env()
    env.update({"KVP_CACHE_ROOT": "/tmp/kvp-no-such-root-40", "KVP_L2_SERDE": "none",
                "KVP_LMCACHE_HTTP_PORT": url.rsplit(":", 1)[1],
                "KVP_LMCACHE_PORT": str(free_port()), "KVP_VLLM_PORT": url.rsplit(":", 1)[1]})
    res = kvp("health", "cpu-demo", "--json", "--timeout", "5", env=env)
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode in (1, 2), res.stderr
    json.loads(res.stdout)


def test_a_streamed_reply_is_read_line_by_line_with_a_bound(server: tuple[str, str]) -> None:
    """The prime reads vLLM's event stream through ``http_lines``: a line that never ends
    is refused at 1 MiB (before: ``iter_lines`` held it whole)."""
    import requests

    from kvpersist.system.untrusted import MAX_HTTP_LINE_BYTES, http_lines

    mode, url = server
    with requests.get(f"{url}/v1/chat/completions", stream=True, timeout=5) as resp:
        if mode in ("endless", "huge"):
            with pytest.raises(UnreadableFile) as exc:
                for _ in http_lines(resp):
                    pass
            assert f"{MAX_HTTP_LINE_BYTES:,}" in str(exc.value)
        else:
            assert all(len(line) <= MAX_HTTP_LINE_BYTES for line in http_lines(resp))
