"""A helper process the tests talk to over its stdin/stdout, one JSON object per line (for
clients that must run inside another network namespace: ``ip netns exec NS python -m ...``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Sequence
from typing import Any

from .conftest import REPO


class JsonLineChild:
    """``argv`` started in the repository (its own session); :meth:`send` writes one JSON
    line and reads the answer; :meth:`close` ends its stdin and waits for it (killed after
    10 s). A context manager."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.proc = subprocess.Popen(list(argv), cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the helper process exited ({self.proc.wait(timeout=10)})")
        return dict(json.loads(line))

    def send(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> JsonLineChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
