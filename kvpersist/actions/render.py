"""Use case: render a deployment's launch configuration (``kvp-admin render``)."""

from __future__ import annotations

import json
from pathlib import Path

from kvpersist.config.loader import load_deployment
from kvpersist.l2.inventory import size_deployment
from kvpersist.stack.canary.run import recompute_reason
from kvpersist.stack.locate import locate, vllm_mode
from kvpersist.stack.render import GENERATED_STAMP, TEMPLATE_NAMES, Rendered, render
from kvpersist.system.files import atomic_write
from kvpersist.system.software import running_vllm_version
from kvpersist.system.templates import read_templates


def render_config(config: str, *, allow_unpinned: bool = False) -> Rendered:
    """Load CONFIG, size it once and render it (without the cache connector while the
    namespace's canary has failed). Raises ConfigError (budget problems too)."""

    dep = load_deployment(config, allow_unpinned=allow_unpinned)
    sizing = size_deployment(dep)
    return render(dep, read_templates(TEMPLATE_NAMES), l1_size_gb=sizing.l1_size_gb,
                  l2_capacity_gb=sizing.l2_capacity_gb, vllm_version=running_vllm_version(
                      dep.vllm_version, direct_process=vllm_mode(dep) == "process"),
                  recompute=recompute_reason(locate(dep)))


def write_rendered(result: Rendered, out: Path) -> list[Path]:
    """Write the rendered artefacts into ``out`` atomically, owner-only; the paths written."""
    stamp = f"# {GENERATED_STAMP}\n"
    files = {
        "lmcache-server.argv": stamp + "\n".join(result.lmcache_server_argv) + "\n",
        "vllm.argv": stamp + "\n".join(result.vllm_argv) + "\n",
        "kv-transfer-config.json": json.dumps(result.kv_transfer_config, indent=2) + "\n",
        "l2-adapter.json": json.dumps(result.l2_adapter, indent=2) + "\n",
        "manifest.json": json.dumps(result.manifest, indent=2, sort_keys=True) + "\n",
        "render.json": json.dumps(result.as_json(), indent=2, sort_keys=True) + "\n",
    }
    for name, text in files.items():
        atomic_write(out / name, text)
    return [out / n for n in files]
