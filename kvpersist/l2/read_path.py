"""The L2 read-path settings of a deployment and why they are what they are (pure).

``kvp-admin render`` and ``kvp-admin budget`` show :func:`explain_read_path`'s lines (and its
``to_dict()`` under ``read_path`` in ``--json``). The defaults are the ones the A/B in
docs/benchmarks.md ("L2 read path A/B") measured; a deployment that sets another value is
told which default it leaves and that the measurement should be repeated on its host.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpersist.config.deployment import Deployment
from kvpersist.config.generic import GenericConfig
from kvpersist.config.values import format_size
from kvpersist.l2.hot_files import off_reason, preread_cap

#: where the measurement behind the defaults is written up
EVIDENCE = 'docs/benchmarks.md, "L2 read path A/B"'


@dataclass(frozen=True)
class ReadPath:
    """The settings that decide how the cache server reads L2, and their explanation."""

    use_direct_io: bool
    shard_dirs: bool
    max_workers: int
    chunk_size: int
    preread_ram_share: float
    #: bytes the launch pre-read may fill (None when MemAvailable was not given)
    preread_cap_bytes: int | None
    #: '' when the pre-read runs at launch, else why not
    preread_off: str
    #: settings that differ from the measured defaults (generic-config key names)
    changed: tuple[str, ...]
    lines: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        return {"use_direct_io": self.use_direct_io, "shard_dirs": self.shard_dirs,
                "max_workers": self.max_workers, "chunk_size": self.chunk_size,
                "preread_ram_share": self.preread_ram_share,
                "preread_cap_bytes": self.preread_cap_bytes,
                "preread": "off" if self.preread_off else "on",
                "preread_off_reason": self.preread_off, "changed": list(self.changed),
                "lines": list(self.lines), "evidence": EVIDENCE}


def _changed(g: GenericConfig) -> tuple[str, ...]:
    d = GenericConfig.__dataclass_fields__
    pairs = (("l2.use_direct_io", "l2_use_direct_io"), ("l2.shard_dirs", "l2_shard_dirs"),
             ("server.max_workers", "max_workers"), ("server.chunk_size", "chunk_size"))
    return tuple(key for key, attr in pairs if getattr(g, attr) != d[attr].default)


def explain_read_path(dep: Deployment, *, mem_available: int | None = None) -> ReadPath:
    """The read path of ``dep``: its settings and two lines saying why (a third names any
    setting that leaves the measured defaults). ``mem_available`` (bytes, if measured) turns
    the pre-read share into a byte cap."""

    g, s = dep.generic, dep.settings
    share = s.preread_ram_share
    off = off_reason(share, g.l2_use_direct_io)
    cap = preread_cap(mem_available, share) if mem_available is not None else None
    io = "O_DIRECT" if g.l2_use_direct_io else "buffered (page cache)"
    layout = "ab/cd shard directories" if g.l2_shard_dirs else "flat"
    lines = [f"L2 reads: {io}, {layout} layout, {g.max_workers} server worker(s), "
             f"{g.chunk_size}-token chunks; chosen by an A/B of the server's L2->L1 prefetch "
             f"against a raw read of the same files ({EVIDENCE})"]
    if off:
        lines.append(f"hot-files pre-read at launch: off ({off})")
    else:
        what = f"{share:g} of MemAvailable"
        if cap is not None:
            what += f" (= {format_size(cap)} now)"
        lines.append(f"hot-files pre-read at launch: the namespace's most recently used "
                     f"chunk files, up to {what}, into the page cache while vLLM loads")
    changed = _changed(g)
    if changed:
        lines.append(f"{', '.join(changed)} differ from the measured defaults "
                     f"(configs/{s.generic_config}/lmcache.yaml): measure on this host "
                     "with bench/l2_read_ab.py")
    if "server.chunk_size" in changed:
        lines.append("a chunk size change re-keys every chunk: files stored under another "
                     "chunk size are never hit again")
    return ReadPath(g.l2_use_direct_io, g.l2_shard_dirs, g.max_workers, g.chunk_size, share,
                    cap, off, changed, tuple(lines))
