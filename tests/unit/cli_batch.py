"""Run many ``kvp-admin`` command lines in one process, each with its own environment.

``python -m tests.unit.cli_batch`` reads a JSON list of ``{"argv": [...], "env": {...}}`` on
stdin and prints a JSON list of ``{"code", "stderr", "traceback"}``: the exit code, what the
command wrote to stderr, and the traceback of any exception other than ``SystemExit`` (what a
user of ``python -m kvpersist.cli`` would see as a traceback). It calls the same
``kvpersist.cli.main`` as the console script, so hundreds of hostile inputs cost one
interpreter start instead of hundreds.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback
from typing import Any


def run_one(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    from kvpersist.cli import main

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    err, out = io.StringIO(), io.StringIO()
    code, tb = 0, ""
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            result = main(argv)
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - exactly what the batch reports
        tb = traceback.format_exc()
        code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"code": code, "stderr": err.getvalue(), "traceback": tb}


def main() -> None:
    cases = json.load(sys.stdin)
    json.dump([run_one(c["argv"], c["env"]) for c in cases], sys.stdout)


if __name__ == "__main__":
    main()
