"""The shared tier's credentials and CA file, read as what they are: an owner-only secret
(a username and a password line) and a CA certificate only trusted users can change.
Used by the launch's preflight, the launcher that hands the credentials to LMCache
(:mod:`kvpersist.stack.lmcache_exec`), and every command that opens the store.
"""

from __future__ import annotations

import os

from kvpersist.config.shared_tier import SharedSecret, parse_secret
from kvpersist.errors import KvpError
from kvpersist.system.files import UnusableSecret, read_checked, read_owner_only, trust_problems

#: the most of a secret file that is read (a username and a password line)
SECRET_MAX_BYTES = 65536
#: how much of a CA file is read to find its PEM certificate
CA_HEAD_BYTES = 1 << 20


def check_ca_file(path: str, also: tuple[int, ...] = ()) -> None:
    """Check the shared tier's CA file before anything trusts it: an absolute path, a regular
    file (no symlink) owned by this user, one of ``also`` (the service user) or root, not
    writable by group or others, in directories only those users can change
    (:func:`kvpersist.system.files.trust_problems`), holding a PEM certificate. Whoever can
    change it can make the cache server trust their own store. Raises KvpError naming every
    problem (a CA file is not secret: it may be readable by anyone)."""
    if not os.path.isabs(path):
        raise KvpError(f"shared tier CA file {path!r} must be an absolute path (tls_ca=)")
    problems = trust_problems(path, also=(*also, 0))
    head, found = read_checked(path, what="shared tier CA file", max_bytes=CA_HEAD_BYTES,
                               fix="check tls_ca= in KVP_SHARED_TIER", secret=False)
    problems += found
    if b"-----BEGIN CERTIFICATE-----" not in head:
        problems.append(f"{path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    if problems:
        raise KvpError("shared tier CA file (tls_ca=): " + "; ".join(problems))


def read_secret_file(path: str, also: tuple[int, ...] = ()) -> SharedSecret:
    """Read the shared tier's secret file: a regular file (no symlink) owned by this user (or
    one of ``also``: the service user, when root administers for it) and readable by nobody
    else (:func:`kvpersist.system.files.read_owner_only`). Raises UnusableSecret (exit 2)
    naming the problem (never the content)."""
    raw = read_owner_only(path, what="shared tier secret file", max_bytes=SECRET_MAX_BYTES,
                          also=also, fix="check KVP_SHARED_TIER_SECRET_FILE")
    try:
        text = raw.decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        raise UnusableSecret(f"shared tier secret file {path} is not UTF-8 text") from exc
    secret, problem = parse_secret(text)
    if secret is None:
        raise UnusableSecret(f"shared tier secret file {path}: {problem}")
    return secret
