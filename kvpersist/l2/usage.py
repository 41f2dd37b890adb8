"""What a scan counts per category: files, bytes, allocated bytes, the oldest and newest
modification, a last-use histogram and a few examples (pure aggregates,
:mod:`kvpersist.l2.scan` fills them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvpersist.l2.layout import namespace_of_prefix

#: Width of a last-use histogram bucket (one hour), in nanoseconds.
HIST_BUCKET_NS = 3600 * 10**9
#: Cap on remembered examples (salts, foreign paths, errors) so memory stays bounded.
SAMPLE_CAP = 20


@dataclass
class Usage:
    """Files and bytes of one category; ``oldest``/``newest`` are mtimes in ns (0 = none)."""

    files: int = 0
    bytes: int = 0
    allocated_bytes: int = 0
    oldest_mtime_ns: int = 0
    newest_mtime_ns: int = 0
    #: last use (max of mtime and atime) hour bucket -> [files, bytes]
    use_hist: dict[int, list[int]] = field(default_factory=dict)
    samples: list[str] = field(default_factory=list)
    newest_atime_ns: int = 0

    def add(self, st: os.stat_result, sample: str | None = None, hist: bool = False) -> None:
        self.files += 1
        self.bytes += st.st_size
        self.allocated_bytes += st.st_blocks * 512
        m = st.st_mtime_ns
        if not self.oldest_mtime_ns or m < self.oldest_mtime_ns:
            self.oldest_mtime_ns = m
        if m > self.newest_mtime_ns:
            self.newest_mtime_ns = m
        a = st.st_atime_ns
        if a > self.newest_atime_ns:
            self.newest_atime_ns = a
        if hist:
            b = (a if a > m else m) // HIST_BUCKET_NS
            h = self.use_hist.get(b)
            if h is None:
                self.use_hist[b] = [1, st.st_size]
            else:
                h[0] += 1
                h[1] += st.st_size
        if sample is not None and len(self.samples) < SAMPLE_CAP:
            self.samples.append(sample)

    def merge(self, other: Usage) -> None:
        self.files += other.files
        self.bytes += other.bytes
        self.allocated_bytes += other.allocated_bytes
        if other.oldest_mtime_ns and (
            not self.oldest_mtime_ns or other.oldest_mtime_ns < self.oldest_mtime_ns
        ):
            self.oldest_mtime_ns = other.oldest_mtime_ns
        self.newest_mtime_ns = max(self.newest_mtime_ns, other.newest_mtime_ns)
        self.newest_atime_ns = max(self.newest_atime_ns, other.newest_atime_ns)
        for b, (f, n) in other.use_hist.items():
            h = self.use_hist.setdefault(b, [0, 0])
            h[0] += f
            h[1] += n
        room = SAMPLE_CAP - len(self.samples)
        if room > 0:
            self.samples.extend(other.samples[:room])

    @property
    def last_use_ns(self) -> int:
        """Newest use: the later of the newest mtime and the newest atime (0 when empty).

        atime is only as fresh as the mount allows (``relatime`` updates it about daily).
        """
        return max(self.newest_mtime_ns, self.newest_atime_ns)


@dataclass
class PrefixUsage(Usage):
    """Chunk files sharing one file-name prefix."""

    prefix: str = ""
    #: packed kv_rank values seen
    ranks: set[int] = field(default_factory=set)
    groups: set[int] = field(default_factory=set)
    salted_files: int = 0
    salts: set[str] = field(default_factory=set)
    sharded_files: int = 0

    @property
    def namespace(self) -> str | None:
        return namespace_of_prefix(self.prefix)

    def merge(self, other: Usage) -> None:
        super().merge(other)
        if isinstance(other, PrefixUsage):
            self.ranks |= other.ranks
            self.groups |= other.groups
            self.salted_files += other.salted_files
            self.sharded_files += other.sharded_files
            for s in other.salts:
                if len(self.salts) >= SAMPLE_CAP:
                    break
                self.salts.add(s)
