"""How old the chunk files are, counted from when they were written (pure).

A scan with ``ages`` keeps, per prefix, a histogram of write times (``st_mtime`` hour buckets:
:attr:`kvpersist.l2.usage.Usage.write_hist`); this module turns it into the age distribution
``report`` shows and into what lies past a maximum age (``KVP_L2_MAX_AGE``, the figure of the
``kvpersist_l2_past_max_age_*`` metrics). Ages are counted from the bucket's end, so a file
is never shown older than it is: "past the maximum age" is exact to the hour and never more
than ``prune --older-than`` deletes (the executor compares each file's mtime exactly).

What "written" means for LMCache's files: docs/max-age.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpersist.l2.usage import HIST_BUCKET_NS

#: the age distribution's buckets: (upper bound in seconds, label); None: every older file
AGE_BUCKETS: tuple[tuple[int | None, str], ...] = (
    (3600, "1h"), (86400, "1d"), (7 * 86400, "7d"), (30 * 86400, "30d"),
    (90 * 86400, "90d"), (365 * 86400, "365d"), (None, "older"),
)

Hist = Mapping[int, Sequence[int]]


def youngest_age_s(bucket: int, now_ns: int) -> float:
    """The least age (seconds) a file of write-time ``bucket`` can have at ``now_ns``."""
    return max(0.0, (now_ns - (bucket + 1) * HIST_BUCKET_NS) / 1e9)


def age_distribution(write_hist: Hist, now_ns: int) -> list[dict[str, Any]]:
    """Files and bytes per :data:`AGE_BUCKETS` bucket (each file in the first bucket its
    least age fits: ``max_age_s`` is the bucket's upper bound, None for the last)."""
    counts = [[0, 0] for _ in AGE_BUCKETS]
    for b, (files, nbytes) in write_hist.items():
        age = youngest_age_s(b, now_ns)
        for c, (bound, _) in zip(counts, AGE_BUCKETS, strict=True):
            if bound is None or age < bound:
                c[0] += int(files)
                c[1] += int(nbytes)
                break
    return [{"label": label, "max_age_s": bound, "files": c[0], "bytes": c[1]}
            for c, (bound, label) in zip(counts, AGE_BUCKETS, strict=True)]


def past(write_hist: Hist | None, now_ns: int, max_age_s: float) -> tuple[int, int]:
    """(files, bytes) written more than ``max_age_s`` before ``now_ns`` (whole hour buckets
    only: a lower bound, exact to the hour)."""
    files = nbytes = 0
    for b, (f, n) in (write_hist or {}).items():
        if youngest_age_s(b, now_ns) >= max_age_s:
            files += int(f)
            nbytes += int(n)
    return files, nbytes


@dataclass(frozen=True)
class PastMaxAge:
    """What of one namespace lies past the maximum age: what ``prune --max-age`` deletes
    (``files``, ``bytes``) and the warm-set pins it keeps (``pinned_*``)."""

    max_age_s: float
    files: int
    bytes: int
    pinned_files: int = 0
    pinned_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"max_age_s": self.max_age_s, "files": self.files, "bytes": self.bytes,
                "pinned_files": self.pinned_files, "pinned_bytes": self.pinned_bytes}


def past_max_age(write_hist: Hist, now_ns: int, max_age_s: float,
                 pinned_hist: Hist | None = None, held: bool = False) -> PastMaxAge:
    """What of a namespace lies past ``max_age_s``, less its warm-set pins (``pinned_hist``,
    measured just after the scan); a namespace ``held`` whole (its pin manifest is
    unreadable) keeps everything."""
    files, nbytes = past(write_hist, now_ns, max_age_s)
    if held:
        return PastMaxAge(max_age_s, 0, 0, files, nbytes)
    pf, pb = past(pinned_hist, now_ns, max_age_s)
    pf, pb = min(pf, files), min(pb, nbytes)
    return PastMaxAge(max_age_s, files - pf, nbytes - pb, pf, pb)


def root_max_age(ages: Iterable[float]) -> float | None:
    """The maximum age of a root: the shortest its deployments set (0: none), or None."""
    set_ = [a for a in ages if a > 0]
    return min(set_) if set_ else None


def salt_rows(files: int, nbytes: int, salt_usage: Mapping[str, Sequence[int]],
              overflow: Sequence[int]) -> list[dict[str, Any]]:
    """Files and bytes per ``cache_salt`` of one namespace, most files first: the unsalted
    files (``salt`` None: the rest of the namespace) and, when more salts were met than the
    scan counts one by one, the rest under ``salt`` "..." with ``other_salts`` true."""
    salted_f = sum(int(v[0]) for v in salt_usage.values()) + int(overflow[0])
    salted_b = sum(int(v[1]) for v in salt_usage.values()) + int(overflow[1])
    rows: list[dict[str, Any]] = [
        {"salt": s, "files": int(v[0]), "bytes": int(v[1])} for s, v in salt_usage.items()]
    rows.sort(key=lambda r: (-r["files"], r["salt"]))
    if files - salted_f > 0:
        rows.insert(0, {"salt": None, "files": files - salted_f,
                        "bytes": max(0, nbytes - salted_b)})
    if overflow[0]:
        rows.append({"salt": "...", "files": int(overflow[0]), "bytes": int(overflow[1]),
                     "other_salts": True})
    return rows
