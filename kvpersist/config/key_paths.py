"""Where the aesgcm master keys live under a state dir (pure: paths only).

Each namespace has its own key (docs/keys-and-shred.md)::

    <state dir>/keys/l2-master.key                 the root key of kvpersist before 0.3
                                                   (one key for every namespace of the
                                                   root); adopted, never created any more
    <state dir>/keys/<namespace>/l2-master.key     the namespace's key (0600, dir 0700)
    <state dir>/keys/<namespace>/l2-master.key.fingerprint   what launch last used
    <state dir>/keys/<namespace>/shredded.json     the tombstone ``kvp-admin shred`` leaves

An operator's ``KVP_SERDE_KEY_FILE`` (e.g. a systemd credential) replaces the namespace's
key path; nothing here applies to it.
"""

from __future__ import annotations

from pathlib import PurePosixPath

KEYS_DIR = "keys"
KEY_NAME = "l2-master.key"
FINGERPRINT_NAME = KEY_NAME + ".fingerprint"
TOMBSTONE_NAME = "shredded.json"


def namespace_dir_problem(namespace: str) -> str:
    """Why ``namespace`` cannot name a directory under ``keys/`` (or ''): empty, a path
    separator, a leading dot, or a character that is not printable."""
    if not namespace or "/" in namespace or namespace.startswith(".") \
            or not namespace.isprintable() or " " in namespace:
        return f"{namespace!r} is not a namespace (a file-name prefix such as kvp-<32 hex>)"
    return ""


def keys_dir(state_dir: str) -> str:
    """``<state dir>/keys``."""
    return str(PurePosixPath(state_dir) / KEYS_DIR)


def root_key_path(state_dir: str) -> str:
    """The one key per root of kvpersist before per-namespace keys."""
    return str(PurePosixPath(state_dir) / KEYS_DIR / KEY_NAME)


def namespace_key_dir(state_dir: str, namespace: str) -> str:
    """``<state dir>/keys/<namespace>``; raises ValueError for a name that is not one."""
    problem = namespace_dir_problem(namespace)
    if problem:
        raise ValueError(problem)
    return str(PurePosixPath(state_dir) / KEYS_DIR / namespace)


def namespace_key_path(state_dir: str, namespace: str) -> str:
    """The default ``KVP_SERDE_KEY_FILE`` of ``namespace``."""
    return str(PurePosixPath(namespace_key_dir(state_dir, namespace)) / KEY_NAME)


def tombstone_path(state_dir: str, namespace: str) -> str:
    """Where ``kvp-admin shred`` records that ``namespace``'s key was destroyed."""
    return str(PurePosixPath(namespace_key_dir(state_dir, namespace)) / TOMBSTONE_NAME)


def is_namespace_key(state_dir: str, namespace: str, key_file: str) -> bool:
    """True when ``key_file`` is ``namespace``'s own key under ``state_dir`` (the default),
    False for an operator's ``KVP_SERDE_KEY_FILE`` elsewhere."""
    try:
        return PurePosixPath(key_file) == PurePosixPath(namespace_key_path(state_dir,
                                                                           namespace))
    except ValueError:
        return False
