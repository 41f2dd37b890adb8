"""The L2 master key of LMCache's ``aesgcm`` serde (the I/O layer for key files).

LMCache derives one AES key per ``cache_salt`` from this master key with HKDF-SHA256 and
authenticates every chunk frame with AES-GCM: a tampered, truncated or foreign file fails
its tag and becomes a load miss (recompute), never wrong output.

The toolkit creates the key once: 32 random bytes, mode 0600, in a 0700 directory, written
atomically. It never prints or logs the key; only a fingerprint (a one-way digest) is shown.
Under systemd the key can come from a credential (``LoadCredential=``): point
``KVP_SERDE_KEY_FILE`` at ``$CREDENTIALS_DIRECTORY/<name>``; an existing key is used as is.

What a key change means: every chunk written under the old key fails authentication under
the new one, so the whole cache at that root becomes unreadable (misses, recompute). Stock
LMCache never rewrites a key whose file exists, so those files stay misses until removed;
``kvp-admin verify --apply`` quarantines them. Rotating the key therefore equals starting
the cache from empty; the namespace does not change (the key is not a KV-compatibility
field), which is why launch records the fingerprint and warns when it changes.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from kvpersist.errors import KvpError
from kvpersist.system.files import atomic_write, make_dirs, read_owner_only, trust_problems
from kvpersist.system.untrusted import MAX_RECORD_BYTES, UnreadableFile, read_text

KEY_BYTES = 32
FINGERPRINT_FILE = "l2-master.key.fingerprint"


class KeyError_(KvpError):
    """The key file is unusable (unreadable, too short, readable by others)."""


@dataclass(frozen=True)
class KeyInfo:
    """A usable key: where it is, its fingerprint, and whether this call created it."""

    path: str
    fingerprint: str
    created: bool


def fingerprint(key: bytes) -> str:
    """A 16-hex one-way fingerprint of ``key`` (safe to log; pure)."""
    return hashlib.sha256(b"kvpersist-l2-key-fingerprint\0" + key).hexdigest()[:16]


#: the most of a key file that is read (LMCache's own key is 32 bytes; a larger file is
#: refused rather than read without bound)
KEY_MAX_BYTES = 1 << 20


def read_key(path: str | os.PathLike[str], also: tuple[int, ...] = ()) -> bytes:
    """The key bytes at ``path``; raises KeyError_ if missing, short, not owner-only, or not
    owned by this user (or the service user's uid in ``also``) under trusted directories
    (:func:`~kvpersist.system.files.trust_problems`, then
    :func:`~kvpersist.system.files.read_owner_only`)."""
    p = Path(path)
    trust = trust_problems(p, also=also)
    if trust:
        raise KeyError_(f"key file {p} cannot be trusted: " + "; ".join(trust))
    try:
        data = read_owner_only(p, what="key file", max_bytes=KEY_MAX_BYTES, also=also,
                               fix="check KVP_SERDE_KEY_FILE (launch creates the key)")
    except KvpError as exc:
        raise KeyError_(str(exc)) from exc
    if len(data) < 16:
        raise KeyError_(f"key file {p} holds {len(data)} bytes; at least 16 are needed")
    return data


def ensure_key(path: str | os.PathLike[str], also: tuple[int, ...] = ()) -> KeyInfo:
    """Return the key at ``path``, creating it (32 random bytes, 0600, parent 0700) if it
    does not exist. Never overwrites. Raises KeyError_ if an existing key is unusable."""
    p = Path(path)
    created = False
    if not p.exists():
        make_dirs(p.parent)
        # never ".tmp." in a name kvpersist writes: LMCache deletes such names under its root
        tmp = p.with_name(f".{p.name}.new-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, os.urandom(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, p)  # fails if another launcher created it meanwhile
            created = True
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    key = read_key(p, also)
    return KeyInfo(str(p), fingerprint(key), created)


def recorded_fingerprint(state_dir: str | os.PathLike[str]) -> str | None:
    """The key fingerprint recorded for a cache (``<state_dir>/keys/...fingerprint``), or
    None when none is recorded, or the record is not one (read as untrusted: not a regular
    file, a link, bigger than a record, not 16 hex digits): then launch does not warn of a
    key change and records the fingerprint again. Never raises."""
    try:
        text = read_text(Path(state_dir) / "keys" / FINGERPRINT_FILE, follow=False,
                         max_bytes=MAX_RECORD_BYTES).strip()
    except (FileNotFoundError, UnreadableFile):
        return None
    return text if len(text) == 16 and all(c in "0123456789abcdef" for c in text) else None


def record_fingerprint(state_dir: str | os.PathLike[str], fp: str) -> None:
    """Record ``fp`` as the key fingerprint this cache's files are written with."""
    atomic_write(Path(state_dir) / "keys" / FINGERPRINT_FILE, fp + "\n")
