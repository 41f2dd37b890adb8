"""Find L2 chunk files that can never be valid, and quarantine them (explicit command only).

Stock LMCache never rewrites a key whose file exists, so a damaged chunk file is a miss
after every restart, forever. ``verify`` finds:

* ``size``: a chunk file whose size differs from its namespace's usual size for the same
  kv_rank world (truncated or extended), or too small to hold an aesgcm frame;
* ``auth``: with the ``aesgcm`` serde, a file of the deployment's namespace whose frame fails
  AES-GCM authentication with the deployment's key (tampered, corrupted, written under another
  key) — LMCache would treat it as a miss every time;
* ``temp``: an interrupted write (``<name>.tmp.<uuid>``) older than ``temp_age`` seconds.

Quarantine renames a file out of its deterministic name into
``<cache root>/.kvpersist/quarantine/`` (same filesystem, atomic), so LMCache stores the chunk
afresh on the next miss. Nothing is deleted; ``prune`` or the operator removes the
quarantine. A file that changed between check and rename is left alone.

I/O is bounded: ``rate_mb_s`` caps read bandwidth; ``progress`` is called as files go by.
Pure helpers: ``expected_sizes``, ``frame_candidates``; the rest reads files.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpersist.l2 import layout

SCHEMA = "kvpersist.verify/1"
QUARANTINE_DIR = "quarantine"
_HKDF_INFO_PREFIX = b"lmcache-l2-aesgcm-v1"  # lmcache/v1/distributed/serde/aesgcm.py
_VERSION = 1
_IV_LEN = 12
_TAG_LEN = 16
_HDR_LEN = 1 + _IV_LEN
FRAME_OVERHEAD = _HDR_LEN + _TAG_LEN
_ALIGN = 4096  # the POSIX backend pads each file to 4 KiB


@dataclass(frozen=True)
class Finding:
    path: str
    kind: str  # size / auth / temp
    detail: str
    size: int


@dataclass
class VerifyResult:
    root: str
    namespace: str
    serde: str
    apply: bool
    files: int = 0
    bytes_read: int = 0
    authenticated: int = 0
    findings: list[Finding] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = SCHEMA
        d["findings"] = [asdict(f) for f in self.findings]
        return d


# --------------------------------------------------------------------------- pure helpers


def expected_sizes(sizes: dict[tuple[str, int], list[int]]) -> dict[tuple[str, int], int]:
    """The usual size per (prefix, kv world size): the most common one (pure)."""
    return {k: Counter(v).most_common(1)[0][0] for k, v in sizes.items() if v}


def frame_candidates(blob: bytes, known_plaintext: int | None) -> list[int]:
    """Plaintext lengths to try for an aesgcm frame stored in ``blob`` (pure).

    The file holds ``[version][iv][ciphertext||tag]`` then zero padding up to 4 KiB. The
    length already seen for this namespace comes first, then lengths ending the frame just
    after the last non-zero byte (a tag ends in zero bytes only rarely).
    """
    out: list[int] = []
    if known_plaintext is not None:
        out.append(known_plaintext)
    end = len(blob.rstrip(b"\0"))
    for frame_end in range(end, min(end + 4, len(blob)) + 1):
        n = frame_end - FRAME_OVERHEAD
        if n >= 0 and n not in out:
            out.append(n)
    return out


def _derive(master: bytes, salt: str, key_len: int) -> bytes:
    from cryptography.hazmat.primitives.hashes import SHA256
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=SHA256(), length=key_len, salt=None,
                info=_HKDF_INFO_PREFIX + salt.encode()).derive(master)


def authenticate(blob: bytes, key: bytes, known_plaintext: int | None) -> int | None:
    """The plaintext length if ``blob`` holds a frame that authenticates with ``key``."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if len(blob) < FRAME_OVERHEAD or blob[0] != _VERSION:
        return None
    aes = AESGCM(key)
    for n in frame_candidates(blob, known_plaintext):
        end = _HDR_LEN + n + _TAG_LEN
        if end > len(blob):
            continue
        try:
            aes.decrypt(blob[1:_HDR_LEN], blob[_HDR_LEN:end], None)
        except InvalidTag:
            continue
        return n
    return None


# --------------------------------------------------------------------------- walking (I/O)


def _entries(root: Path) -> Iterator[tuple[Path, str]]:
    """(path, name) of every regular file in the root and its shard directories."""
    with os.scandir(root) as it:
        for e in it:
            if e.is_file(follow_symlinks=False):
                yield Path(e.path), e.name
            elif e.is_dir(follow_symlinks=False) and layout.is_shard_dir_name(e.name):
                with os.scandir(e.path) as it2:
                    for e2 in it2:
                        if e2.is_dir(follow_symlinks=False) and \
                                layout.is_shard_dir_name(e2.name):
                            with os.scandir(e2.path) as it3:
                                for e3 in it3:
                                    if e3.is_file(follow_symlinks=False):
                                        yield Path(e3.path), e3.name


class _Throttle:
    def __init__(self, rate_mb_s: float | None) -> None:
        self.rate = rate_mb_s * 1e6 if rate_mb_s else None
        self.t0 = time.monotonic()
        self.done = 0

    def account(self, n: int) -> None:
        self.done += n
        if self.rate:
            ahead = self.done / self.rate - (time.monotonic() - self.t0)
            if ahead > 0:
                time.sleep(ahead)


def verify_root(root: str | os.PathLike[str], namespace: str, *, serde: str = "aesgcm",
                key: bytes | None = None, aes_bits: int = 128, apply: bool = False,
                temp_age: float = 600.0, rate_mb_s: float | None = 200.0,
                all_namespaces: bool = False,
                progress: Callable[[int, int], None] | None = None) -> VerifyResult:
    """Check the chunk files under ``root``; quarantine findings when ``apply``.

    ``key`` is the master key (aesgcm); files of ``namespace`` (all prefixes when
    ``all_namespaces``) are authenticated with it. Raises FileNotFoundError if ``root`` is
    not a directory.
    """
    t0 = time.monotonic()
    rootp = Path(root)
    if not rootp.is_dir():
        raise FileNotFoundError(f"cache root {rootp} is not a directory")
    res = VerifyResult(str(rootp), namespace, serde, apply)
    now = time.time()
    chunks: list[tuple[Path, layout.ChunkName, int]] = []
    sizes: dict[tuple[str, int], list[int]] = {}
    for path, name in _entries(rootp):
        kind, parsed = layout.classify(name)
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if kind == layout.Kind.TEMP:
            age = now - st.st_mtime
            if age >= temp_age:
                res.findings.append(Finding(str(path), "temp",
                                            f"interrupted write, untouched {age:.0f} s",
                                            st.st_size))
            continue
        if kind != layout.Kind.CHUNK or parsed is None:
            continue
        res.files += 1
        chunks.append((path, parsed, st.st_size))
        sizes.setdefault((parsed.prefix, parsed.rank.world_size), []).append(st.st_size)
    usual = expected_sizes(sizes)
    keys: dict[str, bytes] = {}
    known_plain: dict[tuple[str, int], int] = {}
    throttle = _Throttle(rate_mb_s)
    for i, (path, parsed, size) in enumerate(chunks):
        if progress is not None and (i % 64 == 0 or i == len(chunks) - 1):
            progress(i + 1, len(chunks))
        group = (parsed.prefix, parsed.rank.world_size)
        want = usual.get(group)
        if want is not None and size != want:
            res.findings.append(Finding(str(path), "size",
                                        f"{size} bytes where this namespace's chunks have "
                                        f"{want}", size))
            continue
        if serde != "aesgcm":
            continue
        if size < FRAME_OVERHEAD:
            res.findings.append(Finding(str(path), "size", "too small for an aesgcm frame",
                                        size))
            continue
        if key is None or not (all_namespaces or parsed.prefix == namespace):
            continue
        salt = parsed.salt or ""
        if salt not in keys:
            keys[salt] = _derive(key, salt, aes_bits // 8)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            continue
        throttle.account(len(blob))
        res.bytes_read += len(blob)
        n = authenticate(blob, keys[salt], known_plain.get(group))
        if n is None:
            res.findings.append(Finding(str(path), "auth",
                                        "frame fails AES-GCM authentication with the "
                                        "deployment's key (corrupt, or another key)", size))
        else:
            known_plain[group] = n
            res.authenticated += 1
    if apply:
        _quarantine(rootp, res)
    res.seconds = time.monotonic() - t0
    return res


def _quarantine(root: Path, res: VerifyResult) -> None:
    qdir = root / layout.META_DIR / QUARANTINE_DIR
    qdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for f in res.findings:
        src = Path(f.path)
        try:
            st = src.stat()
        except FileNotFoundError:
            res.skipped.append(f"{src}: gone")
            continue
        if st.st_size != f.size:
            res.skipped.append(f"{src}: changed since it was checked")
            continue
        dst = qdir / f"{src.name}.{f.kind}.{stamp}"
        try:
            os.rename(src, dst)
        except OSError as exc:
            res.skipped.append(f"{src}: {exc}")
            continue
        res.quarantined.append(str(dst))
