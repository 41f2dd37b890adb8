"""Run ``kvp-admin`` on hostile input under the bounds issue 20 sets, cheaply.

Every case runs the real CLI (``kvpersist.cli.main``, what the console script calls) in its
own process, forked from one server process that imported kvpersist once (a fresh
interpreter per case would cost ~0.5 s each). Before the command runs, the child:

* limits its address space to :data:`AS_LIMIT` (``RLIMIT_AS``, 512 MiB): a command that
  reads ``/dev/zero`` or builds a million problems fails with ``MemoryError`` there;
* arms ``alarm(timeout)`` (default :data:`TIMEOUT`, 30 s): a command that blocks on a FIFO or
  loops in a template is killed by ``SIGALRM``;
* writes stdout and stderr to files, whose sizes are measured (the bound is
  :data:`OUTPUT_LIMIT`, 1 MB) and of which the first 64 KiB come back.

:class:`Outcome` says what happened; :meth:`Outcome.problems` lists what breaks issue 20's
rules (a traceback, a hang, a memory error, output past the bound, an exit code outside
``allowed``). ``python -m tests.hostile`` is the server (JSON lines on stdin/stdout).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .conftest import REPO, clean_env

AS_LIMIT = 512 << 20
TIMEOUT = 30
OUTPUT_LIMIT = 1_000_000
_KEEP = 64 << 10


@dataclass(frozen=True)
class Outcome:
    """What one hostile command did."""

    argv: tuple[str, ...]
    code: int | None
    stdout: str
    stderr: str
    out_bytes: int
    err_bytes: int
    traceback: str
    timed_out: bool
    signal: int
    maxrss_kb: int
    seconds: float
    limit_s: int

    def problems(self, allowed: Iterable[int] = (0, 1, 2)) -> list[str]:
        """What breaks the rules: never a traceback, a hang, a kill, a memory error, more
        than :data:`OUTPUT_LIMIT` bytes of output or an exit code outside ``allowed``."""
        out: list[str] = []
        where = "kvp-admin " + " ".join(a[:60] for a in self.argv)
        if self.timed_out:
            out.append(f"{where}: still running after {self.limit_s} s (a hang)")
        elif self.signal:
            out.append(f"{where}: killed by signal {self.signal}")
        if self.traceback or "Traceback (most recent call last)" in self.stderr:
            out.append(f"{where}: traceback:\n{(self.traceback or self.stderr)[-3000:]}")
        if "MemoryError" in self.stderr:
            out.append(f"{where}: MemoryError under RLIMIT_AS={AS_LIMIT >> 20} MiB")
        if self.out_bytes + self.err_bytes > OUTPUT_LIMIT:
            out.append(f"{where}: {self.out_bytes + self.err_bytes:,} bytes of output")
        if not self.timed_out and not self.signal and self.code not in set(allowed):
            out.append(f"{where}: exit {self.code}, expected one of {sorted(set(allowed))}:"
                       f"\n{self.stderr[-2000:]}")
        return out


class HostileRunner:
    """The fork server, started once (a context manager); :meth:`run` one case at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.hostile"], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=clean_env())

    def run(self, *argv: str, env: Mapping[str, str] | None = None,
            cwd: str | os.PathLike[str] = REPO, timeout: int = TIMEOUT) -> Outcome:
        """``kvp-admin ARGV`` with ``env`` (default: this environment without ``KVP_``)
        as the whole environment, in ``cwd``."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        req = {"argv": list(argv), "env": dict(clean_env() if env is None else env),
               "cwd": os.fspath(cwd), "timeout": timeout}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError("the hostile-input server died")
        return Outcome(argv=tuple(argv), **json.loads(line))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> HostileRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- the server


def _child(req: dict[str, Any], out_path: str, err_path: str, tb_path: str) -> None:
    """In the forked child: bounds, then the command; never returns."""
    code = 70
    try:
        resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(int(req["timeout"]))
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for fd, path in ((1, out_path), (2, err_path)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace",  # noqa: SIM115
                          closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace",  # noqa: SIM115
                          closefd=False)
        from kvpersist.cli import main

        try:
            result = main(list(req["argv"]))
            code = result if isinstance(result, int) else 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - exactly what the test reports
        with contextlib.suppress(BaseException), open(tb_path, "w") as f:
            f.write(traceback.format_exc())
        code = 70
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _head(path: str) -> tuple[str, int]:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            return f.read(_KEEP).decode("utf-8", "backslashreplace"), size
    except OSError:
        return "", 0


def serve() -> None:
    import time

    import kvpersist.cli  # noqa: F401 - imported once, before any fork
    from kvpersist.cli import COMMANDS
    for entry in COMMANDS.values():  # every command module too: the children only fork
        __import__(entry.target.split(":")[0])
    tmp = Path(tempfile.mkdtemp(prefix="kvp-hostile-"))
    out_path, err_path, tb_path = (str(tmp / n) for n in ("out", "err", "tb"))
    for line in sys.stdin:
        req = json.loads(line)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tb_path)
        start = time.monotonic()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(req, out_path, err_path, tb_path)
        deadline = start + int(req["timeout"]) + 10
        status = rusage = None
        while True:
            wpid, status, rusage = os.wait4(pid, os.WNOHANG)
            if wpid:
                break
            if time.monotonic() > deadline:  # the alarm did not end it: kill
                os.kill(pid, signal.SIGKILL)
                _, status, rusage = os.wait4(pid, 0)
                break
            time.sleep(0.005)
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        out, out_bytes = _head(out_path)
        err, err_bytes = _head(err_path)
        tb, _ = _head(tb_path)
        reply = {"code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                 "stdout": out, "stderr": err, "out_bytes": out_bytes, "err_bytes": err_bytes,
                 "traceback": tb, "timed_out": sig in (signal.SIGALRM, signal.SIGKILL),
                 "signal": sig, "maxrss_kb": rusage.ru_maxrss if rusage else 0,
                 "seconds": round(time.monotonic() - start, 3),
                 "limit_s": int(req["timeout"])}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def assert_all_bounded(outcomes: Sequence[Outcome], allowed: Iterable[int] = (0, 1, 2)) -> None:
    """Fail with every rule broken by any of ``outcomes``."""
    allowed = tuple(allowed)
    broken = [p for o in outcomes for p in o.problems(allowed)]
    assert not broken, f"{len(broken)} of {len(outcomes)} hostile runs broke the rules:\n" \
        + "\n".join(broken[:20])


if __name__ == "__main__":
    serve()
