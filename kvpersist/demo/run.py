"""The main job: ``kvp-admin demo`` on the built-in CPU demo deployment.

Generates the demo model (once), launches the real cache server and vLLM (CPU build) with a
warm set holding the chat's opening (every message but the last question), sends a long
chat, and sends it again on the running deployment (vLLM's own prefix cache: what a
returning user sees while nothing restarts); restarts both (the warm-up loads the opening
into vLLM before ready), sends it again, and reports cold, running and after-restart
time-to-first-token, the tokens served from disk, whether the output is identical, and what
is on disk; then stops both. Everything lives under one working directory (default
``./kvp-demo``): the model, the cache root, logs.

Each run uses a fresh chat (a new seed), so the "cold" request is really cold even when the
cache root already holds files from earlier runs; nothing is deleted.

Every failure is a :class:`~kvpersist.errors.KvpError`: kvpersist's own errors as they are,
any other error of a step (a directory that cannot be written, a model that cannot be
generated, a process or a request that fails) a :class:`~kvpersist.errors.DemoFailed` naming
the step, the error on one line and what to do (:func:`step`).
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpersist.config.loader import resolve_config
from kvpersist.demo.chat import chat_completion, long_chat
from kvpersist.demo.model import generate_model, identity_env_values
from kvpersist.errors import DemoFailed, KvpError
from kvpersist.l2.scan import scan_root
from kvpersist.l2.tree import open_root
from kvpersist.stack import launch as lc
from kvpersist.stack.launch_options import LaunchOptions
from kvpersist.stack.launch_plan import prepare_launch
from kvpersist.stack.processes import stop_deployment
from kvpersist.system import procs
from kvpersist.system.vllm_client import VllmClient
from kvpersist.system.vllm_seam import METRIC_EXTERNAL_PREFIX_HITS, METRIC_PREFIX_HITS

#: the most of the server's log read for its L2 hits (what one demo run writes is far less)
LOG_READ_BYTES = 64 << 20

Progress = Callable[[str], None]
HITS_METRIC = METRIC_EXTERNAL_PREFIX_HITS
#: served in float32 (weights and KV): vLLM's CPU build computes the same tokens from a full
#: prefill and from loaded KV in float32, not always in bfloat16 (near-tied logits of random
#: weights flip under last-bit differences), and the demo checks the output is identical
FLOAT32 = {"KVP_KV_CACHE_DTYPE": "float32", "KVP_MODEL_DTYPE": "float32"}
FLOAT32_SIZES = ("demo",)


@dataclass
class Phase:
    name: str
    launch_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    prompt_tokens: int = 0
    tokens_from_disk: float = 0.0
    #: the chat's tokens from vLLM's own prefix cache: after a restart, what the launch's
    #: warm-up loaded there from the cache server before ready
    tokens_from_prefix_cache: float = 0.0
    l2_chunks_hit: int = 0
    text: str = ""
    #: the same chat once more right after (the running deployment: vLLM's prefix cache)
    running_ttft_s: float = 0.0
    #: after a restart: from the stop to the returning chat's first token (stop + launch +
    #: time to first token)
    downtime_s: float = 0.0


@dataclass
class DemoResult:
    workdir: str
    size: str
    namespace: str
    cache_root: str
    seed: int
    cold: Phase
    warm: Phase
    identical: bool
    ttft_ratio: float
    #: the warm-set user's first chat after the restart over the same chat on the running
    #: deployment before it
    running_ratio: float = 0.0
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = "kvpersist.demo/1"
        return d


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` of ``exc`` on one line, at most ``limit`` characters."""
    text = f"{type(exc).__name__}: {' '.join(str(exc).split()) or '(no message)'}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextmanager
def step(what: str, fix: str) -> Iterator[None]:
    """Run one step of the demo. A KvpError passes as it is; any other error (Exception:
    a step runs torch, transformers, requests and processes, which raise many types)
    becomes :class:`~kvpersist.errors.DemoFailed` naming ``what`` failed, the error on one
    line and ``fix``, chained to the original."""
    try:
        yield
    except KvpError:
        raise
    except Exception as exc:
        raise DemoFailed(what, one_line(exc), fix) from exc


def _identity_file(workdir: Path, size: str) -> str:
    """The deployment config for ``size``: configs/cpu-demo for tiny; for another size an
    identity.env written beside the model with that model's geometry and revisions."""
    if size == "tiny":
        return "cpu-demo"

    _, src = resolve_config("cpu-demo")
    values = identity_env_values(size)
    if size in FLOAT32_SIZES:
        values.update(FLOAT32)
    lines = []
    for line in src.read_text().splitlines():
        key = line.split("=", 1)[0]
        lines.append(f"{key}={values[key]}" if key in values else line)
    cfg = workdir / f"config-{size}"
    cfg.mkdir(parents=True, exist_ok=True)
    (cfg / "identity.env").write_text(
        f"# generated by kvp-admin demo for the {size} demo model\n" + "\n".join(lines) + "\n")
    return str(cfg / "identity.env")


def _port(preferred: int) -> int:
    return preferred if procs.port_bindable("127.0.0.1", preferred) else procs.free_port()


#: what to do when vLLM's metrics cannot be read
METRICS_FIX = "check that vLLM still runs and serves its /metrics endpoint (its log says why not)"


def _metrics_text(url: str, what: str) -> str:
    with step(what, METRICS_FIX):
        try:
            return VllmClient(url, 10.0).metrics_text()
        except KvpError as exc:  # no answer, an error status
            raise DemoFailed(what, str(exc), METRICS_FIX) from exc


def _sum_samples(text: str, name: str, what: str) -> float:
    """The sum of the samples of counter ``name`` in Prometheus ``text``."""
    with step(what, METRICS_FIX):
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[-1])
        return total


def metric(url: str, name: str) -> float:
    """The sum of the samples of counter ``name`` on the Prometheus endpoint ``url/metrics``.
    Raises DemoFailed when it cannot be read or a sample is not a number."""
    what = f"read {name} from {url}/metrics"
    return _sum_samples(_metrics_text(url, what), name, what)


def _hits(url: str) -> tuple[float, float]:
    """vLLM's (connector, own prefix cache) hit tokens so far, from one read of its metrics."""
    what = f"read {HITS_METRIC} and {METRIC_PREFIX_HITS} from {url}/metrics"
    text = _metrics_text(url, what)
    return (_sum_samples(text, HITS_METRIC, what), _sum_samples(text, METRIC_PREFIX_HITS, what))


def _l2_hits(log: str, since: int) -> int:
    try:
        with open(log, "rb") as f:
            f.seek(since)
            text = f.read(LOG_READ_BYTES).decode(errors="replace")
    except OSError:
        return 0
    return sum(int(m) for m in re.findall(r"retained keys \(\d+ L1, (\d+) L2\)", text))


def _count(root: str, prefix: str) -> tuple[int, int]:
    n = b = 0
    with os.scandir(root) as it:
        for e in it:
            if e.name.startswith(prefix) and e.name.endswith(".bin"):
                n += 1
                b += e.stat().st_size
    return n, b


def run_demo(workdir: str | os.PathLike[str] = "kvp-demo", *, size: str = "demo",
             turns: int = 10, words_per_turn: int = 150, max_tokens: int = 24,
             keep_running: bool = False, progress: Progress = print) -> DemoResult:
    """Run the demo (see module docstring). Raises KvpError when a step fails (DemoFailed
    naming the step and the fix, unless the step raised a KvpError of its own); whatever it
    started is stopped in every case unless ``keep_running``."""

    t_start = time.monotonic()
    with step(f"create the working directory {workdir}",
              "give --dir a directory you can create and write to"):
        wd = Path(workdir).resolve()
        wd.mkdir(parents=True, exist_ok=True, mode=0o700)
    hub_dir = wd / "hub"
    progress(f"[1/6] demo model '{size}' in {hub_dir}")
    t = time.monotonic()
    with step(f"generate the '{size}' demo model in {hub_dir}",
              f"move away what {hub_dir} holds (or give another --dir); generating needs "
              "torch, transformers, tokenizers and safetensors (scripts/setup.sh)"):
        model_dir = generate_model(size, hub_dir)
    progress(f"      ready in {time.monotonic() - t:.1f} s")
    with step(f"write the demo's configuration in {wd}",
              "give --dir a directory you can write to"):
        config = _identity_file(wd, size)
        env = dict(os.environ)
        env.update({
            "KVP_CACHE_ROOT": str(wd / "cache"),
            "KVP_MODEL_PATH": str(model_dir),
            "KVP_LMCACHE_PORT": str(_port(5565)),
            "KVP_LMCACHE_HTTP_PORT": str(_port(8090)),
            "KVP_VLLM_PORT": str(_port(8010)),
            "KVP_L1_SIZE_GB": env.get("KVP_L1_SIZE_GB", "1"),
            "KVP_WARMUP_FILE": str(wd / "warm.jsonl"),
        })
        if not (wd / "cache").exists():
            (wd / "cache").mkdir(mode=0o700)
    with step("prepare the launch", f"check that {wd / 'cache'} and the demo model "
              f"{model_dir} can be read"):
        prepared = prepare_launch(config, environ=env)
    dep, plan = prepared.dep, prepared.plan
    logs = f"the cache server's log {plan.server_log} and vLLM's log {plan.vllm_log} say why"
    seed = random.SystemRandom().randrange(1, 1 << 30)
    chat = long_chat(turns=turns, words_per_turn=words_per_turn, seed=seed)
    with step(f"write the warm set {wd / 'warm.jsonl'}", "give --dir a directory you can "
              "write to"):
        (wd / "warm.jsonl").write_text(json.dumps({"messages": chat[:-1]}) + "\n")
    phases: list[Phase] = []
    stop_s = 0.0
    try:
        for i, name in enumerate(("cold", "after restart")):
            n = 2 + 2 * i
            progress(f"[{n}/6] launching lmcache server + vLLM ({name}) for namespace "
                     f"{dep.namespace}")
            t = time.monotonic()
            with step(f"launch ({name})", logs):
                lc.launch(prepared, LaunchOptions(server_timeout=90),
                          progress=lambda m: progress(f"      {m}"))
            ph = Phase(name, launch_s=time.monotonic() - t)
            with step(f"read the cache server's log ({name})", logs):
                log_offset = os.path.getsize(plan.server_log)
            # what the launch's own requests (the canary's) took from the cache: not the chat's
            from_disk_before, local_before = _hits(plan.vllm_url)
            progress(f"[{n + 1}/6] long chat ({turns} turns) ...")
            with step(f"the long chat ({name})", logs):
                # min_tokens: a random-weight model may pick the end of sequence first, and
                # an empty answer would make the identical-output check say nothing
                r = chat_completion(plan.vllm_url, dep.settings.served_model_name, chat,
                                    max_tokens=max_tokens, min_tokens=max_tokens)
            ph.ttft_s, ph.total_s, ph.text = r.ttft_s, r.total_s, r.text
            ph.prompt_tokens = r.prompt_tokens or 0
            from_disk, local = _hits(plan.vllm_url)
            ph.tokens_from_disk = from_disk - from_disk_before
            ph.tokens_from_prefix_cache = local - local_before
            if i == 0:
                with step("the long chat again on the running deployment", logs):
                    again = chat_completion(plan.vllm_url, dep.settings.served_model_name,
                                            chat, max_tokens=max_tokens,
                                            min_tokens=max_tokens)
                ph.running_ttft_s = again.ttft_s
                progress(f"      again on the running deployment: TTFT "
                         f"{again.ttft_s * 1000:.0f} ms (vLLM's own prefix cache)")
            time.sleep(0.5)
            ph.l2_chunks_hit = _l2_hits(plan.server_log, log_offset)
            progress(f"      TTFT {ph.ttft_s * 1000:.0f} ms, {ph.prompt_tokens} prompt tokens, "
                     f"{ph.tokens_from_disk:.0f} from the cache on disk, "
                     f"{ph.tokens_from_prefix_cache:.0f} from vLLM's prefix cache")
            phases.append(ph)
            if i == 0 or not keep_running:
                if i == 0:
                    want = ph.prompt_tokens // dep.generic.chunk_size

                    def stored(w: int = want) -> bool:
                        return _count(plan.cache_root, dep.namespace)[0] >= w

                    with step(f"count the chunk files in {plan.cache_root}", logs):
                        procs.wait_for(stored, 20, 0.5)
                progress("      stopping vLLM, then the cache server (L2 files stay)")
                t = time.monotonic()
                with step("stop vLLM and the cache server", logs):
                    stop_deployment(plan)
                stop_s = time.monotonic() - t
            if i == 1:
                ph.downtime_s = stop_s + ph.launch_s + ph.ttft_s
    except BaseException:
        if not keep_running:
            try:
                stop_deployment(plan)
            except Exception as exc:  # noqa: BLE001 - the first error is the one reported
                progress(f"      could not stop vLLM and the cache server: {one_line(exc)}")
        raise
    cold, warm = phases
    with step(f"count the chunk files in {plan.cache_root}", logs):
        files, size_bytes = _count(plan.cache_root, dep.namespace)
    report: dict[str, Any] = {}
    try:

        with open_root(plan.cache_root, purpose="scan") as root:
            res = scan_root(root, hist=False)
        report = {p: {"files": u.files, "bytes": u.bytes} for p, u in res.prefixes.items()}
    except Exception as exc:  # the report is informative only
        report = {"error": str(exc)}
    progress("[6/6] done")
    return DemoResult(
        workdir=str(wd), size=size, namespace=dep.namespace, cache_root=plan.cache_root,
        seed=seed, cold=cold, warm=warm, identical=cold.text == warm.text,
        ttft_ratio=(warm.ttft_s / cold.ttft_s) if cold.ttft_s else 0.0,
        running_ratio=(warm.ttft_s / cold.running_ttft_s) if cold.running_ttft_s else 0.0,
        files=files, bytes=size_bytes, seconds=time.monotonic() - t_start, report=report)


def format_result(r: DemoResult) -> str:
    """The side-by-side summary (pure)."""
    def ms(x: float) -> str:
        return f"{x * 1000:.0f} ms"

    rows = [
        ("", "cold", "after restart of both"),
        ("time to first token", ms(r.cold.ttft_s), ms(r.warm.ttft_s)),
        ("the same chat, running", ms(r.cold.running_ttft_s), ""),
        ("prompt tokens", str(r.cold.prompt_tokens), str(r.warm.prompt_tokens)),
        ("tokens from disk (vLLM)", f"{r.cold.tokens_from_disk:.0f}",
         f"{r.warm.tokens_from_disk:.0f}"),
        ("tokens from vLLM's prefix cache", f"{r.cold.tokens_from_prefix_cache:.0f}",
         f"{r.warm.tokens_from_prefix_cache:.0f}"),
        ("chunks hit in L2 (server)", str(r.cold.l2_chunks_hit), str(r.warm.l2_chunks_hit)),
        ("launch to ready", f"{r.cold.launch_s:.1f} s", f"{r.warm.launch_s:.1f} s"),
        ("stop to first token", "", f"{r.warm.downtime_s:.1f} s"),
    ]
    w = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(row)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    if r.identical:
        verdict = "IDENTICAL"
    else:
        at = next((i for i, (a, b) in enumerate(zip(r.cold.text, r.warm.text, strict=False))
                   if a != b), min(len(r.cold.text), len(r.warm.text)))
        verdict = (f"DIFFERENT from character {at} (cold {r.cold.text[:60]!r}); a random-"
                   "weight model's near-tied logits can flip under last-bit differences "
                   "between a full prefill and one over loaded KV")
    lines += [
        "",
        f"output text: {verdict}: {r.warm.text[:60]!r}",
        f"TTFT after restart / cold: {r.ttft_ratio:.2f}",
        f"the warm-set user's first chat after the restart: {ms(r.warm.ttft_s)}, on the "
        f"running deployment before it: {ms(r.cold.running_ttft_s)} "
        f"({r.running_ratio:.2f}x)",
        f"restart downtime (stop to the returning chat's first token): "
        f"{r.warm.downtime_s:.1f} s; against the same processes started by hand: "
        "docs/benchmarks.md, \"Restart downtime\" (bench/restart_downtime.py)",
        f"namespace {r.namespace}: {r.files} chunk files, {r.bytes / 2**20:.1f} MiB "
        f"in {r.cache_root}",
        f"demo took {r.seconds:.0f} s (model '{r.size}', chat seed {r.seed})",
    ]
    return "\n".join(lines)
