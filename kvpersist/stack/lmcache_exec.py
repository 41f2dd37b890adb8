"""Start stock LMCache's server with the shared tier's credentials, keeping them out of /proc.

``/proc/PID/cmdline`` is world-readable, and LMCache takes adapter credentials only as
adapter-JSON fields (``valkey``) or from its own process environment (``resp``). So a
deployment with a shared tier does not exec ``lmcache server ...`` directly; it runs::

    python -m kvpersist.stack.lmcache_exec --secret-file FILE -- lmcache server ... \\
        --l2-adapter '{"type":"resp",...}' ...

which reads the owner-only FILE, puts the credentials into *this process's* copy of the
argument list (``valkey``) or environment (``resp``), and calls LMCache's own console entry
point (``lmcache.cli.main:main``) in the same process. The kernel's copies — the exec-time
argv and environment block behind ``/proc/PID/cmdline`` and ``/proc/PID/environ`` — never
hold them. LMCache itself is not changed.

The valkey adapter of LMCache 0.5.6 hands ``(username, password)`` positionally to glide's
``ServerCredentials(password, username)``, i.e. swapped; :func:`valkey_swaps_credentials`
recognises that code in the installed LMCache and :func:`inject` compensates, so an ACL user
authenticates (docs/fleet.md, "Adapters").

With a private CA (``tls_ca=`` in ``KVP_SHARED_TIER``) the launcher is also given
``--tls-ca FILE``: it checks the file (:func:`check_ca_file`) and sets ``SSL_CERT_FILE`` in
its own process environment. LMCache 0.5.6's valkey adapter passes only ``use_tls`` to
valkey-glide (no ``TlsAdvancedConfiguration``), and glide then verifies the server with
rustls' platform verifier, whose Linux trust store comes from ``rustls-native-certs``: that
reads ``SSL_CERT_FILE`` when it is set, *instead of* the system store.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from kvpersist.config.shared_tier import (
    CA_ENV,
    RESP_ENV_PASSWORD,
    RESP_ENV_USER,
    SharedSecret,
)
from kvpersist.errors import KvpError
from kvpersist.l2.shared.credentials import check_ca_file, read_secret_file
from kvpersist.system.untrusted import MAX_STATE_BYTES, read_text

MODULE = "kvpersist.stack.lmcache_exec"
SHARED_TYPES = ("resp", "valkey")
#: the swapped call in LMCache 0.5.6's ValkeyWorkerPool._get_client
_SWAPPED_CALL = "ServerCredentials(self._username, self._password)"
_WORKER_POOL = "lmcache.v1.storage_backend.valkey.worker_pool"


def exec_argv(python: str, secret_file: str, server_argv: Sequence[str],
              tls_ca: str = "") -> list[str]:
    """The command line that starts ``server_argv`` through this launcher (pure)."""
    ca = ["--tls-ca", tls_ca] if tls_ca else []
    return [python, "-m", MODULE, "--secret-file", secret_file, *ca, "--", *server_argv]


def valkey_swaps_credentials(worker_pool_source: str) -> bool:
    """True when LMCache's valkey worker pool (its source text) passes the credentials to
    glide in the swapped order (LMCache 0.5.6)."""
    return _SWAPPED_CALL in worker_pool_source


def inject(argv: Sequence[str], secret: SharedSecret, *,
           valkey_swapped: bool) -> tuple[list[str], dict[str, str]]:
    """Put ``secret`` into the shared tier's ``--l2-adapter`` (pure).

    Returns (the in-process argv, environment entries to set in this process). ``resp``
    reads its credentials from the environment, ``valkey`` from its JSON. Raises KvpError
    when ``argv`` holds no shared-tier adapter, or more than one.
    """
    out = list(argv)
    env: dict[str, str] = {}
    found = 0
    for i, arg in enumerate(out[:-1]):
        if arg != "--l2-adapter":
            continue
        try:
            spec = json.loads(out[i + 1])
        except ValueError:
            continue
        if not isinstance(spec, dict) or spec.get("type") not in SHARED_TYPES:
            continue
        found += 1
        if spec["type"] == "resp":
            env = {RESP_ENV_USER: secret.username, RESP_ENV_PASSWORD: secret.password}
            continue
        user, password = secret.username, secret.password
        if valkey_swapped:
            user, password = password, user
        spec["username"], spec["password"] = user, password
        out[i + 1] = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    if found != 1:
        raise KvpError(f"expected one shared-tier --l2-adapter (resp or valkey), found {found}")
    return out, env


def _installed_valkey_swaps() -> bool:
    import importlib.util

    spec = importlib.util.find_spec(_WORKER_POOL)
    if spec is None or not spec.origin:
        return False
    return valkey_swaps_credentials(read_text(spec.origin, max_bytes=MAX_STATE_BYTES))


def main(argv: Sequence[str] | None = None) -> int:
    """``--secret-file FILE [--tls-ca CA] -- lmcache server ARGS...``: inject and run LMCache
    in-process."""
    args = list(sys.argv[1:] if argv is None else argv)
    ca = ""
    if len(args) >= 4 and args[2] == "--tls-ca":
        ca = args[3]
        del args[2:4]
    if len(args) < 4 or args[0] != "--secret-file" or args[2] != "--":
        print(f"usage: python -m {MODULE} --secret-file FILE [--tls-ca CA] -- "
              "lmcache server ARGS...", file=sys.stderr)
        return 2
    try:
        secret = read_secret_file(args[1])
        server, env = inject(args[3:], secret, valkey_swapped=_installed_valkey_swaps())
        if ca:
            check_ca_file(ca)
            env[CA_ENV] = ca
    except KvpError as exc:
        print(f"kvp-admin: {exc}", file=sys.stderr)
        return 2
    del secret
    os.environ.update(env)  # this process only: not the exec-time block /proc shows
    from lmcache.cli.main import main as lmcache_main

    sys.argv = ["lmcache", *server[1:]]
    result = lmcache_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
