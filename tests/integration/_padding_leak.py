"""Measure how much plaintext KV the padding of aesgcm chunk files carries.

Given the chunk files of one namespace and its derived key, every file's frame is
authenticated and decrypted (its plaintext: the KV the client stored); the bytes after the
frame (the padding) are then searched, at every byte offset, for a 64-byte window equal to
an aligned 64-byte block of any chunk's plaintext. A leaked run of 127 bytes or more always
contains such a block, whatever its alignment in the source; windows of one repeated byte
(zeros above all) never count. Hashes make it cheap: one 64-bit hash per aligned block of
every plaintext (eight 8-byte words times odd constants, summed modulo 2**64), the same hash
of every window of a padding, and a byte comparison of each candidate.

Used by tests/integration/test_scrub_padding.py and bench/scrub_cost.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvpersist.l2.frames import decrypt, frame_end

WINDOW = 64
_WORDS = WINDOW // 8
_MULT = np.random.default_rng(20260324).integers(1, 2**63, size=_WORDS,
                                                  dtype=np.uint64) * 2 + 1


def _hash_words(words: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """One hash per row of 8 words (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        return (words * _MULT).sum(axis=1, dtype=np.uint64)


@dataclass
class Leak:
    """What the padding of a set of chunk files holds."""

    files: int = 0
    #: files whose frame did not authenticate (not searched)
    unauthenticated: int = 0
    #: files with any non-zero byte after the frame
    dirty: int = 0
    #: files whose padding holds a 64-byte run of another chunk's plaintext
    leaking: int = 0
    #: files whose padding holds a 64-byte run of their own chunk's plaintext only
    leaking_own: int = 0
    padding_bytes: int = 0
    leaking_names: list[str] = field(default_factory=list)
    dirty_names: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"{self.files} chunk files: {self.dirty} with non-zero padding, "
                f"{self.leaking} whose padding holds a {WINDOW}-byte run of another chunk's "
                f"plaintext ({self.leaking_own} of their own only), "
                f"{self.unauthenticated} not authenticated")


class _Corpus:
    """The aligned 64-byte blocks of every plaintext, by hash."""

    def __init__(self, plains: list[bytes]) -> None:
        hashes, owners, offsets = [], [], []
        for i, p in enumerate(plains):
            n = len(p) // WINDOW * WINDOW
            words = np.frombuffer(p, dtype=np.uint64, count=n // 8).reshape(-1, _WORDS)
            hashes.append(_hash_words(words))
            owners.append(np.full(len(words), i, dtype=np.int32))
            offsets.append(np.arange(len(words), dtype=np.int64) * WINDOW)
        h = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
        order = np.argsort(h, kind="stable")
        self.hashes = h[order]
        self.owners = (np.concatenate(owners) if owners else np.zeros(0, np.int32))[order]
        self.offsets = (np.concatenate(offsets) if offsets else np.zeros(0, np.int64))[order]
        self.plains = plains

    def owners_of(self, window: bytes) -> set[int]:
        """The chunks whose plaintext holds ``window`` as an aligned block (bytes compared)."""
        w = np.frombuffer(window, dtype=np.uint64).reshape(1, _WORDS)
        h = _hash_words(w)[0]
        lo = int(np.searchsorted(self.hashes, h, "left"))
        hi = int(np.searchsorted(self.hashes, h, "right"))
        out = set()
        for k in range(lo, hi):
            i, off = int(self.owners[k]), int(self.offsets[k])
            if self.plains[i][off:off + WINDOW] == window:
                out.add(i)
        return out

    def search(self, tail: bytes) -> set[int]:
        """The chunks a 64-byte window of ``tail`` (any offset) was copied from."""
        found: set[int] = set()
        if len(tail) < WINDOW or not any(tail):
            return found
        buf = np.frombuffer(tail, dtype=np.uint8)
        for shift in range(8):
            m = (len(buf) - shift) // 8
            if m < _WORDS:
                continue
            words = buf[shift:shift + m * 8].view(np.uint64)
            wins = np.lib.stride_tricks.sliding_window_view(words, _WORDS)
            hit = np.isin(_hash_words(wins), self.hashes)
            for k in np.flatnonzero(hit):
                start = shift + int(k) * 8
                window = tail[start:start + WINDOW]
                if window.count(window[:1]) == WINDOW:  # one repeated byte: no information
                    continue
                found |= self.owners_of(window)
        return found


def measure(paths: list[Path], key: bytes, plaintext: int | None = None) -> Leak:
    """Search the padding of each of ``paths`` (chunk files of one namespace, ``key`` derived
    for their salt) for runs of any of their plaintexts (see the module docstring).
    ``plaintext``: the chunks' plaintext length if known (else learned from the files)."""
    blobs: list[bytes] = []
    plains: list[bytes] = []
    out = Leak(files=len(paths))
    names: list[str] = []
    for p in paths:
        blob = p.read_bytes()
        plain = decrypt(blob, key, plaintext, aligned=plaintext is None)
        if plain is None:
            out.unauthenticated += 1
            continue
        plaintext = len(plain)
        blobs.append(blob)
        plains.append(plain)
        names.append(p.name)
    corpus = _Corpus(plains)
    for i, blob in enumerate(blobs):
        tail = blob[frame_end(len(plains[i])):]
        out.padding_bytes += len(tail)
        if not any(tail):
            continue
        out.dirty += 1
        out.dirty_names.append(names[i])
        owners = corpus.search(tail)
        if owners - {i}:
            out.leaking += 1
            out.leaking_names.append(names[i])
        elif owners:
            out.leaking_own += 1
    return out
