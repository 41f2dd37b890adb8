"""A lab that makes LMCache's L2 prefetches fail on purpose, for real.

Used by ``tests/integration/test_failure_paths.py`` (a few trials, asserted) and
``bench/failure_paths.py`` (many trials, counted). Nothing is mocked: a stock ``lmcache
server`` runs the argv kvpersist renders for a relocated cpu-demo deployment (aesgcm serde,
``nixl_store_dynamic`` on POSIX, O_DIRECT), started like a service user's server: umask 077
and without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, so that a chunk file made unreadable
(mode 000) really answers EACCES even when the tests run as root. Sequences of many chunks are
stored through LMCache's own client stack (:mod:`kvpersist.demo.kvdriver`), with the digest
of every chunk as stored (client side) and of every chunk file's plaintext (decrypted with
the deployment's key, as ``kvp-admin verify`` reads it) recorded at store time.

A trial looks one sequence up from L2 (and retrieves what hit, as vLLM does) while a fault
hits one of its chunk files; how the fault is timed against the prefetch (``hold``):

* ``fifo``: an earlier chunk of the same sequence is a FIFO; LMCache's adapter opens it in
  its event loop, which blocks there (every chunk after it has been looked up -- stat'ed --
  but not yet opened); the fault is applied, then the FIFO is opened for writing so that the
  load goes on: the fault lands exactly between the lookup and the read of the chunk;
* ``sigstop``: the server is stopped (SIGSTOP) a random 0-60 ms after the lookup was sent,
  the fault applied, and the server continued 0.2 s later;
* ``race``: the fault is applied a random 0-80 ms after the lookup was sent.

The faults (:data:`FAULTS`) are applied to a chunk ``j >= 3`` of the sequence; the ones that
put another chunk's valid frame there (:data:`PLANTING`) take it from a pool of donor
sequences stored for that purpose (other bytes; a donor missing afterwards never hides the
target behind a shorter prefix).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests

from kvpersist.demo.kvdriver import KVDriver, connect
from kvpersist.l2.frames import decrypt, derive_key
from kvpersist.l2.keys import store as keys

#: tokens per sequence (16 chunks of 256 tokens: a wide prefetch)
TOKENS = 4096
CHUNKS = TOKENS // 256

#: the faults that put another chunk's valid frame under the chunk's name
PLANTING = ("authentic", "moved", "hardlink", "symlink")

#: what happens to the chunk file while its prefetch runs
FAULTS = (
    "truncate",   # cut to half its size (page aligned)
    "unlink",     # removed
    "eacces",     # mode 000: the server (no DAC override) gets EACCES
    "random",     # replaced (rename over) by random bytes of the same size
    "inplace",    # overwritten in place (same inode) with random bytes
    "authentic",  # replaced (rename over) by a copy of another chunk's file: a valid frame
    "moved",      # another chunk's file renamed over it (that chunk's name disappears)
    "hardlink",   # replaced by a hard link to another chunk's file
    "symlink",    # replaced by a symbolic link to another chunk's file
)
HOLDS = ("fifo", "sigstop", "race")

_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


def _as_service_user() -> None:  # runs in the child between fork and exec
    os.umask(0o077)
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def lab_env(root: Path, free_port: Callable[[], int]) -> dict[str, str]:
    """The environment relocating the cpu-demo deployment to ``root`` on free loopback ports
    (this environment without its ``KVP_`` variables, plus those)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    env.update({"KVP_CACHE_ROOT": str(root), "KVP_LMCACHE_PORT": str(free_port()),
                "KVP_LMCACHE_HTTP_PORT": str(free_port()), "KVP_VLLM_PORT": str(free_port()),
                "KVP_L1_SIZE_GB": "1", "KVP_L2_BUDGET": "4G", "KVP_L2_RESERVE": "1M",
                "LMCACHE_DISABLE_BANNER": "1"})
    return env


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@dataclass
class Outcome:
    """What one trial saw. ``wrong`` counts retrieves whose digests differ from the digests
    recorded at store time for the chunks that arrived."""

    fault: str
    hold: str
    seq: int
    chunk: int
    target: str = ""
    donor: str = ""  # the chunk whose valid frame a planting fault put under ``target``
    during: tuple[int, bool | None] = (0, None)  # (hit chunks, retrieved bytes == stored)
    after: tuple[int, bool | None] = (0, None)
    recomputed: tuple[int, bool | None] | None = None
    final: tuple[int, bool | None] = (0, None)  # after a restart
    wrong: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Lab:
    """One deployment: its server process, its stored sequences and what they hold."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        """Prepare the relocated cpu-demo deployment of ``env`` (``lab_env``) under ``tmp``:
        preflight and state (the serde key) exactly as a launch does; nothing started."""
        from kvpersist.stack import launch as lc
        from kvpersist.stack.launch_plan import prepare_launch
        from kvpersist.stack.preflight import preflight
        from kvpersist.stack.warm import chunk_keys as warm_keys

        self.tmp = tmp
        self.env = env
        self.root = Path(env["KVP_CACHE_ROOT"])
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        p = prepare_launch("cpu-demo", environ=env)
        pre = preflight(p.plan, p.sizing, with_vllm=False)
        if pre.problems:
            raise RuntimeError(f"preflight: {pre.problems}")
        lc.prepare_state(p.plan, p.rendered, p.sizing, weights=pre.weights)
        self.plan = p.plan
        self.ns = p.plan.namespace
        self.key = derive_key(keys.read_key(p.plan.serde_key_file))
        self.scheme = warm_keys.key_scheme(p.plan.server_argv)
        self.rpc = f"tcp://127.0.0.1:{p.plan.listen['lmcache'][1]}"
        self.http = p.plan.server_http_url
        self.log = tmp / "lmcache-server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.stored: dict[int, list[str]] = {}   # sequence -> client digests per chunk
        self.names: dict[int, list[str]] = {}    # sequence -> chunk file names
        self.plain: dict[str, str] = {}          # chunk file name -> plaintext sha256
        self.frame_plaintext: int | None = None  # plaintext bytes of a chunk's frame

    # -- the server
    def start(self, timeout: float = 120) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.plan.server_argv, env=self.plan.server_env,
                                         cwd=self.plan.state_dir, stdout=log,
                                         stderr=subprocess.STDOUT,
                                         preexec_fn=_as_service_user)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.tail()}")
            if self.healthy(1.0):
                return
            time.sleep(0.3)
        raise RuntimeError(f"server not healthy: {self.tail()}")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (a clean stop), SIGKILL after ``timeout``; the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def restart(self) -> None:
        self.stop()
        self.start()

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            return requests.get(f"{self.http}/healthcheck", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def status(self) -> dict[str, Any]:
        return dict(requests.get(f"{self.http}/status", timeout=5).json())

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    @contextlib.contextmanager
    def driver(self) -> Iterator[KVDriver]:
        with connect(self.rpc, self.http, self.ns, num_tokens=TOKENS, pristine=True) as d:
            yield d

    # -- what is stored
    def chunk_names(self, seq: int) -> list[str]:
        from lmcache.cli.commands.bench.server_bench.helpers import _build_token_ids

        from kvpersist.stack.warm import chunk_keys as warm_keys

        names, _ = warm_keys.chunk_files(self.scheme, self.ns, 1,
                                         _build_token_ids(seq, TOKENS))
        return names

    def present(self, names: list[str]) -> set[str]:
        return {n for n in names if (self.root / n).exists()}

    def store_through_l1(self, d: KVDriver, enough: Callable[[set[str]], bool],
                         most: int = 72) -> list[int]:
        """Store sequences 1, 2, ... (8 MiB each) 12 at a time until ``enough`` holds of the
        chunk files on disk once the stores in flight have landed, or ``most`` sequences are
        stored; the sequences stored. Through a small L1: LMCache reuses its memory only
        once the L1 is full, and how many frames then land on stale bytes varies from run to
        run (7 to 51 of 240-288 files after 24 sequences through 128 MiB, seen here)."""
        seqs: list[int] = []
        while len(seqs) < most:
            for s in range(len(seqs) + 1, min(len(seqs) + 12, most) + 1):
                self.stored[s] = d.store(s)
                self.names[s] = self.chunk_names(s)
                seqs.append(s)
                time.sleep(0.5)  # on disk before L1 reuses the memory (else some are dropped)
            names = [n for s in seqs for n in self.names[s]]
            seen: list[int] = []  # the stores in flight land: the count stays for 2 s
            deadline = time.monotonic() + 60
            while len(seen) < 5 or seen[-1] != seen[-5]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"chunk files still appearing: {seen}")
                seen.append(len(self.present(names)))
                time.sleep(0.5)
            if enough(self.present(names)):
                break
        return seqs

    def store(self, d: KVDriver, seqs: list[int], timeout: float = 120) -> None:
        """Store ``seqs``, wait for every chunk file, record the digests and plaintexts."""
        for s in seqs:
            self.stored[s] = d.store(s)
            self.names[s] = self.chunk_names(s)
        want = [n for s in seqs for n in self.names[s]]
        deadline = time.monotonic() + timeout
        while not all((self.root / n).exists() for n in want):
            if time.monotonic() > deadline:
                raise RuntimeError("chunk files did not appear")
            time.sleep(0.2)
        time.sleep(0.3)  # the last rename may be a hair later than exists()
        for _ in range(2):  # again once the frame length is known (stale padding)
            for n in want:
                if n not in self.plain and (plain := self.plaintext(n)) is not None:
                    self.plain[n] = plain
        failing = [n for n in want if n not in self.plain]
        if failing:
            raise RuntimeError(f"{failing[:3]} do not authenticate right after the store")

    def plaintext(self, name: str) -> str | None:
        """sha256 of the plaintext of chunk file ``name`` (through a symlink, as LMCache
        reads it), None if absent, unreadable or failing authentication."""
        try:
            blob = (self.root / name).read_bytes()
        except OSError:
            return None
        # the frame length, once known: LMCache pads a frame with stale L1 bytes, so trailing
        # zeros do not always tell where it ends (docs/lmcache-publish-path.md)
        plain = decrypt(blob, self.key, self.frame_plaintext)
        if plain is None:
            return None
        self.frame_plaintext = len(plain)
        return sha(plain)

    def audit_l2(self, planted: dict[str, str] | None = None) -> dict[str, int]:
        """Every stored chunk name: as stored, absent, failing (a miss for LMCache), holding
        the valid frame a fault planted there (``planted``: target name -> donor name), or
        authenticating with any other plaintext: wrong bytes at rest that LMCache wrote."""
        planted = planted or {}
        out = {"same": 0, "absent": 0, "fails": 0, "planted": 0, "written_other": 0}
        for name, want in self.plain.items():
            p = self.root / name
            if not os.path.lexists(p):
                out["absent"] += 1
                continue
            got = self.plaintext(name)
            if got is None:
                out["fails"] += 1
            elif got == want:
                out["same"] += 1
            elif name in planted and got == self.plain.get(planted[name]):
                out["planted"] += 1
            else:
                out["written_other"] += 1
        return out


# --------------------------------------------------------------------------- faults


def apply_fault(root: Path, fault: str, target: str, donor: str, rng: random.Random) -> None:
    """Do ``fault`` to chunk file ``target`` (another chunk's file ``donor`` for the ones
    that plant a valid frame). Temporary names carry no ``.tmp.`` (LMCache's clean-up)."""
    t, src = root / target, root / donor
    tmp = root / f"fault~{rng.getrandbits(32):08x}"
    if fault == "truncate":
        os.truncate(t, (t.stat().st_size // 2) // 4096 * 4096)
    elif fault == "unlink":
        t.unlink()
    elif fault == "eacces":
        t.chmod(0)
    elif fault == "random":
        tmp.write_bytes(os.urandom(t.stat().st_size))
        os.rename(tmp, t)
    elif fault == "inplace":
        with open(t, "r+b") as f:
            f.write(os.urandom(t.stat().st_size))
    elif fault == "authentic":
        tmp.write_bytes(src.read_bytes())
        os.rename(tmp, t)
    elif fault == "moved":
        os.rename(src, t)
    elif fault == "hardlink":
        os.link(src, tmp)
        os.rename(tmp, t)
    elif fault == "symlink":
        os.symlink(donor, tmp)
        os.rename(tmp, t)
    else:
        raise ValueError(fault)


def _judge(got: list[str] | None, want: list[str]) -> bool | None:
    """None when nothing arrived; else whether the chunks that arrived are the stored ones."""
    if got is None:
        return None
    return got == want[:len(got)]


def run_trial(lab: Lab, d: KVDriver, seq: int, fault: str, hold: str, rng: random.Random,
              donors: list[str] | None = None) -> Outcome:
    """Look ``seq`` up (prefix retrieve) while ``fault`` hits one of its chunks, timed by
    ``hold``; then again; then, if it no longer hits fully, recompute and store it (what vLLM
    does after a miss) and look it up once more. A planting fault takes the frame it puts
    there from the first of ``donors`` (chunk files) whose plaintext differs, and removes it
    from the list (the simulated engine's sequences share KV blocks: some chunks hold the
    same bytes). Raises ValueError if none is left."""
    t0 = time.monotonic()
    names = lab.names[seq]
    j = rng.randrange(3, CHUNKS)
    donor = ""
    if fault in PLANTING:
        pool = donors if donors is not None else []
        donor = next((n for n in pool if lab.plain[n] != lab.plain[names[j]]), "")
        if not donor:
            raise ValueError(f"{fault} needs a donor chunk with other bytes")
        pool.remove(donor)
    out = Outcome(fault, hold, seq, j, names[j], donor)
    box: dict[str, Any] = {}

    def look() -> None:
        try:
            box["r"] = d.lookup_and_retrieve(seq, prefix=True)
        except Exception as exc:  # recorded, never swallowed silently
            box["e"] = repr(exc)

    def hit() -> None:
        apply_fault(lab.root, fault, names[j], donor, rng)

    th = threading.Thread(target=look)
    if hold == "fifo":
        with fifo_hold(lab, names[1]) as release:
            th.start()
            time.sleep(0.4)  # the adapter's event loop is now blocked opening the FIFO
            hit()
            release()  # the load goes on (the FIFO's chunk fails)
            th.join(30)
    elif hold == "sigstop":
        assert lab.proc is not None
        th.start()
        time.sleep(rng.uniform(0, 0.06))
        os.kill(lab.proc.pid, signal.SIGSTOP)
        try:
            hit()
            time.sleep(0.2)
        finally:
            os.kill(lab.proc.pid, signal.SIGCONT)
        th.join(30)
    else:
        th.start()
        time.sleep(rng.uniform(0, 0.08))
        hit()
        th.join(30)
    if th.is_alive():
        out.notes.append("the lookup did not return in 30 s")
        th.join()
    if "e" in box:
        out.notes.append(f"lookup raised {box['e']}")
    else:
        lk, got = box["r"]
        out.during = (lk.hit_chunks, _judge(got, lab.stored[seq]))
    lk, got = d.lookup_and_retrieve(seq, prefix=True)
    out.after = (lk.hit_chunks, _judge(got, lab.stored[seq]))
    if lk.hit_chunks < CHUNKS:
        if d.recompute(seq) != lab.stored[seq]:
            out.notes.append("the recomputed KV differs from the stored")
        lk, got = d.lookup_and_retrieve(seq, prefix=True)
        out.recomputed = (lk.hit_chunks, _judge(got, lab.stored[seq]))
    out.wrong = sum(1 for r in (out.during, out.after, out.recomputed)
                    if r is not None and r[1] is False)
    out.seconds = round(time.monotonic() - t0, 2)
    return out


@contextlib.contextmanager
def fifo_hold(lab: Lab, name: str) -> Iterator[Callable[[], None]]:
    """Chunk file ``name`` set aside and a FIFO in its place, so that LMCache's adapter, when
    it loads that chunk, blocks in ``open()`` in its event loop; yields ``release()`` (opens
    the FIFO for writing: the adapter's open returns, that chunk's read fails, the loop goes
    on). On exit the FIFO is released if it was not, and the chunk file put back."""
    path = lab.root / name
    aside = lab.tmp / f"aside~{name}"
    os.rename(path, aside)
    os.mkfifo(path, 0o600)
    fds: list[int] = []

    def release() -> None:
        if not fds:
            fds.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    try:
        yield release
    finally:
        with contextlib.suppress(OSError):
            release()
        time.sleep(0.2)
        for fd in fds:
            os.close(fd)
        os.unlink(path)
        os.rename(aside, path)


def final_pass(lab: Lab, d: KVDriver, outcomes: list[Outcome]) -> None:
    """After a restart: each trial's sequence looked up (prefix retrieve) once more."""
    for o in outcomes:
        lk, got = d.lookup_and_retrieve(o.seq, prefix=True)
        o.final = (lk.hit_chunks, _judge(got, lab.stored[o.seq]))
        if o.final[1] is False:
            o.wrong += 1


def timeout_trial(lab: Lab, d: KVDriver, seq: int, stop_s: float,
                  rng: random.Random) -> dict[str, Any]:
    """SIGSTOP the server a random 0-60 ms after a lookup of ``seq`` was sent, for
    ``stop_s`` seconds (past the client's 10 s RPC timeout, as past vLLM's ``mq_timeout``):
    what the lookup returned, then the same sequence looked up again, and the L1 read locks
    the server holds afterwards."""
    assert lab.proc is not None
    box: dict[str, Any] = {}

    def look() -> None:
        box["r"] = d.lookup_and_retrieve(seq, prefix=True)

    th = threading.Thread(target=look)
    th.start()
    time.sleep(rng.uniform(0, 0.06))
    os.kill(lab.proc.pid, signal.SIGSTOP)
    time.sleep(stop_s)
    os.kill(lab.proc.pid, signal.SIGCONT)
    th.join(60)
    lk, got = box["r"]
    lk2, got2 = d.lookup_and_retrieve(seq, prefix=True)
    return {"seq": seq, "during": [lk.hit_chunks, _judge(got, lab.stored[seq])],
            "after": [lk2.hit_chunks, _judge(got2, lab.stored[seq])],
            "healthy": lab.healthy(), "l1_read_locked": read_locked(lab)}


def read_locked(lab: Lab) -> int:
    """L1 objects the server holds read-locked now (``/status``)."""
    l1 = lab.status()["storage_manager"]["l1_managers"]
    return sum(int(m.get("read_locked_count", 0)) for m in l1.values())


def prefetch_pending(lab: Lab, seq: int, wait_s: float) -> dict[str, Any]:
    """``POST /cache/prefetches`` of sequence ``seq`` (another request that needs L2), then
    its status after ``wait_s`` seconds."""
    from lmcache.cli.commands.bench.server_bench.helpers import _build_token_ids

    r = requests.post(f"{lab.http}/cache/prefetches", timeout=10, json={
        "model_name": lab.ns, "world_size": 1,
        "token_ids": list(_build_token_ids(seq, TOKENS))})
    r.raise_for_status()
    rid = r.json()["request_id"]
    time.sleep(wait_s)
    return {"request_id": rid, **requests.get(f"{lab.http}/cache/prefetches/{rid}",
                                               timeout=10).json()}


def hang_trial(lab: Lab, d: KVDriver, seq: int, other: int, hold_s: float) -> dict[str, Any]:
    """A FIFO under one chunk name of ``seq`` (nobody writes to it): the lookup of ``seq``,
    then a warm-up prefetch of another sequence ``other`` from L2, ``hold_s`` seconds later
    still pending while the server answers ``/healthcheck``; then the FIFO released."""
    out: dict[str, Any] = {"seq": seq, "other": other}
    box: dict[str, Any] = {}
    with fifo_hold(lab, lab.names[seq][1]) as release:
        th = threading.Thread(target=lambda: box.setdefault(
            "r", d.lookup_and_retrieve(seq, prefix=True)))
        t0 = time.monotonic()
        th.start()
        th.join(60)
        lk, got = box["r"]
        out["lookup"] = [lk.hit_chunks, _judge(got, lab.stored[seq]),
                         round(time.monotonic() - t0, 1)]
        out["other_prefetch"] = prefetch_pending(lab, other, hold_s)
        out["healthcheck_200"] = lab.healthy()
        adapters = lab.status()["storage_manager"]["l2_adapters"]
        out["adapter_reported_healthy"] = all(a.get("is_healthy") for a in adapters)
        release()
        time.sleep(1.0)
        rid = out["other_prefetch"]["request_id"]
        out["other_after_release"] = requests.get(f"{lab.http}/cache/prefetches/{rid}",
                                                  timeout=10).json()
    lk, got = d.lookup_and_retrieve(seq, prefix=True)
    out["after"] = [lk.hit_chunks, _judge(got, lab.stored[seq])]
    return out


def shutdown_trial(lab: Lab, d: KVDriver, seq: int, wait_s: float = 30) -> dict[str, Any]:
    """SIGTERM the server while a prefetch of ``seq`` is in its load phase (held by a FIFO):
    how long the stop takes (the FIFO released after ``wait_s`` if it has not exited), its
    exit status; then a start and ``seq`` looked up again."""
    assert lab.proc is not None
    out: dict[str, Any] = {"seq": seq}
    box: dict[str, Any] = {}

    def look() -> None:
        try:
            box["r"] = d.lookup_and_retrieve(seq, prefix=True)
        except Exception as exc:
            box["e"] = repr(exc)

    with fifo_hold(lab, lab.names[seq][1]) as release:
        th = threading.Thread(target=look)
        th.start()
        time.sleep(0.4)
        t0 = time.monotonic()
        lab.proc.send_signal(signal.SIGTERM)
        try:
            lab.proc.wait(wait_s)
            out["stopped_while_held"] = True
        except subprocess.TimeoutExpired:
            out["stopped_while_held"] = False
            release()
            try:
                lab.proc.wait(60)
            except subprocess.TimeoutExpired:
                lab.proc.kill()
                lab.proc.wait()
        out["stop_seconds"] = round(time.monotonic() - t0, 1)
        out["exit_status"] = lab.proc.returncode
        th.join(60)
    return out
