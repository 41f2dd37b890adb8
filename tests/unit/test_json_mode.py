"""``--json`` prints exactly one JSON object on stdout whatever happens (issue 26).

A full-suite run once got an empty stdout from ``kvp-admin status --json``: the test helper
had handed the relocated deployment the same free port twice, the config did not load
(exit 2, the message on stderr only) and ``json.loads("")`` failed without showing stderr.
Here: ports handed out never repeat, the colliding config gives the error document, every
``--json`` command gives one on its error paths, and pid files of processes that exit while
they are read are reported stale, never raised. Real processes and real HTTP servers only.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest

from kvpersist import cli
from kvpersist.errors import CheckFailed, Problem
from kvpersist.json_mode import ERROR_SCHEMA, error_document, wants_json
from kvpersist.system import procs

from ..cli import kvp
from ..conftest import clean_env, free_port

ADMIN = [sys.executable, "-m", "kvpersist.cli"]


def relocated_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(clean_env(), KVP_CACHE_ROOT=str(tmp / "cache"),
               KVP_LMCACHE_PORT=str(free_port()), KVP_LMCACHE_HTTP_PORT=str(free_port()),
               KVP_VLLM_PORT=str(free_port()), KVP_L1_SIZE_GB="1", KVP_L2_BUDGET="2G",
               KVP_L2_RESERVE="1M")
    env.update(extra)
    return env


def one_object(stdout: str) -> Any:
    """The one JSON object stdout holds (json.loads refuses a second one or trailing text)."""
    doc = json.loads(stdout)
    assert isinstance(doc, dict), stdout
    return doc


# --------------------------------------------------------------------------- the root cause

def test_free_port_never_hands_out_a_port_twice() -> None:
    """The kernel's next free port is often one it gave before (nothing listens on it yet):
    1,000 plain bind-to-0 ports repeat with near certainty; free_port's never do."""
    ports = [free_port() for _ in range(500)] + [procs.free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_status_json_of_a_config_whose_ports_collide_is_the_error_document(
        tmp_path: Path) -> None:
    """The failing run's condition, provoked: two listeners given one port."""
    env = relocated_env(tmp_path)
    env["KVP_VLLM_PORT"] = env["KVP_LMCACHE_PORT"]
    r = kvp("status", "cpu-demo", "--json", env=env)
    assert r.returncode == 2, r.stderr
    doc = one_object(r.stdout)
    assert doc["schema"] == ERROR_SCHEMA and doc["exit_code"] == 2
    assert "is also KVP_LMCACHE_PORT" in doc["error"]
    assert [p["where"].rsplit(": ", 1)[-1] for p in doc["problems"]] == ["KVP_VLLM_PORT"]
    assert "is also KVP_LMCACHE_PORT" in r.stderr  # the message stays on stderr


# --------------------------------------------------------------------------- every --json command

BAD = "no-such-config"
#: every command with --json, on a config that does not exist: exit 2, the error document
JSON_COMMANDS = [
    ["status", BAD], ["health", BAD], ["health", BAD, "--no-vllm"], ["budget", BAD],
    ["report", "--config", BAD], ["identity", "show", BAD], ["identity", "check", BAD],
    ["identity", "diff", BAD, BAD], ["weights", BAD], ["verify", BAD], ["render", BAD],
    ["warmup", BAD], ["launch", BAD, "--check"], ["stop", BAD],
    ["prune", "--config", BAD, "--stale"],
]


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``kvpersist.cli.main`` in this process: (exit code, stdout, stderr)."""
    try:
        result = cli.main(list(argv))
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("args", JSON_COMMANDS, ids=lambda a: " ".join(a))
def test_each_json_command_prints_the_error_document_for_a_missing_config(
        args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, *args, "--json")
    assert code == 2, err
    doc = one_object(out)
    assert doc["schema"] == ERROR_SCHEMA and doc["exit_code"] == 2
    assert "no such config" in doc["error"] and "no such config" in err
    assert doc["problems"][0]["where"] == BAD


@pytest.mark.parametrize("args", [
    ["status", "--json"],                       # CONFIG missing
    ["status", "cpu-demo", "--json", "--bogus"],  # no such option
    ["health", "cpu-demo", "--json", "--timeout", "soon"],
    ["demo", "--json", "--size", "huge"],
    ["warmup", "cpu-demo", "--json", "--wait", "-1"],
], ids=lambda a: " ".join(a))
def test_usage_errors_in_json_mode_print_the_error_document(
        args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, *args)
    assert code == 2
    doc = one_object(out)
    assert doc["schema"] == ERROR_SCHEMA and doc["exit_code"] == 2 and doc["error"] in err


def test_without_json_stdout_stays_empty_on_errors(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "status", BAD)
    assert (code, out) == (2, "") and "no such config" in err
    code, out, _ = run_main(capsys, "render", BAD, "--", "--json")
    assert code == 2 and out == ""


def test_wants_json_reads_the_options_only() -> None:
    assert wants_json(["status", "x", "--json"])
    assert not wants_json(["status", "x"])
    assert not wants_json(["render", "--", "--json"])


def test_error_document_lists_config_problems_and_names_bugs() -> None:
    from kvpersist.errors import ConfigError

    exc = ConfigError([Problem("a", "bad", "fix it"), Problem("b", "worse")])
    doc = error_document(str(exc), 2, exc)
    assert doc["problems"] == [{"where": "a", "message": "bad", "fix": "fix it"},
                               {"where": "b", "message": "worse", "fix": ""}]
    assert error_document("boom", 1, KeyError("k"))["exception"] == "KeyError"
    assert "exception" not in error_document("x", 1, CheckFailed("x"))


# commands registered for the tests below (the registry takes any click command)
@click.command("t-boom")
@click.option("--json", "as_json", is_flag=True)
def boom(as_json: bool) -> None:
    """Fail as a bug would."""
    raise RuntimeError("something unforeseen")


@click.command("t-exit")
@click.option("--json", "as_json", is_flag=True)
def exits(as_json: bool) -> None:
    """Exit non-zero before printing anything."""
    raise SystemExit(3)


@click.command("t-doc-then-error")
@click.option("--json", "as_json", is_flag=True)
def doc_then_error(as_json: bool) -> None:
    """Print the document, then fail (launch --check, identity check)."""
    from kvpersist.commands.common import echo_json

    echo_json({"ok": False})
    raise CheckFailed("found a problem")


@pytest.fixture
def test_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, attr in (("t-boom", "boom"), ("t-exit", "exits"),
                       ("t-doc-then-error", "doc_then_error")):
        monkeypatch.setitem(cli.COMMANDS, name, cli.Entry(f"{__name__}:{attr}", name))


@pytest.mark.usefixtures("test_commands")
def test_an_unexpected_exception_gives_the_error_document_and_its_traceback(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match="something unforeseen"):
        cli.main(["t-boom", "--json"])
    doc = one_object(capsys.readouterr().out)
    assert doc["exit_code"] == 1 and doc["exception"] == "RuntimeError"
    assert "something unforeseen" in doc["error"]


@pytest.mark.usefixtures("test_commands")
def test_an_exit_code_without_a_document_gives_the_error_document(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys, "t-exit", "--json")
    assert code == 3 and one_object(out)["exit_code"] == 3
    code, out, _ = run_main(capsys, "t-exit")
    assert (code, out) == (3, "")


@pytest.mark.usefixtures("test_commands")
def test_a_document_then_an_error_stays_one_object(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "t-doc-then-error", "--json")
    assert code == 1 and one_object(out) == {"ok": False} and "found a problem" in err


# --------------------------------------------------------------------------- vanishing processes

def write_pid(path: Path, pid: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{pid}\n")
    return path


def test_pid_file_of_a_zombie_or_a_reaped_process_is_stale(tmp_path: Path) -> None:
    proc = subprocess.Popen(["true"])
    while procs.alive(proc.pid):  # exited, not reaped: a zombie
        os.sched_yield()
    st = procs.check_pid_file(write_pid(tmp_path / "a.pid", proc.pid), ("lmcache",))
    assert (st.state, st.reason) == ("stale", f"process {proc.pid} has exited (zombie)")
    proc.wait()
    st = procs.check_pid_file(tmp_path / "a.pid", ("lmcache",))
    assert (st.state, st.reason) == ("stale", f"process {proc.pid} is not running")


def test_pid_files_of_processes_exiting_while_read_are_stale_never_raised(
        tmp_path: Path) -> None:
    """Each process exits while check_pid_file reads it: whichever read it is in when the
    process goes, the answer is stale with a reason."""
    pid_file = tmp_path / "race.pid"
    reasons = set()
    for _ in range(200):
        proc = subprocess.Popen(["true"])
        st = procs.check_pid_file(write_pid(pid_file, proc.pid), ("lmcache",))
        assert st.state == "stale" and st.reason, st
        reasons.add(st.reason.split(" ", 2)[2][:12])
        proc.wait()
    assert reasons <= {"has exited (", "is not runni", "now belongs "}, reasons


def test_status_json_with_a_pid_file_of_a_vanished_process(tmp_path: Path) -> None:
    env = relocated_env(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    write_pid(tmp_path / ".kvpersist" / "cache" / "pids" / "cpu-demo.lmcache.pid", dead.pid)
    r = kvp("status", "cpu-demo", "--json", env=env)
    assert r.returncode == 1, r.stderr
    srv = one_object(r.stdout)["lmcache"]
    assert srv["state"] == "stale" and "not running" in srv["reason"]


# --------------------------------------------------------------------------- foreign answers

class _Answer(http.server.BaseHTTPRequestHandler):
    body = b"[]"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.server.body if self.path == "/v1/models" else b"{}")  # type: ignore[attr-defined]

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def foreign_vllm() -> Iterator[http.server.HTTPServer]:
    """Something that is not vLLM answering 200 on the vLLM port."""
    server = http.server.HTTPServer(("127.0.0.1", free_port()), _Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("body", [b"[]", b"null", b'"x"', b'{"data": 5}', b'{"data": [1, "a"]}'])
def test_status_and_health_json_survive_any_json_on_the_vllm_port(
        body: bytes, foreign_vllm: http.server.HTTPServer, tmp_path: Path) -> None:
    foreign_vllm.body = body  # type: ignore[attr-defined]
    env = relocated_env(tmp_path, KVP_VLLM_PORT=str(foreign_vllm.server_address[1]))
    r = kvp("status", "cpu-demo", "--json", env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert one_object(r.stdout)["vllm"]["ready"] is False
    h = kvp("health", "cpu-demo", "--json", "--timeout", "2", env=env)
    assert "Traceback" not in h.stderr, h.stderr
    assert one_object(h.stdout)["status"] == "down"
