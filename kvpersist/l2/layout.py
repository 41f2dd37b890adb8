"""LMCache L2 file names: parse and format, pure.

Stock LMCache 0.5.6's ``nixl_store_dynamic`` adapter (POSIX backend) stores one file per chunk
key, named (``lmcache/v1/distributed/l2_adapters/nixl_store_agents/``, function
``_object_key_to_filename``)::

    {model_name, "/" -> "--"}_{kv_rank:08x}_{object_group_id:x}_{chunk_hash hex}[@{salt}].bin

directly under the cache root (flat layout) or, with ``"shard_dirs": "true"``, under
``<chunk_hash[0:2]>/<chunk_hash[2:4]>/`` (the shard does not depend on the salt). A write goes to
``<final name>.tmp.<uuid4 hex>`` in the same directory and is renamed into place.

The model name may contain ``_``, so names are parsed from the right. The prefix of a kvpersist
deployment is its namespace (``kvp-<32 hex>`` or ``kvp-unpinned-<32 hex>``); any other prefix
(``test-model``, ``--a--b`` from an absolute ``--model`` path) is still a valid LMCache prefix.
Everything else under the root is *foreign* and is never modified by kvpersist.

The cache salt is the client's, appended by LMCache as it is: vLLM accepts any text in
``cache_salt``, LMCache refuses ``@ / \\`` and NUL and more than 128 characters. So a salt may
hold a newline or an escape sequence (such a chunk is its prefix's, shown escaped by
:func:`display_name` on a terminal and as it is in ``--json``), but never bytes that are not
UTF-8: no request can carry them, so LMCache did not write such a name, and the file is
foreign. :func:`parse_chunk_name` is the one parser every command decides with.

Nothing here touches the filesystem.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from kvpersist.config.identity import NAMESPACE_RE, PINNED_NAMESPACE_RE

BIN_SUFFIX = ".bin"
TEMP_MARKER = ".tmp."
#: Directory in the cache root that holds kvpersist's own metadata (manifests, locks, logs).
META_DIR = ".kvpersist"
#: where ``kvp-admin verify --apply`` moves what it finds: ``<root>/.kvpersist/quarantine/``
QUARANTINE_DIR = "quarantine"
#: where kvpersist records its last verify and prune runs: ``<root>/.kvpersist/runs/``
RUNS_DIR = "runs"
#: The lmcache server's pid file in the cache root.
PID_FILE = "lmcache-server.pid"
MANIFESTS_DIR = "manifests"
PRUNE_LOCK = "prune.lock"

_HEX = "0123456789abcdef"
_SHARD_RE = re.compile(r"[0-9a-f]{2}")


class Kind(StrEnum):
    """What a directory entry of the cache root is."""

    CHUNK = "chunk"
    TEMP = "temp"
    FOREIGN = "foreign"


@dataclass(frozen=True, slots=True)
class KvRank:
    """LMCache's packed ``kv_rank``: ``world<<24 | global_rank<<16 | local_world<<8 | local``."""

    world_size: int
    global_rank: int
    local_world_size: int
    local_rank: int

    @classmethod
    def decode(cls, value: int) -> KvRank:
        """Unpack a 32-bit ``kv_rank``. Raises ValueError outside 0..2**32-1."""
        if not 0 <= value <= 0xFFFFFFFF:
            raise ValueError(f"kv_rank out of range: {value}")
        return cls(
            world_size=(value >> 24) & 0xFF,
            global_rank=(value >> 16) & 0xFF,
            local_world_size=(value >> 8) & 0xFF,
            local_rank=value & 0xFF,
        )

    def encode(self) -> int:
        """Pack into the 32-bit value. Raises ValueError if a field exceeds 0..255."""
        fields = (self.world_size, self.global_rank, self.local_world_size, self.local_rank)
        if any(not 0 <= f <= 0xFF for f in fields):
            raise ValueError(f"kv_rank field out of range: {fields}")
        return (
            self.world_size << 24
            | self.global_rank << 16
            | self.local_world_size << 8
            | self.local_rank
        )


@dataclass(frozen=True, slots=True)
class ChunkName:
    """The parsed parts of one L2 chunk file name."""

    prefix: str
    kv_rank: int
    group: int
    chunk_hash: str
    salt: str | None = None

    @property
    def rank(self) -> KvRank:
        return KvRank.decode(self.kv_rank)

    @property
    def namespace(self) -> str | None:
        return namespace_of_prefix(self.prefix)

    def filename(self) -> str:
        """The file name LMCache gives this key."""
        salt = f"@{self.salt}" if self.salt else ""
        head = f"{self.prefix}_{self.kv_rank:08x}_{self.group:x}"
        return f"{head}_{self.chunk_hash}{salt}{BIN_SUFFIX}"

    def relpath(self, shard_dirs: bool = False) -> str:
        """Path relative to the cache root, flat or sharded (``ab/cd/<name>``)."""
        if shard_dirs:
            return f"{self.chunk_hash[0:2]}/{self.chunk_hash[2:4]}/{self.filename()}"
        return self.filename()

    def shard(self) -> tuple[str, str]:
        """The two shard directory names LMCache derives from the chunk hash."""
        return self.chunk_hash[0:2], self.chunk_hash[2:4]


def prefix_for_model_name(model_name: str) -> str:
    """The file-name prefix LMCache derives from a model name ("/" becomes "--")."""
    return model_name.replace("/", "--")


def is_namespace(text: str) -> bool:
    """True for ``kvp-<32 hex>`` and ``kvp-unpinned-<32 hex>``."""
    return NAMESPACE_RE.fullmatch(text) is not None


def is_pinned_namespace(text: str) -> bool:
    """True for ``kvp-<32 hex>`` (a namespace computed from a full identity)."""
    return PINNED_NAMESPACE_RE.fullmatch(text) is not None


def namespace_of_prefix(prefix: str) -> str | None:
    """The namespace a file-name prefix belongs to, or None if it is not a namespace."""
    return prefix if is_namespace(prefix) else None


_HEX_RE = re.compile(r"[0-9a-f]+")
#: LMCache's fields as it writes them: ``{kv_rank:08x}``, ``{object_group_id:x}`` (no leading
#: zero), ``chunk_hash.hex()`` (whole bytes: an even number of lowercase digits)
_RANK_RE = re.compile(r"[0-9a-f]{8}")
_GROUP_RE = re.compile(r"0|[1-9a-f][0-9a-f]*")
_CHUNK_HASH_RE = re.compile(r"(?:[0-9a-f]{2})+")
#: ``uuid.uuid4().hex``: the token of LMCache's in-flight name ``<final name>.tmp.<token>``
_TEMP_TOKEN_RE = re.compile(r"[0-9a-f]{32}")
#: what LMCache's ``ObjectKey`` refuses in a cache salt (``@`` separates it, ``/`` and ``\``
#: are path separators, NUL ends a C string), and its longest salt in characters
SALT_FORBIDDEN = frozenset("@/\\\x00")
MAX_SALT_CHARS = 128


def _is_hex(text: str) -> bool:
    # a regex, not str.strip(chars): strip with a 16-char set is ~1 us per 64-char hash
    return _HEX_RE.fullmatch(text) is not None


def valid_salt(salt: str) -> bool:
    """Whether LMCache can have written ``salt`` after the ``@`` of a chunk name (pure): 1 to
    :data:`MAX_SALT_CHARS` characters, none of ``@ / \\`` or NUL (LMCache's ``ObjectKey``
    refuses them), and text vLLM can have sent: any Unicode character, a newline or an
    escape included, but never bytes that are not UTF-8 (kept by Python as lone surrogates:
    no JSON string vLLM accepts, and no string LMCache's msgpack transport carries, holds
    one)."""
    if not 0 < len(salt) <= MAX_SALT_CHARS or not SALT_FORBIDDEN.isdisjoint(salt):
        return False
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def valid_prefix(prefix: str) -> bool:
    """Whether ``prefix`` can be LMCache's file-name prefix of a model name (pure): not
    empty, printable text (no byte that is not UTF-8, no control or format character) and no
    ``@`` (LMCache's ``ObjectKey`` refuses it in a model name)."""
    return bool(prefix) and "@" not in prefix and prefix.isprintable()


def valid_head(prefix: str, rank: str, group: str) -> bool:
    """Whether ``prefix``, ``rank`` and ``group`` are those fields as LMCache writes them
    (pure; the scan's fast path validates a name's head once with it)."""
    return (_RANK_RE.fullmatch(rank) is not None and _GROUP_RE.fullmatch(group) is not None
            and valid_prefix(prefix))


def valid_chunk_hash(chunk_hash: str) -> bool:
    """Whether ``chunk_hash`` is ``bytes.hex()`` of a chunk hash: pairs of lowercase hex
    digits (pure)."""
    return _CHUNK_HASH_RE.fullmatch(chunk_hash) is not None


def parse_chunk_name(name: str) -> ChunkName | None:
    """Parse a final chunk file name; None if ``name`` is not one LMCache can have written
    (then it is foreign: never touched).

    The one parser of chunk names: report, prune, forget, shred, max-age, verify, scrub and
    the pre-read all decide with it. ``@`` is in neither a model name nor a salt, so the
    first ``@`` (if any) starts the salt, which must be :func:`valid_salt`; the rest parses
    from the right: the last three ``_`` separate rank, group and hash, so the prefix may
    itself contain ``_``. Each field must be as LMCache writes it (:func:`valid_head`,
    :func:`valid_chunk_hash`).
    """
    if not name.endswith(BIN_SUFFIX):
        return None
    head, at, salt = name[:-4].partition("@")
    if at and not valid_salt(salt):
        return None
    parts = head.rsplit("_", 3)
    if len(parts) != 4:
        return None
    prefix, rank, group, chunk_hash = parts
    if not (valid_head(prefix, rank, group) and valid_chunk_hash(chunk_hash)):
        return None
    return ChunkName(prefix, int(rank, 16), int(group, 16), chunk_hash, salt or None)


def parse_temp_name(name: str) -> ChunkName | None:
    """Parse an in-flight temp name ``<final name>.tmp.<hex>``; the chunk it would become."""
    final, marker, tail = name.rpartition(TEMP_MARKER)
    if not marker or _TEMP_TOKEN_RE.fullmatch(tail) is None:
        return None
    return parse_chunk_name(final)


def temp_name(chunk: ChunkName, token: str) -> str:
    """The temp name LMCache uses while writing ``chunk`` (``token`` is a uuid4 hex)."""
    return f"{chunk.filename()}{TEMP_MARKER}{token}"


def is_shard_dir_name(name: str) -> bool:
    """True for a two-lowercase-hex-digit shard directory name."""
    return _SHARD_RE.fullmatch(name) is not None


def classify(name: str, shard: tuple[str, str] | None = None) -> tuple[Kind, ChunkName | None]:
    """Classify a regular file's name.

    ``shard`` is None for a file directly in the root, or the two shard directory names the
    file sits in; a chunk in the wrong shard directory is foreign (LMCache would never read it).
    Returns the kind and, for chunks and temp files, the parsed chunk name.
    """
    chunk = parse_chunk_name(name)
    kind = Kind.CHUNK
    if chunk is None:
        chunk = parse_temp_name(name)
        kind = Kind.TEMP
    if chunk is None:
        return Kind.FOREIGN, None
    if shard is not None and chunk.shard() != shard:
        return Kind.FOREIGN, None
    return kind, chunk


def manifest_relpath(namespace: str) -> str:
    """Where a namespace's manifest lives, relative to the cache root."""
    return f"{META_DIR}/{MANIFESTS_DIR}/{namespace}.json"


def display_name(name: str) -> str:
    """``name`` (a path or file name as the OS gave it) safe to print and to put in JSON.

    Bytes that are not UTF-8 (kept by Python as lone surrogates) are shown as ``\\xNN``;
    control characters (a newline, an escape sequence) as ``\\xNN`` too, so a hostile file
    name can neither crash an encoder nor rewrite a terminal (pure)."""
    raw = name.encode("utf-8", "surrogateescape")
    text = raw.decode("utf-8", "backslashreplace")
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 0x100
                   else f"\\u{ord(c):04x}" for c in text)
