"""The gate of a warm-up child a launch starts early (kvpersist.stack.warm.gate): what the
launch writes, what the child reads, the handoff that names it, and a real child held at the
gate until the launch opens it or closes it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvpersist.stack.warm import gate
from kvpersist.stack.warm.handoff import SCHEMA, Handoff, read_handoff, write_handoff
from kvpersist.stack.warm.readiness import StartedWarmup
from kvpersist.system.files import atomic_write_json

REPO = Path(__file__).resolve().parents[2]


def test_the_gate_is_absent_open_or_closed_with_its_reason(tmp_path: Path) -> None:
    path = str(tmp_path / "warmup-gate")
    assert gate.look(path) is None
    gate.open_gate(path)
    assert gate.look(path) == ""
    gate.open_gate(path, "the canary failed")
    assert gate.look(path) == "the canary failed"
    gate.clear(path)
    assert gate.look(path) is None
    gate.clear(path)  # absent: nothing to do
    Path(path).write_text("something else")
    assert gate.look(path) == "something else"  # not "go": closed
    Path(path).unlink()
    Path(path).symlink_to(tmp_path / "elsewhere")
    assert "unreadable" in (gate.look(path) or "")  # never followed


def test_wait_open_returns_once_opened_and_raises_once_closed(tmp_path: Path) -> None:
    path = str(tmp_path / "warmup-gate")
    threading.Timer(0.2, gate.open_gate, (path,)).start()
    assert 0.1 < gate.wait_open(path) < 5
    gate.clear(path)
    threading.Timer(0.2, gate.open_gate, (path, "vLLM did not come up")).start()
    with pytest.raises(gate.GateClosed, match="vLLM did not come up"):
        gate.wait_open(path)


def test_the_handoff_names_the_gate_and_reads_one_without(tmp_path: Path) -> None:
    path = str(tmp_path / "h.json")
    h = Handoff.of(["vllm", "--x"], ["lmcache", "server"], "/s/warmup-gate")
    write_handoff(path, h)
    assert read_handoff(path) == h
    write_handoff(path, Handoff.of(["vllm"], ["lmcache"]))
    assert "gate" not in Path(path).read_text()
    assert read_handoff(path).gate == ""
    atomic_write_json(path, {"schema": SCHEMA, "vllm_argv": [], "lmcache_server_argv": [],
                             "gate": 3})
    with pytest.raises(Exception, match="is not a"):
        read_handoff(path)


def _held_child(tmp_path: Path, path: str) -> StartedWarmup:
    code = ("import sys; from kvpersist.stack.warm import gate\n"
            "try:\n    gate.wait_open(sys.argv[1])\nexcept gate.GateClosed:\n    sys.exit(1)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, path], cwd=REPO)
    loc = type("Loc", (), {"warmup_state_file": str(tmp_path / "warmup.json"),
                           "warmup_log": str(tmp_path / "warmup.log"), "namespace": "ns"})()
    return StartedWarmup(loc, proc, 30.0, time.monotonic(), time.time(), path)  # type: ignore[arg-type]


def test_a_child_held_at_the_gate_goes_on_when_released(tmp_path: Path) -> None:
    path = str(tmp_path / "warmup-gate")
    child = _held_child(tmp_path, path)
    time.sleep(0.5)
    assert child.proc.poll() is None  # held
    child.release()
    run = child.finish()
    assert run.exit_code == 0 and run.state == "skipped", run  # no record: no warm set
    assert run.seconds < 5


def test_a_child_held_at_the_gate_ends_when_cancelled(tmp_path: Path) -> None:
    path = str(tmp_path / "warmup-gate")
    child = _held_child(tmp_path, path)
    t0 = time.monotonic()
    child.cancel("the canary failed")
    assert child.proc.poll() == 1 and time.monotonic() - t0 < 5
