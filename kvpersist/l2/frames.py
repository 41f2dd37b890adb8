"""AES-GCM frames of LMCache's ``aesgcm`` L2 serde: where a frame ends in its file, and
whether it authenticates (pure: bytes in, values out).

A chunk file holds ``[version][iv][ciphertext||tag]`` then padding up to 4 KiB
(``lmcache/v1/distributed/serde/aesgcm.py``); the AES key is derived from the master key and
the chunk's ``cache_salt`` with HKDF. Used by :mod:`kvpersist.l2.verify.root` and
:mod:`kvpersist.l2.scrub`.

A file is authenticated through a :class:`FrameSource` (:class:`~kvpersist.system.untrusted.
ChunkFile` on disk, :class:`BytesSource` in memory) and streamed: the frame's ciphertext is
fed to AES-GCM in blocks, so a chunk file of any size costs a block of memory, never its size
(issue 40: a 1 GiB sparse file named like a chunk cost 1.08 GB of RSS, a 50 GB one ended
``launch`` and ``scrub`` with ``MemoryError``). How big a chunk file may be at all is
:func:`max_chunk_file_bytes`: what LMCache can write for the namespace's KV geometry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from kvpersist.errors import KvpError

_HKDF_INFO_PREFIX = b"lmcache-l2-aesgcm-v1"  # lmcache/v1/distributed/serde/aesgcm.py
_VERSION = 1
_IV_LEN = 12
TAG_LEN = 16
HDR_LEN = 1 + _IV_LEN
FRAME_OVERHEAD = HDR_LEN + TAG_LEN
_ALIGN = 4096  # the POSIX backend pads each file to 4 KiB
#: every KV chunk's plaintext length is a multiple of this (frame_candidates)
PLAINTEXT_ALIGN = 256
#: per group, at most this many files are tried at every aligned length before a length
#: is known (a real chunk authenticates at the first try: the cap bounds what a flood of
#: garbage files costs when nothing of the group authenticates)
ALIGNED_SEARCHES = 8


#: bytes per KV element of each KV dtype (the identity's ``kv_cache_dtype``)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1,
               "fp8_inc": 1, "fp8_ds_mla": 1}
#: the deepest model a chunk's size is bounded with. The identity does not record the number
#: of layers (it does not change the namespace: the model id and revision pin it), so the
#: bound takes this many; the deepest models served today have under 200
MAX_LAYERS = 1024
#: a chunk file of a namespace whose geometry is not known here (another namespace under
#: the root, an unpinned deployment without its geometry) is at most this many bytes
MAX_CHUNK_FILE_BYTES = 4 << 30


def max_chunk_file_bytes(geometry: Mapping[str, Any], chunk_tokens: int) -> int:
    """The largest chunk file LMCache can write for a namespace of this ``geometry`` (the
    identity's ``num_kv_heads``, ``head_dim``, ``tensor_parallel_size`` and
    ``kv_cache_dtype``) with chunks of ``chunk_tokens`` tokens (pure).

    One file holds one rank's KV of one chunk in object group 0 (every layer): at most
    ``chunk_tokens x MAX_LAYERS x 2 (K and V) x ceil(heads / TP) x head_dim x dtype bytes``
    (an MLA latent is one vector, not two: the bound holds), plus the aesgcm frame's
    overhead, padded to whole 4 KiB pages as the POSIX backend writes it (measured: 4,194,304
    bytes of KV in a 4,198,400-byte file). :data:`MAX_CHUNK_FILE_BYTES` when a field is
    missing or not a positive integer."""
    fields = [geometry.get(k) for k in ("num_kv_heads", "head_dim", "tensor_parallel_size")]
    width = DTYPE_BYTES.get(str(geometry.get("kv_cache_dtype")))
    if width is None or chunk_tokens <= 0 or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in fields):
        return MAX_CHUNK_FILE_BYTES
    heads, head_dim, tp = (int(v) for v in fields)  # type: ignore[arg-type]
    plain = chunk_tokens * MAX_LAYERS * 2 * math.ceil(heads / tp) * head_dim * width
    return -(-(plain + FRAME_OVERHEAD) // _ALIGN) * _ALIGN


class FrameSource(Protocol):
    """Where a frame is read from: its size, ``pread`` and bounded ``blocks``."""

    size: int

    def pread(self, offset: int, n: int) -> bytes: ...

    def blocks(self, start: int, end: int) -> Iterator[bytes]: ...


class BytesSource:
    """A frame held in memory (a test's, or a small read)."""

    def __init__(self, blob: bytes) -> None:
        self.blob, self.size = blob, len(blob)

    def pread(self, offset: int, n: int) -> bytes:
        return self.blob[offset:offset + n]

    def blocks(self, start: int, end: int) -> Iterator[bytes]:
        view = memoryview(self.blob)
        for pos in range(start, min(end, self.size), 1 << 20):
            yield bytes(view[pos:min(end, pos + (1 << 20))])


#: the last non-zero byte is looked for in this much of a file's end: the frame ends in its
#: last page, and a stretch of zeros this long is padding
TAIL_BYTES = 2 * _ALIGN


def frame_end(plaintext: int) -> int:
    """Where the frame of a ``plaintext``-byte chunk ends in its file: the padding starts
    there (pure)."""
    return HDR_LEN + plaintext + TAG_LEN


def frame_candidates(blob: bytes, known_plaintext: int | None,
                     aligned: bool = False) -> list[int]:
    """Plaintext lengths to try for an aesgcm frame stored in ``blob`` (pure).

    The file holds ``[version][iv][ciphertext||tag]`` then padding up to 4 KiB: zeros in a
    fresh L1 page, but stale bytes of other chunks once L1 memory is reused (LMCache never
    clears it). The length already seen for this namespace comes first, then lengths ending
    the frame just after the last non-zero byte (right when the padding is clean; a tag ends
    in zero bytes only rarely). With ``aligned`` (no length known yet), then the lengths a
    KV chunk has whatever its padding: the frame ends in the file's last 4 KiB, and a KV
    plaintext (tokens x bytes per token) is a multiple of :data:`PLAINTEXT_ALIGN` when a
    chunk is 256 tokens (the default ``server.chunk_size``) or a multiple of it, or when a
    token's KV is (a head size of 64 in two bytes for K and V already is); the most aligned
    come first (a multiple of 4096, then of 1024, then of 256), so that a real chunk
    authenticates in one or two tries.
    """
    return candidates(len(blob), len(blob.rstrip(b"\0")), known_plaintext, aligned)


def candidates(size: int, data_end: int, known_plaintext: int | None,
               aligned: bool = False) -> list[int]:
    """:func:`frame_candidates` of a file of ``size`` bytes whose last non-zero byte ends at
    ``data_end`` (pure)."""
    out: list[int] = []
    if known_plaintext is not None:
        out.append(known_plaintext)
    end = data_end
    for frame_end in range(end, min(end + 4, size) + 1):
        n = frame_end - FRAME_OVERHEAD
        if n >= 0 and n not in out:
            out.append(n)
    if aligned:
        top = size - FRAME_OVERHEAD  # the frame ends at the file's end at the latest
        low = max(0, top - _ALIGN + 1)  # and after the page before the last
        for step in (_ALIGN, 1024, PLAINTEXT_ALIGN):
            for n in range(top - top % step, low - 1, -step):
                if n > 0 and n not in out:
                    out.append(n)
    return out


def data_end(src: FrameSource) -> int:
    """Where the last non-zero byte of ``src``'s last :data:`TAIL_BYTES` ends (their start
    when they are all zeros). Reads one tail."""
    start = max(0, src.size - TAIL_BYTES)
    return start + len(src.pread(start, src.size - start).rstrip(b"\0"))


def _derive(master: bytes, salt: str, key_len: int) -> bytes:
    from cryptography.hazmat.primitives.hashes import SHA256
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=SHA256(), length=key_len, salt=None,
                info=_HKDF_INFO_PREFIX + salt.encode("utf-8", "surrogateescape")).derive(master)


def derive_key(master: bytes, salt: str = "", aes_bits: int = 128) -> bytes:
    """The AES key LMCache's aesgcm serde derives from the master key for ``salt`` (the
    ``cache_salt`` of a chunk name; empty for none)."""
    return _derive(master, salt, aes_bits // 8)


def decrypt(blob: bytes, key: bytes, known_plaintext: int | None,
            aligned: bool = False) -> bytes | None:
    """The plaintext of the aesgcm frame stored in ``blob`` if it authenticates with ``key``
    (a derived key, :func:`derive_key`), else None. ``aligned``: see
    :func:`frame_candidates`."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if len(blob) < FRAME_OVERHEAD or blob[0] != _VERSION:
        return None
    aes = AESGCM(key)
    view = memoryview(blob)  # no copy of the file per length tried
    for n in frame_candidates(blob, known_plaintext, aligned):
        end = HDR_LEN + n + TAG_LEN
        if end > len(blob):
            continue
        try:
            return aes.decrypt(blob[1:HDR_LEN], view[HDR_LEN:end], None)
        except InvalidTag:
            continue
    return None


def authenticate(blob: bytes, key: bytes, known_plaintext: int | None,
                 aligned: bool = False) -> int | None:
    """The plaintext length if ``blob`` holds a frame that authenticates with ``key``."""
    found = authenticate_source(BytesSource(blob), key, known_plaintext, aligned)
    return None if found is None else found[0]


class Deadline(KvpError):
    """The time given to :func:`authenticate_source` ran out in the middle of a file (the
    callers count the file unchecked; it never ends a command)."""


#: a file up to this size is read once, whole, and tried in memory; a larger one is streamed
READ_WHOLE_BYTES = 1 << 20


def authenticate_source(src: FrameSource, key: bytes, known_plaintext: int | None,
                        aligned: bool = False,
                        stop: Callable[[], bool] | None = None) -> tuple[int, bytes] | None:
    """``(plaintext length, IV)`` if ``src`` holds a frame that authenticates with ``key`` (a
    derived key), else None; ``aligned``: see :func:`frame_candidates`.

    A file of at most :data:`READ_WHOLE_BYTES` is read once; a larger one is streamed: each
    length tried reads its ciphertext in blocks (never the file at once), so memory is a
    block's whatever the file's size. ``stop``: asked between blocks; when it says so,
    :class:`Deadline` is raised (a time bound). Raises OSError from ``src``."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    if src.size < FRAME_OVERHEAD:
        return None
    if src.size <= READ_WHOLE_BYTES and not isinstance(src, BytesSource):
        src = BytesSource(src.pread(0, src.size))
    head = src.pread(0, HDR_LEN)
    if len(head) < HDR_LEN or head[0] != _VERSION:
        return None
    iv = head[1:HDR_LEN]
    for n in candidates(src.size, data_end(src), known_plaintext, aligned):
        if HDR_LEN + n + TAG_LEN > src.size:
            continue
        tag = src.pread(HDR_LEN + n, TAG_LEN)
        if len(tag) < TAG_LEN:
            continue
        dec = Cipher(algorithms.AES(key), modes.GCM(iv, tag)).decryptor()
        for block in src.blocks(HDR_LEN, HDR_LEN + n):
            if stop is not None and stop():
                raise Deadline
            dec.update(block)
        try:
            dec.finalize()
        except InvalidTag:
            continue
        return n, iv
    return None
