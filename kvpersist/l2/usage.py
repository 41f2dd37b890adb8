"""What a scan counts per category: files, bytes, allocated bytes, the oldest and newest
modification, a last-use histogram, a write-time histogram (the ages ``report`` shows), files
per ``cache_salt`` and a few examples (pure aggregates, :mod:`kvpersist.l2.scan` fills
them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvpersist.l2.layout import namespace_of_prefix

#: Width of a last-use histogram bucket (one hour), in nanoseconds.
HIST_BUCKET_NS = 3600 * 10**9
#: Cap on remembered examples (salts, foreign paths, errors) so memory stays bounded.
SAMPLE_CAP = 20
#: Cap on the salts counted one by one per prefix; the files of further salts are counted
#: together (``PrefixUsage.salt_overflow``).
SALT_CAP = 256


def hist_add(hist: dict[int, list[int]], bucket: int, nbytes: int) -> None:
    """Count one file of ``nbytes`` in ``hist``'s ``bucket``."""
    h = hist.get(bucket)
    if h is None:
        hist[bucket] = [1, nbytes]
    else:
        h[0] += 1
        h[1] += nbytes


def hist_merge(into: dict[int, list[int]], other: dict[int, list[int]]) -> None:
    for b, (f, n) in other.items():
        h = into.setdefault(b, [0, 0])
        h[0] += f
        h[1] += n


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
    #: write time (mtime) hour bucket -> [files, bytes]; filled by a scan with ``ages``
    write_hist: dict[int, list[int]] = field(default_factory=dict)

    def add(self, st: os.stat_result, sample: str | None = None, hist: bool = False,
            ages: bool = False) -> None:
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
        if ages:
            hist_add(self.write_hist, m // HIST_BUCKET_NS, st.st_size)
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
        hist_merge(self.use_hist, other.use_hist)
        hist_merge(self.write_hist, other.write_hist)
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
    #: salt (as shown, escaped) -> [files, bytes], at most SALT_CAP salts
    salt_usage: dict[str, list[int]] = field(default_factory=dict)
    #: [files, bytes] of the salts beyond SALT_CAP
    salt_overflow: list[int] = field(default_factory=lambda: [0, 0])

    def add_salted(self, salt: str, nbytes: int) -> None:
        """Count one file of ``nbytes`` under ``salt`` (as the name holds it)."""
        self.salted_files += 1
        if len(self.salts) < SAMPLE_CAP:
            self.salts.add(salt)
        h = self.salt_usage.get(salt)
        if h is not None:
            h[0] += 1
            h[1] += nbytes
        elif len(self.salt_usage) < SALT_CAP:
            self.salt_usage[salt] = [1, nbytes]
        else:
            self.salt_overflow[0] += 1
            self.salt_overflow[1] += nbytes

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
            for salt, (f, n) in other.salt_usage.items():
                h = self.salt_usage.get(salt)
                if h is None and len(self.salt_usage) < SALT_CAP:
                    h = self.salt_usage[salt] = [0, 0]
                if h is None:
                    h = self.salt_overflow
                h[0] += f
                h[1] += n
            self.salt_overflow[0] += other.salt_overflow[0]
            self.salt_overflow[1] += other.salt_overflow[1]
