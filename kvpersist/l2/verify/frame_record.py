"""The frame record of a namespace: which aesgcm frame each chunk name held when kvpersist
last saw it, and the rule that finds a frame under another chunk's name (pure).

LMCache's aesgcm serde does not bind a frame to its object key, so a valid frame of chunk A
under chunk B's name authenticates and is served as B's KV (docs/lmcache-failure-paths.md).
verify's ``dup`` rule sees a frame under two names at once; a rename (``mv A B``), a restore
from the wrong backup or a sync tool leaves a single copy, under the wrong name, and only a
memory of where each frame was seen before can tell. This is that memory.

**A frame's identity** is its 12-byte IV (bytes 1-12 of the file, after the version byte):
LMCache's serializer draws it from ``os.urandom`` for every write
(``lmcache/v1/distributed/serde/aesgcm.py``: ``iv = os.urandom(_IV_LEN)``), so no two writes
share one (96 random bits: a collision among a billion frames has a probability under
10^-10), and it sits at a fixed offset: it is read without knowing the frame's length (the
tag's position depends on it) and in the file's first page. verify's ``dup`` rule uses the
same identity. With ``serde: none`` a file has no frame and no identity: the record does not
apply.

**The record** (:class:`FrameRecord`): ``live``, chunk name -> :class:`Binding` (its frame's
identity and the file's inode and ctime when it was seen, so that a launch reads only the
files that changed since), and ``retired``, identity -> name, the frames that a name held
before (rewritten, or the file gone), oldest first, at most ``max(RETIRED_MIN, live names)``.

**The rule** (:func:`judge`), for each name whose identity was just read:

* the identity it is recorded with: ``unchanged``;
* an identity never seen: ``new`` (a name not recorded) or ``rewritten`` (LMCache stored the
  chunk again after its file was removed: a fresh IV); learned, never a finding;
* an identity this same name held before: ``restored`` (an older copy of the chunk itself,
  e.g. from a backup: the chunk's KV is a function of the namespace and the chunk's tokens,
  which the name is the hash of, so an older frame of the same name holds the same chunk's
  KV); learned, never a finding;
* an identity recorded under another name: ``moved`` -- that name is gone (renamed over this
  one), still holds it (a copy made after the record saw the frame) or holds another frame
  now (this one is a frame it held before): another chunk's KV under this name, a finding;
* an identity never seen, read under several names at once: ``dup`` (which name is genuine
  cannot be told), a finding.

Findings are not learned: the name keeps its recorded frame, so it is found again until it is
quarantined. A frame never seen here (a sync from another host, a backup older than the
record) cannot be told from a rewrite: it is learned.

The file format (:func:`encode`, :func:`decode`): ``MAGIC``, version, the namespace, the
counts, then one entry per name (kv rank, group, chunk hash bytes, salt, identity, inode,
ctime), then a blake2b-128 of all that. :func:`decode` refuses anything else -- another
version, another namespace, counts the bytes cannot hold, a name that does not parse, a
checksum that does not match -- with ValueError; the reader bounds the file first
(:data:`MAX_RECORD_BYTES`).

Nothing here touches the filesystem.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from kvpersist.l2.layout import BIN_SUFFIX, display_name, valid_salt

MAGIC = b"KVPFRAME"
FORMAT_VERSION = 1
#: the aesgcm serde's frame version byte and IV length (lmcache/v1/distributed/serde/aesgcm.py)
FRAME_VERSION = 1
IDENTITY_BYTES = 12
HEADER_BYTES = 1 + IDENTITY_BYTES
#: a record file larger than this is refused unread (about 3.7 million chunks of 32-byte
#: hashes); past it the record learns no new name
MAX_RECORD_BYTES = 256 << 20
#: retired identities kept: at least this many, else as many as there are live names
RETIRED_MIN = 65536
#: a chunk hash longer than this many bytes is not recorded (LMCache's are 4 to 32)
MAX_HASH_BYTES = 64
_CHECKSUM_BYTES = 16

_HEAD = struct.Struct("<8sHB")          # magic, format version, namespace length
_COUNTS = struct.Struct("<II")          # live entries, retired entries
_ENTRY = struct.Struct("<12sQqIIBH")    # identity, inode, ctime_ns, kv rank, group,
                                        # hash length, salt length (bytes)


def identity_of(header: bytes) -> bytes | None:
    """The frame identity in a chunk file's first :data:`HEADER_BYTES` bytes (its IV), or
    None when they are not the start of an aesgcm frame (short, another version byte)."""
    if len(header) < HEADER_BYTES or header[0] != FRAME_VERSION:
        return None
    return bytes(header[1:HEADER_BYTES])


class Binding(NamedTuple):
    """The frame a name held when it was seen: its identity, and the file's inode and ctime
    then (0: not known). A tuple: a record holds one per chunk file, and decodes them all."""

    identity: bytes
    ino: int = 0
    ctime_ns: int = 0


class Verdict(StrEnum):
    UNCHANGED = "unchanged"
    NEW = "new"
    REWRITTEN = "rewritten"
    RESTORED = "restored"
    MOVED = "moved"
    DUP = "dup"


#: the verdicts that are findings (never learned)
FINDINGS = frozenset({Verdict.MOVED, Verdict.DUP})


@dataclass(frozen=True)
class Judged:
    """What :func:`judge` says: a verdict per name read, a detail per finding, and the
    recorded names that are gone (``present`` was given and they are not in it)."""

    verdicts: dict[str, Verdict]
    details: dict[str, str] = field(default_factory=dict)
    gone: tuple[str, ...] = ()

    def count(self, verdict: Verdict) -> int:
        return sum(1 for v in self.verdicts.values() if v == verdict)

    def findings(self) -> dict[str, tuple[str, str]]:
        """name -> (kind, detail) of every finding."""
        return {n: (str(v), self.details[n]) for n, v in self.verdicts.items()
                if v in FINDINGS}


class FrameRecord:
    """The record of one namespace (see the module). ``changed`` says whether it differs
    from what was read (a record that did not change is not written again)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.live: dict[str, Binding] = {}
        self.retired: dict[bytes, str] = {}
        self._owner: dict[bytes, str] = {}
        self.changed = False
        #: names not learned because the record is full (:data:`MAX_RECORD_BYTES`)
        self.full = 0
        self._bytes = _HEAD.size + len(namespace) + _COUNTS.size + _CHECKSUM_BYTES

    def __len__(self) -> int:
        return len(self.live)

    def owner(self, identity: bytes) -> str | None:
        """The name ``identity`` was seen under: the name holding it now, or the last name
        that held it before."""
        return self._owner.get(identity) or self.retired.get(identity)

    def known(self, name: str, ino: int, ctime_ns: int) -> bool:
        """Whether ``name`` is recorded for the very file (inode and ctime) it is now: its
        frame is the recorded one, and need not be read. Any write, rename, link or
        attribute change of a file moves its ctime, which no tool can set back."""
        b = self.live.get(name)
        return b is not None and b.ino != 0 and b.ino == ino and b.ctime_ns == ctime_ns

    # -- changes
    def _bind(self, name: str, b: Binding) -> None:
        old = self.live.get(name)
        if old is None:
            size = _entry_bytes(name, self.namespace)
            if size == 0 or self._bytes + size > MAX_RECORD_BYTES:
                self.full += 1
                return
            self._bytes += size
        elif old.identity != b.identity:
            self._retire(name, old.identity)
            if self._owner.get(old.identity) == name:
                del self._owner[old.identity]
        if old != b:
            self.changed = True
        self.live[name] = b
        self._owner[b.identity] = name
        if self.retired.get(b.identity) == name:
            del self.retired[b.identity]
            self._bytes -= _entry_bytes(name, self.namespace)

    def _retire(self, name: str, identity: bytes) -> None:
        if identity in self.retired:
            self._bytes -= _entry_bytes(self.retired[identity], self.namespace)
            del self.retired[identity]  # re-inserted: it is the newest now
        self.retired[identity] = name
        self._bytes += _entry_bytes(name, self.namespace)
        self.changed = True

    def _drop(self, name: str) -> None:
        b = self.live.pop(name)
        self._bytes -= _entry_bytes(name, self.namespace)
        if self._owner.get(b.identity) == name:
            del self._owner[b.identity]
        self._retire(name, b.identity)

    def _trim(self) -> None:
        keep = max(RETIRED_MIN, len(self.live))
        while len(self.retired) > keep or (self._bytes > MAX_RECORD_BYTES and self.retired):
            identity = next(iter(self.retired))
            self._bytes -= _entry_bytes(self.retired.pop(identity), self.namespace)
            self.changed = True

    def learn(self, judged: Judged, seen: Mapping[str, bytes],
              stats: Mapping[str, tuple[int, int]]) -> None:
        """Apply ``judged`` (of ``seen``: name -> identity read): bind every name read that
        is not a finding to its identity and its file's ``stats`` (inode, ctime; absent:
        0, 0), retire the names gone, and trim the retired frames to their bound."""
        for name, verdict in judged.verdicts.items():
            if verdict in FINDINGS:
                continue
            stat = stats.get(name)
            if stat is None:  # not known: an unchanged name keeps the file it was seen as
                old = self.live.get(name)
                stat = (old.ino, old.ctime_ns) if old is not None and \
                    verdict == Verdict.UNCHANGED else (0, 0)
            self._bind(name, Binding(seen[name], *stat))
        for name in judged.gone:
            if name in self.live:
                self._drop(name)
        self._trim()


def _entry_bytes(name: str, namespace: str) -> int:
    """The bytes ``name``'s entry takes at most (0: a name the format cannot hold: a chunk
    hash longer than :data:`MAX_HASH_BYTES`, a group past 32 bits)."""
    try:
        _, group, chunk_hash, salt = _split(name, len(namespace) + 1)
    except ValueError:
        return 0
    if not 0 < len(chunk_hash) <= MAX_HASH_BYTES or group > 0xFFFFFFFF or len(salt) > 0xFFFF:
        return 0
    return _ENTRY.size + len(chunk_hash) + len(salt)


def judge(record: FrameRecord, seen: Mapping[str, bytes],
          present: Collection[str] | None = None) -> Judged:
    """The verdict on each name of ``seen`` (name -> the identity just read from its file)
    against ``record`` (see the module). ``present``: every chunk file name of the namespace
    listed now (read or not), or None when the listing was partial (then no name is gone).
    A name of ``present`` not in ``seen`` holds its recorded frame (its file did not change)."""
    holders: dict[bytes, list[str]] = {}
    for name, ident in seen.items():
        holders.setdefault(ident, []).append(name)
    verdicts: dict[str, Verdict] = {}
    details: dict[str, str] = {}
    for name, ident in seen.items():
        b = record.live.get(name)
        if b is not None and b.identity == ident:
            verdicts[name] = Verdict.UNCHANGED
            continue
        owner = record.owner(ident)
        if owner is None:
            many = holders[ident]
            if len(many) > 1:
                verdicts[name] = Verdict.DUP
                details[name] = (f"the same aesgcm frame is under {len(many)} names, none of "
                                 "which it was seen under before: a copy of one chunk's "
                                 "file under another chunk's name; which one is genuine "
                                 "cannot be told")
            else:
                verdicts[name] = Verdict.REWRITTEN if b is not None else Verdict.NEW
            continue
        if owner == name:
            verdicts[name] = Verdict.RESTORED
            continue
        verdicts[name] = Verdict.MOVED
        details[name] = _moved_detail(record, owner, ident, seen, present)
    gone: tuple[str, ...] = ()
    if present is not None:
        here = present if isinstance(present, set | frozenset | dict) else set(present)
        gone = tuple(n for n in record.live if n not in here)
    return Judged(verdicts, details, gone)


def _moved_detail(record: FrameRecord, owner: str, ident: bytes, seen: Mapping[str, bytes],
                  present: Collection[str] | None) -> str:
    shown = display_name(owner)
    if present is not None and owner not in present:
        how = f"{shown} is gone: its file was renamed or moved here"
    else:
        now = seen.get(owner)
        if now is None and owner in record.live:
            now = record.live[owner].identity
        if now == ident:
            how = f"{shown} holds it too: a copy made after it was recorded"
        elif owner in record.live or now is not None:
            how = f"{shown} holds another frame now: this is one it held before"
        else:
            how = f"it was recorded under {shown}, which held it before"
    return (f"another chunk's frame: the aesgcm frame under this name was recorded under "
            f"{shown}; {how}. LMCache would serve that chunk's KV as this one's")


# --------------------------------------------------------------------------- the file format


def encode(record: FrameRecord) -> bytes:
    """The record as bytes (see the module)."""
    ns = record.namespace.encode("ascii")
    cut = len(record.namespace) + 1
    parts = [_HEAD.pack(MAGIC, FORMAT_VERSION, len(ns)), ns,
             _COUNTS.pack(len(record.live), len(record.retired))]
    pack = _ENTRY.pack
    for name, b in record.live.items():
        rank, group, chunk_hash, salt = _split(name, cut)
        parts += (pack(b.identity, b.ino, b.ctime_ns, rank, group, len(chunk_hash),
                       len(salt)), chunk_hash, salt)
    for ident, name in record.retired.items():
        rank, group, chunk_hash, salt = _split(name, cut)
        parts += (pack(ident, 0, 0, rank, group, len(chunk_hash), len(salt)),
                  chunk_hash, salt)
    body = b"".join(parts)
    return body + hashlib.blake2b(body, digest_size=_CHECKSUM_BYTES).digest()


def _split(name: str, cut: int) -> tuple[int, int, bytes, bytes]:
    """(kv rank, group, chunk hash, salt) of a chunk name the record holds (it parsed)."""
    rest = name[cut:-len(BIN_SUFFIX)]
    head, _, salt = rest.partition("@")
    rank, group, chunk_hash = head.split("_")
    return int(rank, 16), int(group, 16), bytes.fromhex(chunk_hash), salt.encode("utf-8")


def decode(data: bytes, namespace: str) -> FrameRecord:
    """The record of ``namespace`` in ``data`` (:func:`encode`'s format). Raises ValueError,
    saying why, for anything else."""
    if len(data) < _HEAD.size + _COUNTS.size + _CHECKSUM_BYTES:
        raise ValueError("too short to be a frame record")
    magic, version, ns_len = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("not a kvpersist frame record")
    if version != FORMAT_VERSION:
        raise ValueError(f"format version {version}, this kvpersist reads {FORMAT_VERSION}")
    body, checksum = data[:-_CHECKSUM_BYTES], data[-_CHECKSUM_BYTES:]
    if hashlib.blake2b(body, digest_size=_CHECKSUM_BYTES).digest() != checksum:
        raise ValueError("its checksum does not match (damaged)")
    pos = _HEAD.size
    ns = body[pos:pos + ns_len].decode("ascii", "replace")
    if ns != namespace:
        raise ValueError(f"the record of {display_name(ns)!s}, not of {namespace}")
    pos += ns_len
    n_live, n_retired = _COUNTS.unpack_from(body, pos)
    pos += _COUNTS.size
    if (n_live + n_retired) * _ENTRY.size > len(body) - pos:
        raise ValueError("its counts are more entries than it holds")
    rec = FrameRecord(namespace)
    heads: dict[tuple[int, int], str] = {}
    unpack, size = _ENTRY.unpack_from, _ENTRY.size
    for i in range(n_live + n_retired):
        if pos + size > len(body):
            raise ValueError("cut short")
        ident, ino, ctime, rank, group, hash_len, salt_len = unpack(body, pos)
        pos += size
        end = pos + hash_len + salt_len
        if not 0 < hash_len <= MAX_HASH_BYTES or end > len(body):
            raise ValueError(f"entry {i} is not a chunk name")
        head = heads.get((rank, group))
        if head is None:
            head = heads[rank, group] = f"{namespace}_{rank:08x}_{group:x}_"
        salt = body[pos + hash_len:end]
        name = head + body[pos:pos + hash_len].hex()
        if salt:
            try:
                text = salt.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"entry {i} is not a chunk name") from None
            if not valid_salt(text):
                raise ValueError(f"entry {i} is not a chunk name")
            name += "@" + text
        name += BIN_SUFFIX
        pos = end
        if i < n_live:
            if name in rec.live or ident in rec._owner:
                raise ValueError(f"entry {i} repeats a name or a frame")
            rec.live[name] = Binding(ident, ino, ctime)
            rec._owner[ident] = name
        else:
            if ident in rec.retired or ident in rec._owner:
                raise ValueError(f"entry {i} repeats a frame")
            rec.retired[ident] = name
    if pos != len(body):
        raise ValueError("bytes after its last entry")
    rec._bytes = len(data)
    return rec
