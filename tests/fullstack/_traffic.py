"""Helpers of the production-traffic tests: an action (a restart, a kill) run beside a storm
of returning users, and the failed requests outside a restart window."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from bench.traffic import Record


class Beside:
    """Run ``action`` in a thread (a restart, a kill) while the caller sends a storm; the
    times it started and ended, its result or its exception."""

    def __init__(self, action: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.started = time.time()
        self.ended = 0.0

        def run() -> None:
            try:
                self.result = action()
            except BaseException as exc:  # noqa: BLE001 - re-raised by join()
                self.error = exc
            finally:
                self.ended = time.time()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 900) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the action beside the storm did not end"
        if self.error is not None:
            raise self.error
        return self.result


def outside_window(records: list[Record], window: tuple[float, float]) -> list[Record]:
    """The failed records that did not start inside ``window`` (wall-clock start, end)."""
    lo, hi = window
    return [r for r in records if not r.ok and not lo <= r.started <= hi]
