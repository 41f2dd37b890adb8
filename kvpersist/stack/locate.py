"""Where a deployment's processes and files are (pure): no scan, no budget, no I/O.

``stop``, ``status`` and ``health`` need only this: pid files, log files, URLs, ports,
command-line markers and whether vLLM runs as a process or in a container. All of it follows
from the validated settings alone, so these commands work even when the cache root is huge, or
the budget has become invalid (an operator must always be able to stop a deployment).

Files of a deployment (``S`` = ``KVP_STATE_DIR``, default ``<cache root>/.kvpersist``):

* ``S/pids/<name>.lmcache.pid``: the cache server's pid (one per deployment: two deployments
  on one cache root, or sharing a state dir, never see each other's pid files)
* ``S/pids/<name>.vllm.pid``: vLLM's pid when it runs as a direct process
* ``<cache root>/lmcache-server.pid``: where kvpersist 0.1 kept the server's pid; still read
  (never written) so that a server started by 0.1 can be stopped after an upgrade
* ``S/logs/lmcache-server.log``, ``S/logs/vllm.log``
* ``S/manifests/<namespace>.json``: the namespace manifest
* ``S/budget.json``: the budget plan of the last launch (health reads it; it never scans)
* ``S/weights-digests.json``: the sha256 of each weights file, keyed by its stat (see
  :mod:`kvpersist.stack.weights`), so a launch costs one ``stat`` per file
* ``S/warmup.json``: the last warm-up's state (written by the warm-up engine,
  :mod:`kvpersist.stack.warm.run`: warming, done or failed), ``S/warmup/``: the warm set's
  token ids it cached, ``S/pids/<name>.warmup.pid``: the pid of the warm-up a launch started
  (kept after it ends, so that health can tell a warm-up that died from one still running),
  ``S/logs/warmup.log``: its output
* ``S/canary/<namespace>.json``: the namespace's canary record (kvpersist.stack.canary)
* ``S/models/<namespace>`` → the weights: vLLM runs in ``S/models`` with
  ``--model <namespace>``, so LMCache's model name (and every file name) is the namespace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvpersist.config.deployment import Deployment
from kvpersist.config.values import url_host
from kvpersist.l2.frames import max_chunk_file_bytes
from kvpersist.l2.layout import MANIFESTS_DIR, PID_FILE
from kvpersist.stack.canary.record import record_path
from kvpersist.stack.canary.verdict import tolerance_for
from kvpersist.system.http_client import DEFAULT_TIMEOUT
from kvpersist.system.lmcache_client import LMCacheClient
from kvpersist.system.vllm_client import VllmClient

PIDS_DIR = "pids"
WARMUP_STATE = "warmup.json"
#: :data:`kvpersist.stack.lmcache_exec.OFF_RECORD`
SHARED_OFF = "shared-tier-off.json"
WARMUP_TOKENS_DIR = "warmup"
BUDGET_RECORD = "budget.json"
WEIGHTS_CACHE = "weights-digests.json"


@dataclass(frozen=True)
class Location:
    """Everything stop/status/health need to find a deployment's processes and files."""

    config: str
    namespace: str
    cache_root: str
    state_dir: str
    server_pid_file: str
    legacy_server_pid_file: str
    vllm_pid_file: str
    server_log: str
    vllm_log: str
    manifest_file: str
    budget_record: str
    weights_cache: str
    model_link_dir: str
    model_link: str
    model_target: str
    server_markers: tuple[str, ...]
    server_http_url: str
    vllm_mode: str  # "process" or "container"
    vllm_markers: tuple[str, ...]
    vllm_url: str
    container_name: str
    #: KVP_CONTAINER_ENGINE: docker or podman
    container_engine: str
    served_model_name: str
    serde_key_file: str
    serde: str
    #: KVP_SERVICE_USER (empty: whoever runs kvp-admin)
    service_user: str
    #: component -> (host, port) as configured
    listen: dict[str, tuple[str, int]]
    #: the warm-up's state file (:mod:`kvpersist.stack.warm.run`), pid file and log
    warmup_state_file: str
    warmup_pid_file: str
    warmup_log: str
    #: where the warm-up caches the warm set's token ids
    warmup_tokens_dir: str
    #: what a launch hands its warm-up child of the rendered plan (stack/warm/handoff.py)
    warmup_handoff_file: str
    #: KVP_WARMUP_WAIT, seconds
    warmup_wait: float
    #: the largest chunk file the namespace's geometry allows (a larger one is never read)
    chunk_max_bytes: int
    #: the canary (kvpersist.stack.canary): its record, whether it runs, its prompt's
    #: chunks of ``canary_chunk_size`` tokens, its tolerance
    canary_file: str = ""
    canary_enabled: bool = True
    canary_chunk_size: int = 256
    canary_chunks: int = 2
    canary_tolerance: float = 0.0
    #: written when the cache server started without its shared tier (the store did not
    #: answer: :mod:`kvpersist.stack.lmcache_exec`)
    shared_off_file: str = ""

    @property
    def warmup_gate_file(self) -> str:
        """The gate of a warm-up child a launch starts early (stack/warm/gate.py), beside
        the handoff."""
        return os.path.join(os.path.dirname(self.warmup_handoff_file), "warmup-gate")

    def lmcache(self, timeout: float = DEFAULT_TIMEOUT) -> LMCacheClient:
        """The client of the deployment's cache server's admin port (no I/O until a call)."""
        return LMCacheClient(self.server_http_url, timeout)

    def vllm(self, timeout: float = DEFAULT_TIMEOUT) -> VllmClient:
        """The client of the deployment's vLLM (no I/O until a call)."""
        return VllmClient(self.vllm_url, timeout)


def vllm_mode(dep: Deployment) -> str:
    """``container`` when an image is configured (KVP_IMAGE, on any device), else
    ``process``."""
    return "container" if dep.settings.image else "process"


def locate(dep: Deployment) -> Location:
    """The :class:`Location` of ``dep`` (pure: computed from its settings)."""
    s = dep.settings
    state = s.state_dir
    link_dir = s.model_link_dir
    return Location(
        config=dep.name,
        namespace=dep.namespace,
        cache_root=s.cache_root,
        state_dir=state,
        server_pid_file=os.path.join(state, PIDS_DIR, f"{dep.name}.lmcache.pid"),
        legacy_server_pid_file=os.path.join(s.cache_root, PID_FILE),
        vllm_pid_file=os.path.join(state, PIDS_DIR, f"{dep.name}.vllm.pid"),
        server_log=os.path.join(s.log_dir, "lmcache-server.log"),
        vllm_log=os.path.join(s.log_dir, "vllm.log"),
        manifest_file=os.path.join(state, MANIFESTS_DIR, f"{dep.namespace}.json"),
        budget_record=os.path.join(state, BUDGET_RECORD),
        weights_cache=os.path.join(state, WEIGHTS_CACHE),
        model_link_dir=link_dir,
        model_link=os.path.join(link_dir, dep.namespace),
        model_target=s.model_path,
        server_markers=("lmcache", "--l2-adapter", f'"file_path":"{s.cache_root}"'),
        server_http_url=f"http://{url_host(s.lmcache_http_host)}:{s.lmcache_http_port}",
        vllm_mode=vllm_mode(dep),
        # the model is the namespace (--model, or vllm serve's positional argument)
        vllm_markers=(dep.namespace, "--served-model-name"),
        vllm_url=f"http://{url_host(s.vllm_host)}:{s.vllm_port}",
        container_name=s.container_name or f"{dep.name}-kvp",
        container_engine=s.container_engine,
        served_model_name=s.served_model_name,
        serde_key_file=s.serde_key_file,
        serde=s.serde,
        service_user=s.service_user,
        listen={"lmcache": (s.lmcache_host, s.lmcache_port),
                "lmcache_http": (s.lmcache_http_host, s.lmcache_http_port),
                "vllm": (s.vllm_host, s.vllm_port)},
        warmup_state_file=os.path.join(state, WARMUP_STATE),
        shared_off_file=os.path.join(state, SHARED_OFF),
        warmup_pid_file=os.path.join(state, PIDS_DIR, f"{dep.name}.warmup.pid"),
        warmup_log=os.path.join(s.log_dir, "warmup.log"),
        warmup_tokens_dir=os.path.join(state, WARMUP_TOKENS_DIR),
        warmup_handoff_file=os.path.join(state, "warmup-handoff.json"),
        warmup_wait=s.warmup_wait,
        chunk_max_bytes=max_chunk_file_bytes(dep.identity_values, dep.generic.chunk_size),
        canary_file=record_path(state, dep.namespace),
        canary_enabled=s.canary,
        canary_chunk_size=dep.generic.chunk_size,
        canary_chunks=s.canary_chunks,
        canary_tolerance=tolerance_for(str(dep.identity_values.get("kv_cache_dtype", "auto")),
                                       s.canary_tolerance),
    )
