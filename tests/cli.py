"""The tests' one way to run ``kvp-admin``: the real CLI (``python -m kvpersist.cli``) in a
subprocess, or, for the fast lane, in this process.

``kvp`` returns the CompletedProcess (text) and never raises on an exit status unless
``check``; ``kvp_json`` adds ``--json`` nowhere by itself (the caller passes it) and fails
with the exit status, stdout and stderr in the message when stdout is not JSON.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

from .conftest import REPO, clean_env

#: the command line of ``kvp-admin`` in this interpreter (imports the checkout's kvpersist)
KVP_ADMIN = [sys.executable, "-m", "kvpersist.cli"]
#: seconds a CLI call may take before the test fails
TIMEOUT = 120


def _failure(args: Sequence[str], r: subprocess.CompletedProcess[str], why: str) -> str:
    return (f"kvp-admin {' '.join(args)} -> exit {r.returncode}: {why}\n"
            f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}")


def kvp(*args: str, env: Mapping[str, str] | None = None, timeout: float = TIMEOUT,
        check: bool = False, cwd: Path = REPO, umask: int | None = None,
        wrapper: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """``kvp-admin ARGS`` in a subprocess, output captured as text. ``env`` defaults to this
    environment without any ``KVP_`` variable; ``wrapper`` goes before the interpreter (e.g.
    ``setpriv ...``); ``umask`` is set in the child; ``check`` fails the test on a non-zero
    exit, with both streams in the message."""
    pre = None if umask is None else functools.partial(os.umask, umask)
    r = subprocess.run([*wrapper, *KVP_ADMIN, *args], capture_output=True, text=True,
                       env=dict(clean_env() if env is None else env), cwd=cwd,
                       timeout=timeout, preexec_fn=pre)
    if check and r.returncode != 0:
        raise AssertionError(_failure(args, r, "expected 0"))
    return r


def parse_json(args: Sequence[str], r: subprocess.CompletedProcess[str]) -> Any:
    """The JSON document on ``r``'s stdout; a failure naming the call and both streams when
    stdout is not one."""
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(_failure(args, r, f"stdout is not JSON ({exc})")) from None


def kvp_json(*args: str, env: Mapping[str, str] | None = None, timeout: float = TIMEOUT,
             check: bool = True, cwd: Path = REPO) -> Any:
    """``kvp(*args)``'s stdout parsed as JSON (pass ``--json`` in ``args``); ``check``
    (default) also requires exit 0."""
    return parse_json(args, kvp(*args, env=env, timeout=timeout, check=check, cwd=cwd))


def kvp_in_process(*args: str,
                   env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``kvp-admin ARGS`` run by ``kvpersist.cli.main`` in this process (no interpreter
    start: for fast-lane tests of commands that neither launch nor fork), with ``env`` (by
    default this one without ``KVP_``) as the whole environment for the call."""
    from kvpersist.cli import main  # lazy: only the in-process callers pay its import

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with mock.patch.dict(os.environ, dict(clean_env() if env is None else env), clear=True), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            result = main(list(args))
            code = result if isinstance(result, int) else 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["kvp-admin", *args], code, out.getvalue(),
                                       err.getvalue())
