"""The l2 functions for tests that name a cache root by its path: each opens the root (the
handle, :class:`kvpersist.l2.tree.RootDir`) for one call and closes it, as a use case would."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

from kvpersist.l2.pins.store import read_pins, remove_pins, write_pins
from kvpersist.l2.pins.usage import PinRead
from kvpersist.l2.prune import PruneResult, prune_lock, prune_stream
from kvpersist.l2.retention import Selection
from kvpersist.l2.runs import read_runs, record_run
from kvpersist.l2.scan import ScanResult, scan_root
from kvpersist.l2.tree import open_root
from kvpersist.l2.verify.root import VerifyResult, verify_root

Root = str | os.PathLike[str]


def scan_at(root: Root, **kw: Any) -> ScanResult:
    with open_root(root, purpose="scan") as r:
        return scan_root(r, **kw)


def prune_at(root: Root, selections: Sequence[Selection], **kw: Any) -> PruneResult:
    with open_root(root, purpose="prune") as r:
        return prune_stream(r, selections, **kw)


@contextlib.contextmanager
def lock_at(root: Root) -> Iterator[None]:
    with open_root(root, purpose="prune") as r, prune_lock(r):
        yield


def verify_at(root: Root, namespace: str, **kw: Any) -> VerifyResult:
    with open_root(root, purpose="verify") as r:
        return verify_root(r, namespace, **kw)


def write_pins_at(root: Root, doc: dict[str, Any]) -> str:
    with open_root(root, purpose="write the pins of") as r:
        return write_pins(r, doc)


def read_pins_at(root: Root) -> PinRead:
    with open_root(root, purpose="read the pins of") as r:
        return read_pins(r)


def remove_pins_at(root: Root, namespace: str) -> bool:
    with open_root(root, purpose="remove the pins of") as r:
        return remove_pins(r, namespace)


def record_run_at(root: Root, kind: str, **kw: Any) -> str | None:
    with open_root(root, purpose="record the run on") as r:
        return record_run(r, kind, **kw)


def read_runs_at(root: Root) -> tuple[dict[str, dict[str, Any]], list[str]]:
    with open_root(root, purpose="read the runs of") as r:
        return read_runs(r)
