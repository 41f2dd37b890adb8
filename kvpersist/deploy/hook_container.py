"""The ``KV_PERSIST=1`` hook for a recipe that runs vLLM in its own container: what the
recipe's ``docker run``/``podman run`` options may not mount.

vLLM's container never sees the cache root, kvpersist's state (state, log and model-link
directories), the L2 key or the shared tier's secret. :func:`mount_sources` reads the bind
sources of a run-options list (``-v SRC:DST[:OPTS]``, ``--volume[=]...``,
``--mount type=bind,source=SRC,...``); :func:`opts_problems` names each that is, holds or
lies in one of those paths (pure, paths as written and, by the caller, resolved).

``python -m kvpersist.deploy.hook_container CONFIG -- OPTS...`` (``scripts/kv-persist-hook.sh``)
exits 0, or 2 with the problems on stderr.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from kvpersist.config.deployment import Deployment, container_mount_problems, private_paths
from kvpersist.config.loader import load_deployment
from kvpersist.deploy.hook import split_args
from kvpersist.errors import KvpError, Problem


def mount_sources(opts: Sequence[str]) -> list[str]:
    """The host paths a run-options list bind-mounts (named volumes, without a leading
    ``/``, are not host paths and are left out)."""
    out: list[str] = []
    args = list(opts)
    i = 0
    while i < len(args):
        arg = args[i]
        value = None
        for flag in ("-v", "--volume", "--mount"):
            if arg == flag and i + 1 < len(args):
                value, i = args[i + 1], i + 1
            elif arg.startswith(flag + "=") or (flag == "-v" and arg.startswith("-v")
                                                and len(arg) > 2 and arg[2] != "="):
                value = arg[len(flag) + 1:] if arg.startswith(flag + "=") else arg[2:]
            if value is not None:
                if flag == "--mount":
                    fields = dict(f.split("=", 1) for f in value.split(",") if "=" in f)
                    value = fields.get("source") or fields.get("src") or ""
                else:
                    value = value.split(":", 1)[0]
                break
        if value and value.startswith("/"):
            out.append(value)
        i += 1
    return out


def opts_problems(dep: Deployment, opts: Sequence[str]) -> list[Problem]:
    """Every mount of ``opts`` that would show the container a private path of ``dep``
    (each compared as written and with symlinks resolved)."""
    problems: list[Problem] = []
    private = private_paths(dep.settings)
    for src in mount_sources(opts):
        for shown in dict.fromkeys((src, os.path.realpath(src))):
            problems += container_mount_problems(
                private, [("the recipe's container", shown)], "kv-persist-hook")
    return problems


def main(args: list[str] | None = None) -> int:
    """``python -m kvpersist.deploy.hook_container CONFIG -- RUN_OPTS...``: exit 0 when the
    recipe's container options show the container nothing private, else 2 naming each."""
    split = split_args(args, "python -m kvpersist.deploy.hook_container CONFIG -- RUN_OPTS...")
    if split is None:
        return 2
    config, run_opts = split
    try:
        dep = load_deployment(config)
    except KvpError as exc:
        print(f"kv-persist-hook: {exc}", file=sys.stderr)
        return 2
    problems = opts_problems(dep, run_opts)
    for p in problems:
        print(f"kv-persist-hook: {p}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
