"""Split one job over forked worker processes (used by scan and prune on big trees)."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import TypeVar

from kvpersist.errors import KvpError

R = TypeVar("R")


def run_parts(n: int, work: Callable[[int, Callable[[int], None] | None], R],
              progress: Callable[[int], None] | None, what: str) -> list[R]:
    """Run ``work(part, progress)`` for parts 0..n-1 and return the results in part order.

    Part 0 runs in this process (reporting ``progress`` scaled by ``n``); parts 1..n-1 run in
    forked children that send back their pickled result through a pipe. Raises KvpError if a
    worker fails.
    """
    if n <= 1:
        return [work(0, progress)]
    children: list[tuple[int, int]] = []
    for part in range(1, n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 0
            try:
                os.close(r)
                data = pickle.dumps(work(part, None), protocol=pickle.HIGHEST_PROTOCOL)
                with os.fdopen(w, "wb") as f:
                    f.write(data)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        children.append((pid, r))
    scaled = (lambda k: progress(k * n)) if progress is not None else None
    results: list[R] = [work(0, scaled)]
    for pid, r in children:
        with os.fdopen(r, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 or not data:
            raise KvpError(f"{what} worker process {pid} failed (exit status {code}) and its "
                           f"share of the work is unknown; run the {what} again")
        results.append(pickle.loads(data))
    return results
