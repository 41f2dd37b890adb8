"""The hot-files pre-read at launch (I/O): warm the page cache with the namespace's most
recently used chunk files while vLLM loads.

:func:`start_preread` forks ``python -m kvpersist.stack.preread`` detached (own session, its
own log), so the launch never waits for it and nothing it meets can fail the launch: the
launch only records that it started (or why not). The child lists the namespace's chunk files
(:func:`kvpersist.l2.tree.chunk_dirs`: never through a symlink, never into ``.kvpersist`` or a
foreign directory; only names that parse as chunk files of this namespace, only regular
files), lets :func:`kvpersist.l2.hot_files.plan_preread` choose the newest ones up to the cap,
opens each with ``O_NOFOLLOW`` relative to its directory and calls
``posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED)``: the kernel reads the file into the page
cache in the background; nothing is read into this process. The child writes one JSON line
(``kvpersist.preread/1``) to its log when done.

The pre-read helps only buffered reads: with ``l2.use_direct_io`` the server opens its files
with ``O_DIRECT`` and never looks at the page cache, so
:func:`kvpersist.l2.hot_files.off_reason` turns it off there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat as stat_mod
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvpersist.l2.hot_files import Candidate, PrereadPlan, plan_preread, preread_cap
from kvpersist.l2.layout import parse_chunk_name, prefix_for_model_name
from kvpersist.l2.tree import FILE_FLAGS, RootDir, chunk_dirs, open_rel, open_root
from kvpersist.system import procs

SCHEMA = "kvpersist.preread/1"
MODULE = "kvpersist.stack.preread"


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    """``MemAvailable`` in bytes (0 if it cannot be read)."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def list_candidates(root_fd: int, namespace: str,
                    errors: list[str] | None = None) -> list[Candidate]:
    """The chunk files of ``namespace`` below the open cache root: regular files whose names
    parse as chunk names with the namespace's prefix (flat or in ``ab/cd`` shard
    directories). Symlinks, temp files, other prefixes and unparseable names are left out;
    directories that cannot be listed go to ``errors``."""
    prefix = prefix_for_model_name(namespace)
    out: list[Candidate] = []

    def on_error(rel: str, exc: OSError) -> None:
        if errors is not None:
            errors.append(f"{rel or '.'}: {exc.strerror or exc}")

    with chunk_dirs(root_fd, on_error=on_error) as walk:
        for d in walk:
            try:
                for e in d.entries():
                    name = e.name
                    if not name.startswith(prefix):
                        continue
                    chunk = parse_chunk_name(name)
                    if chunk is None or chunk.prefix != prefix:
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue  # gone since the listing
                    if not stat_mod.S_ISREG(st.st_mode):
                        continue
                    out.append(Candidate(d.path_of(name), st.st_size,
                                         max(st.st_mtime_ns, st.st_atime_ns)))
            except OSError as exc:
                on_error(d.rel, exc)
    return out


@dataclass
class PrereadResult:
    """What one pre-read did: the plan, the files it advised (relative paths), the bytes, and
    the time the listing and the advice calls took. ``errors`` holds what was skipped."""

    plan: PrereadPlan
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {"schema": SCHEMA, **self.plan.to_dict(), "advised_files": len(self.files),
                "advised_bytes": self.bytes, "seconds": round(self.seconds, 3),
                "errors": self.errors[:20]}


def advise(root_fd: int, rel: str) -> int:
    """``posix_fadvise(WILLNEED)`` on the whole of file ``rel`` (below the root), opened
    without following a symlink at any level. Returns its size. Raises OSError (ELOOP for a
    symlink, EINVAL for something that is not a regular file, ENOENT when it is gone)."""
    head, _, name = rel.rpartition("/")
    dfd = open_rel(root_fd, head)
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            raise OSError(22, "not a regular file", rel)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return st.st_size
    finally:
        os.close(fd)


def preread(root: RootDir, namespace: str, *, cap_bytes: int) -> PrereadResult:
    """Plan and issue the pre-read of ``namespace`` under the open ``root`` (at most
    ``cap_bytes``). A file that is gone, became a symlink or cannot be opened is skipped and
    listed in ``errors``."""
    t = time.perf_counter()
    errors: list[str] = []
    plan = plan_preread(list_candidates(root.fd, namespace, errors), cap_bytes)
    res = PrereadResult(plan, errors=errors)
    for c in plan.files:
        try:
            res.bytes += advise(root.fd, c.rel)
        except (OSError, ValueError) as exc:
            errors.append(f"{c.rel}: {getattr(exc, 'strerror', None) or exc}")
            continue
        res.files.append(c.rel)
    res.seconds = time.perf_counter() - t
    return res


# --------------------------------------------------------------------------- launching it


def preread_argv(python: str, root: str, namespace: str, share: float) -> list[str]:
    """The pre-read child's argv (plain data)."""
    return [python, "-m", MODULE, "--root", root, "--namespace", namespace,
            "--share", repr(share)]


def start_preread(argv: Sequence[str], *, log: str, cwd: str) -> tuple[int | None, str]:
    """Start the pre-read child detached; never raises. Returns its pid and '' or None and
    why it did not start."""

    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "HOME")}
    # the child must import this very kvpersist (its cwd is the state dir)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", ""))
        if p)
    try:
        proc = procs.start_background(argv, log_path=log, cwd=cwd, umask=0o077, env=env)
    except OSError as exc:
        return None, f"pre-read not started: {exc.strerror or exc}"
    return proc.pid, ""


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=MODULE, description="pre-read a namespace's newest "
                                 "chunk files into the page cache (posix_fadvise WILLNEED)")
    ap.add_argument("--root", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--share", type=float, required=True,
                    help="share of MemAvailable to fill (0 < share <= 1)")
    args = ap.parse_args(argv)
    with contextlib.suppress(OSError):
        os.nice(10)  # below the launch and vLLM's weight loading
    try:
        avail = mem_available()
        # the child's one use case: it opens the root once (UsageError/KvpError reported)
        with open_root(args.root, purpose="pre-read") as root:
            res = preread(root, args.namespace, cap_bytes=preread_cap(avail, args.share))
        out = {**res.to_dict(), "mem_available": avail, "share": args.share}
    except Exception as exc:  # noqa: BLE001 - a background helper reports, never raises
        out = {"schema": SCHEMA, "error": str(exc)}
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(json.dumps(out, sort_keys=True), flush=True)
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
