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

With ``--off-record FILE`` the launcher first opens a TCP connection to the store, and when
no node answers it starts LMCache without the shared-tier adapter (the L1 and the NVMe serve as
with the store down), says so on stderr (the server's log) and writes FILE (this pid, when, the
adapter, the endpoint, the error): health reports the shared tier degraded until the cache
server restarts (docs/fleet.md, "Failure behaviour"). LMCache 0.5.6 cannot start with it:

- ``resp``: its native client (``lmcache.lmcache_redis``) starts its workers in the
  constructor; a worker whose connect fails closes its socket twice and never connects again.
  The second ``close()`` lands on whatever file the server's start has just opened under the
  same number (the L2 master key: ``OSError: [Errno 9] Bad file descriptor``), and the shared
  tier stays dead for the life of the process, also after the store comes back.
- ``valkey``: the adapter's constructor connects through glide, and a refused connection
  aborts the server's start (``ClosingError``): no cache server at all while the store is down.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpersist.config.shared_tier import (
    CA_ENV,
    RESP_ENV_PASSWORD,
    RESP_ENV_USER,
    SharedSecret,
)
from kvpersist.errors import KvpError
from kvpersist.l2.shared.credentials import check_ca_file, read_secret_file
from kvpersist.system.files import atomic_write_json
from kvpersist.system.procs import connect_problem
from kvpersist.system.untrusted import (
    MAX_STATE_BYTES,
    UnreadableFile,
    read_json_object,
    read_text,
)

MODULE = "kvpersist.stack.lmcache_exec"
SHARED_TYPES = ("resp", "valkey")
#: the swapped call in LMCache 0.5.6's ValkeyWorkerPool._get_client
_SWAPPED_CALL = "ServerCredentials(self._username, self._password)"
_WORKER_POOL = "lmcache.v1.storage_backend.valkey.worker_pool"
#: seconds the launcher waits for the store's TCP connection before it starts LMCache
#: without the shared tier
CONNECT_CHECK_S = 3.0


def exec_argv(python: str, secret_file: str, server_argv: Sequence[str],
              tls_ca: str = "", off_record: str = "") -> list[str]:
    """The command line that starts ``server_argv`` through this launcher (pure)."""
    ca = ["--tls-ca", tls_ca] if tls_ca else []
    off = ["--off-record", off_record] if off_record else []
    return [python, "-m", MODULE, "--secret-file", secret_file, *ca, *off, "--",
            *server_argv]


#: what LMCache 0.5.6 does with each adapter when the store does not answer at its start
_WHY_OFF = {"resp": "LMCache's RESP client would never connect later",
            "valkey": "LMCache's valkey adapter would abort the server's start"}


@dataclass(frozen=True)
class SharedOff:
    """The launcher started the cache server ``pid`` without the shared tier at ``since``
    (epoch seconds): the store at ``endpoint`` did not answer (``error``)."""

    pid: int
    since: float
    adapter: str
    endpoint: str
    error: str

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "since": self.since, "adapter": self.adapter,
                "endpoint": self.endpoint, "error": self.error}

    def message(self) -> str:
        """What health and the launch say about it."""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        why = _WHY_OFF.get(self.adapter, "")
        return (f"the cache server (pid {self.pid}) runs without the shared tier since "
                f"{when}: the store {self.endpoint} did not answer at its start "
                f"({self.error}){'; ' + why if why else ''}; restart the cache server once "
                "the store answers (`kvp-admin restart CONFIG --only server`, or its unit)")


def store_nodes(spec: dict[str, Any]) -> list[tuple[str, int]]:
    """The nodes a shared-tier adapter connects to at its start (pure): ``resp``'s host and
    port; ``valkey``'s first startup node, or every seed of a cluster (glide needs one).
    Empty when the spec names none."""
    if spec.get("type") == "resp":
        host, port = spec.get("host"), spec.get("port")
        if isinstance(host, str) and isinstance(port, int) and not isinstance(port, bool):
            return [(host, port)]
        return []
    nodes = []
    for chunk in str(spec.get("startup_nodes", "")).split(","):
        host, sep, port = chunk.strip().rpartition(":")
        if sep and host and port.isdigit():
            nodes.append((host.strip("[]"), int(port)))
    return nodes if spec.get("cluster_mode") else nodes[:1]


def read_off_record(path: str, server_pid: int | None) -> SharedOff | None:
    """The record at ``path`` when it names ``server_pid`` (a record of an earlier process
    is stale: None). A record that cannot be read is None too: health then reports what the
    store probe sees. Never raises."""
    if not path or server_pid is None:
        return None
    try:
        doc = read_json_object(path, follow=False, max_bytes=MAX_STATE_BYTES)
    except (FileNotFoundError, UnreadableFile):
        return None
    pid, since = doc.get("pid"), doc.get("since")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid != server_pid or \
            not isinstance(since, (int, float)) or isinstance(since, bool):
        return None
    return SharedOff(pid, float(since), str(doc.get("adapter", ""))[:20],
                     str(doc.get("endpoint", ""))[:200], str(doc.get("error", ""))[:500])


def off_note(path: str, server_pid: int | None) -> dict[str, Any] | None:
    """:func:`read_off_record` as health's JSON shows it (with its message), or None."""
    off = read_off_record(path, server_pid)
    return None if off is None else {**off.to_dict(), "message": off.message()}


def shared_adapters(argv: Sequence[str]) -> list[tuple[int, dict[str, Any]]]:
    """(index of the JSON in ``argv``, the spec) of each shared-tier ``--l2-adapter``
    (pure)."""
    out = []
    for i, arg in enumerate(argv[:-1]):
        if arg != "--l2-adapter":
            continue
        try:
            spec = json.loads(argv[i + 1])
        except ValueError:
            continue
        if isinstance(spec, dict) and spec.get("type") in SHARED_TYPES:
            out.append((i + 1, spec))
    return out


def without_adapter(argv: Sequence[str], index: int) -> list[str]:
    """``argv`` without the ``--l2-adapter`` whose JSON stands at ``index`` (pure)."""
    return [a for i, a in enumerate(argv) if i not in (index - 1, index)]


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
    found = shared_adapters(out)
    if len(found) != 1:
        raise KvpError("expected one shared-tier --l2-adapter (resp or valkey), found "
                       f"{len(found)}")
    i, spec = found[0]
    if spec["type"] == "resp":
        env = {RESP_ENV_USER: secret.username, RESP_ENV_PASSWORD: secret.password}
        return out, env
    user, password = secret.username, secret.password
    if valkey_swapped:
        user, password = password, user
    spec["username"], spec["password"] = user, password
    out[i] = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return out, env


def _installed_valkey_swaps() -> bool:
    import importlib.util

    spec = importlib.util.find_spec(_WORKER_POOL)
    if spec is None or not spec.origin:
        return False
    return valkey_swaps_credentials(read_text(spec.origin, max_bytes=MAX_STATE_BYTES))


def _store_down(server: list[str], env: dict[str, str],
                off_record: str) -> tuple[list[str], dict[str, str]]:
    """When no node of the shared tier's store answers: the argv without its adapter, no
    store credentials, the record written and the warning printed. Else as given, and a
    record of an earlier process removed."""
    found = shared_adapters(server)
    if not found:
        return server, env
    i, spec = found[0]
    nodes = store_nodes(spec)
    problems = [connect_problem(h, p, CONNECT_CHECK_S) for h, p in nodes]
    if nodes and not all(problems):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(off_record)
        return server, env
    endpoint = ",".join(f"{h}:{p}" for h, p in nodes) or "?"
    off = SharedOff(os.getpid(), time.time(), str(spec["type"]), endpoint,
                    "; ".join(problems) or "no node in the adapter")
    print(f"kvp-admin: WARNING: {off.message()}", file=sys.stderr, flush=True)
    try:
        atomic_write_json(off_record, off.to_dict())
    except OSError as exc:
        print(f"kvp-admin: WARNING: {off_record} not written: {exc}", file=sys.stderr)
    return without_adapter(server, i), {k: v for k, v in env.items()
                                         if k not in (RESP_ENV_USER, RESP_ENV_PASSWORD)}


def main(argv: Sequence[str] | None = None) -> int:
    """``--secret-file FILE [--tls-ca CA] [--off-record FILE] -- lmcache server ARGS...``:
    inject and run LMCache in-process."""
    args = list(sys.argv[1:] if argv is None else argv)
    opts: dict[str, str] = {}
    while len(args) >= 2 and args[0] in ("--secret-file", "--tls-ca", "--off-record"):
        opts[args[0]] = args[1]
        del args[:2]
    if "--secret-file" not in opts or len(args) < 2 or args[0] != "--":
        print(f"usage: python -m {MODULE} --secret-file FILE [--tls-ca CA] "
              "[--off-record FILE] -- lmcache server ARGS...", file=sys.stderr)
        return 2
    ca = opts.get("--tls-ca", "")
    try:
        secret = read_secret_file(opts["--secret-file"])
        server, env = inject(args[1:], secret, valkey_swapped=_installed_valkey_swaps())
        if ca:
            check_ca_file(ca)
            env[CA_ENV] = ca
    except KvpError as exc:
        print(f"kvp-admin: {exc}", file=sys.stderr)
        return 2
    del secret
    if opts.get("--off-record"):
        server, env = _store_down(server, env, opts["--off-record"])
    os.environ.update(env)  # this process only: not the exec-time block /proc shows
    from lmcache.cli.main import main as lmcache_main

    sys.argv = ["lmcache", *server[1:]]
    result = lmcache_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
