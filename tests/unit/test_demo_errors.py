"""``kvp-admin demo`` fails with one clear line, never a traceback.

Every way a step of the demo can fail is a KvpError (kvpersist's own errors as they are, any
other a DemoFailed naming the step, the error and the fix), so ``cli.main`` prints one
``kvp-admin: ...`` line and exits non-zero. Provoked here with real small inputs: a working
directory under a file, a hub directory holding something else, a bad setting, and a real
HTTP server on loopback answering what a failing vLLM would (no vLLM runs in the fast lane).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvpersist.demo.chat import chat_completion
from kvpersist.demo.model import CPU_DEMO_REPO, SPECS, get_spec, hub_ref, metadata
from kvpersist.demo.model import repo_dir_name as hub_repo_dir
from kvpersist.demo.run import metric, one_line, run_demo, step
from kvpersist.errors import EXIT_PROBLEM, EXIT_USAGE, ConfigError, DemoFailed, KvpError
from kvpersist.errors import UsageError as KvpUsageError
from tests.cli import kvp_in_process
from tests.conftest import clean_env, free_port


def kvp(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``kvp-admin ARGV`` in this process (tests/cli.py): (exit code, stdout, stderr); an
    exception other than SystemExit (a traceback for the user) fails the test."""
    r = kvp_in_process(*argv, env=env)
    return r.returncode, r.stdout, r.stderr


def one_clean_line(err: str) -> str:
    """The demo's progress lines, then exactly one ``kvp-admin: `` line, no traceback."""
    assert "Traceback" not in err, err
    failures = [line for line in err.splitlines() if line.startswith("kvp-admin: ")]
    assert len(failures) == 1, err
    return failures[0]


def fake_generated_model(hub: Path) -> Path:
    """The tiny demo model as far as generate_model checks it (its metadata file): enough
    for the demo to go on to its configuration without generating."""
    spec = get_spec("tiny")
    repo_id, revision = hub_ref(spec)
    snapshot = hub / hub_repo_dir(repo_id) / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "kvp-demo-model.json").write_text(json.dumps(metadata(spec)))
    return snapshot


# ----------------------------------------------------------------------------- the command


def test_a_working_directory_under_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    code, _, err = kvp("demo", "--dir", str(tmp_path / "a-file" / "demo"))
    assert code == EXIT_PROBLEM
    line = one_clean_line(err)
    assert line.startswith("kvp-admin: demo: create the working directory ")
    assert "NotADirectoryError" in line and "give --dir a directory" in line


def test_a_hub_directory_holding_something_else_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "hub" / hub_repo_dir(CPU_DEMO_REPO)).mkdir(parents=True)
    code, _, err = kvp("demo", "--size", "tiny", "--dir", str(tmp_path))
    assert code == EXIT_PROBLEM
    line = one_clean_line(err)
    assert "generate the 'tiny' demo model" in line and "FileExistsError" in line
    assert f"move away what {tmp_path / 'hub'} holds" in line
    assert not any(p.name.startswith(".") for p in (tmp_path / "hub").iterdir())


def test_a_bad_setting_is_the_configuration_error_exit_2(tmp_path: Path) -> None:
    fake_generated_model(tmp_path / "hub")
    code, _, err = kvp("demo", "--size", "tiny", "--dir", str(tmp_path),
                       env={**clean_env(), "KVP_L1_SIZE_GB": "lots"})
    assert code == EXIT_USAGE
    assert "Traceback" not in err
    assert "kvp-admin: " in err and "KVP_L1_SIZE_GB" in err


def test_an_unknown_model_size_is_a_usage_error(tmp_path: Path) -> None:
    assert "huge" not in SPECS
    with pytest.raises(KvpUsageError, match="unknown demo model size 'huge'"):
        run_demo(tmp_path, size="huge", progress=lambda _: None)
    with pytest.raises(KvpUsageError, match="tiny"):
        get_spec("huge")


# ----------------------------------------------------------------------------- one step


def test_step_passes_kvp_errors_and_turns_others_into_demo_failed() -> None:
    original = ConfigError([], "x")
    with pytest.raises(ConfigError) as kept, step("load", "fix it"):
        raise original
    assert kept.value is original
    with pytest.raises(DemoFailed) as failed, step("read the log", "look at the log"):
        raise FileNotFoundError(2, "No such file or directory\nsecond line", "/x/server.log")
    exc = failed.value
    assert isinstance(exc, KvpError) and exc.exit_code == EXIT_PROBLEM
    assert str(exc) == ("demo: read the log failed: FileNotFoundError: [Errno 2] No such file "
                        "or directory second line: '/x/server.log' (look at the log)")
    assert isinstance(exc.__cause__, FileNotFoundError)
    with pytest.raises(KeyboardInterrupt), step("wait", "-"):  # Ctrl-C stays "aborted"
        raise KeyboardInterrupt


def test_one_line_is_bounded() -> None:
    text = one_line(RuntimeError("x" * 1000))
    assert len(text) == 300 and text.startswith("RuntimeError: xxx") and text.endswith("...")
    assert one_line(RuntimeError()) == "RuntimeError: (no message)"


# ----------------------------------------------------------------------------- HTTP


class Answer(BaseHTTPRequestHandler):
    """Answers every request with the server's ``status`` and ``body``."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        status, body = self.server.answer  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def answering() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    server.answer = (200, b"")  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


CHAT = [{"role": "user", "content": "hi"}]


def test_chat_with_no_server_is_demo_failed() -> None:
    base = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(DemoFailed, match="ConnectionError") as failed:
        chat_completion(base, "m", CHAT, timeout=5)
    assert failed.value.step == f"chat completion at {base}"
    assert "check that vLLM serves the model 'm'" in failed.value.fix


@pytest.mark.parametrize("status,body,needle", [
    (500, b"boom", "HTTPError: 500 Server Error"),
    (200, b'data: {"error": {"message": "model not found", "code": 404}}\n\n',
     "the server answered with an error: {'message': 'model not found', 'code': 404}"),
    (200, b"data: not json\n\n", "a streamed event is not a JSON object: b'not json'"),
    (200, b"data: [1, 2]\n\n", "a streamed event is not a JSON object"),
], ids=["http-500", "error-event", "not-json", "not-an-object"])
def test_chat_failures_are_demo_failed(answering: ThreadingHTTPServer, status: int,
                                       body: bytes, needle: str) -> None:
    answering.answer = (status, body)  # type: ignore[attr-defined]
    with pytest.raises(DemoFailed) as failed:
        chat_completion(url(answering), "m", CHAT, timeout=5)
    assert needle in str(failed.value)
    assert "\n" not in str(failed.value)


def test_a_good_stream_still_reads(answering: ThreadingHTTPServer) -> None:
    events = [{"choices": [{"delta": {"content": "Hel"}}]},
              {"choices": [{"delta": {"content": "lo"}}]},
              {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    answering.answer = (200, body + b"data: [DONE]\n\n")  # type: ignore[attr-defined]
    r = chat_completion(url(answering), "m", CHAT, timeout=5)
    assert (r.text, r.prompt_tokens, r.completion_tokens) == ("Hello", 7, 2)


def test_metrics_read_and_fail_cleanly(answering: ThreadingHTTPServer) -> None:
    name = "vllm:external_prefix_cache_hits_total"
    answering.answer = (200, f'# HELP x\n{name}{{a="1"}} 256.0\n{name}{{a="2"}} 10\n'  # type: ignore[attr-defined]
                        .encode())
    assert metric(url(answering), name) == 266.0
    answering.answer = (200, f'{name}{{a="1"}} lots\n'.encode())  # type: ignore[attr-defined]
    with pytest.raises(DemoFailed, match="ValueError"):
        metric(url(answering), name)
    answering.answer = (503, b"down")  # type: ignore[attr-defined]
    with pytest.raises(DemoFailed, match="HTTPError: 503"):
        metric(url(answering), name)
    with pytest.raises(DemoFailed, match="ConnectionError"):
        metric(f"http://127.0.0.1:{free_port()}", name)
