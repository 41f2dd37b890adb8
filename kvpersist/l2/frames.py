"""AES-GCM frames of LMCache's ``aesgcm`` L2 serde: where a frame ends in its file, and
whether it authenticates (pure: bytes in, values out).

A chunk file holds ``[version][iv][ciphertext||tag]`` then padding up to 4 KiB
(``lmcache/v1/distributed/serde/aesgcm.py``); the AES key is derived from the master key and
the chunk's ``cache_salt`` with HKDF. Used by :mod:`kvpersist.l2.verify`.
"""

from __future__ import annotations

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
    out: list[int] = []
    if known_plaintext is not None:
        out.append(known_plaintext)
    end = len(blob.rstrip(b"\0"))
    for frame_end in range(end, min(end + 4, len(blob)) + 1):
        n = frame_end - FRAME_OVERHEAD
        if n >= 0 and n not in out:
            out.append(n)
    if aligned:
        top = len(blob) - FRAME_OVERHEAD  # the frame ends at the file's end at the latest
        low = max(0, top - _ALIGN + 1)  # and after the page before the last
        for step in (_ALIGN, 1024, PLAINTEXT_ALIGN):
            for n in range(top - top % step, low - 1, -step):
                if n > 0 and n not in out:
                    out.append(n)
    return out


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
    plain = decrypt(blob, key, known_plaintext, aligned)
    return None if plain is None else len(plain)
