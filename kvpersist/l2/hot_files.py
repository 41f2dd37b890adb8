"""Which chunk files the launch pre-read warms (pure: values in, a frozen plan out).

At launch, while vLLM loads its weights and the NVMe would sit idle, kvpersist can ask the
kernel to read the namespace's most recently used chunk files into the page cache
(``posix_fadvise(WILLNEED)``, kvpersist/stack/preread.py), so that the first L2 reads after a
host reboot come from memory. This module decides what to read:

    cap   = floor(share * MemAvailable)          (share = KVP_PREREAD_RAM_SHARE; 0 disables)
    files = the namespace's chunk files, newest last use first (ties: by name),
            taken while the running total stays <= cap (the first file that does not fit ends
            the list: a recency prefix, never older files around a gap)

"Last use" is ``max(mtime, atime)`` of the file, as for retention and prune: LMCache writes a
file once (mtime = store) and the kernel moves atime on reads where the mount records it
(``relatime``: at most once a day after the first read; ``noatime``: never, so mtime alone).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    """One chunk file of the namespace: its path relative to the cache root, size in bytes and
    last use (``max(mtime, atime)``, nanoseconds since the epoch)."""

    rel: str
    size: int
    last_use_ns: int


@dataclass(frozen=True)
class PrereadPlan:
    """The files to pre-read (newest first), their total bytes, and why."""

    files: tuple[Candidate, ...]
    bytes: int
    cap_bytes: int
    candidates: int
    candidate_bytes: int
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {"files": len(self.files), "bytes": self.bytes, "cap_bytes": self.cap_bytes,
                "candidates": self.candidates, "candidate_bytes": self.candidate_bytes,
                "reason": self.reason}


def off_reason(share: float, use_direct_io: bool) -> str:
    """Why the launch does not pre-read ('' when it does): a share of 0, or O_DIRECT reads,
    which never look at the page cache."""
    if share <= 0:
        return "KVP_PREREAD_RAM_SHARE is 0"
    if use_direct_io:
        return "l2.use_direct_io reads bypass the page cache"
    return ""


def preread_cap(mem_available: int, share: float) -> int:
    """The byte cap: ``floor(share * mem_available)``; 0 when ``share`` is 0 or less (the
    pre-read is off). Raises ValueError for a share above 1."""
    if share > 1:
        raise ValueError(f"share of free RAM must be at most 1, got {share}")
    if share <= 0 or mem_available <= 0:
        return 0
    return int(share * mem_available)


def plan_preread(candidates: Iterable[Candidate], cap_bytes: int) -> PrereadPlan:
    """The most recently used candidates whose sizes add up to at most ``cap_bytes``.

    Sorted by last use, newest first (equal times by path, so the plan is deterministic);
    the list stops at the first file that would pass the cap. Empty files are skipped.
    """
    pool = sorted((c for c in candidates if c.size > 0),
                  key=lambda c: (-c.last_use_ns, c.rel))
    total_all = sum(c.size for c in pool)
    if cap_bytes <= 0:
        return PrereadPlan((), 0, 0, len(pool), total_all, "off (share of free RAM is 0)")
    chosen: list[Candidate] = []
    total = 0
    for c in pool:
        if total + c.size > cap_bytes:
            break
        chosen.append(c)
        total += c.size
    if len(chosen) == len(pool):
        why = f"all {len(pool)} chunk files fit the cap"
    else:
        why = f"the {len(chosen)} most recently used of {len(pool)} chunk files fit the cap"
    return PrereadPlan(tuple(chosen), total, cap_bytes, len(pool), total_all, why)
