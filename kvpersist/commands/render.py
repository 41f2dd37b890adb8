"""``kvp-admin render``: the launch configuration of a deployment, as data or files."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from kvpersist.commands.common import config_argument, echo_json, json_option
from kvpersist.config.loader import load_deployment
from kvpersist.l2.inventory import sizing_for
from kvpersist.stack.render import GENERATED_STAMP, Rendered
from kvpersist.stack.render import render as render_deployment
from kvpersist.stack.render import TEMPLATE_NAMES
from kvpersist.system.files import atomic_write
from kvpersist.system.templates import read_templates


def render_config(config: str, allow_unpinned: bool = False) -> Rendered:
    """Load CONFIG, plan its budget and render it (used by launch too)."""
    dep = load_deployment(config, allow_unpinned=allow_unpinned)
    sizing = sizing_for(dep)
    return render_deployment(dep, read_templates(TEMPLATE_NAMES), l1_size_gb=sizing.l1_size_gb,
                  l2_capacity_gb=sizing.l2_capacity_gb)


@click.command("render")
@config_argument
@json_option
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Write lmcache-server.argv, vllm.argv, kv-transfer-config.json, "
                   "l2-adapter.json and manifest.json into DIR (atomically, mode 0600).")
@click.option("--allow-unpinned", is_flag=True,
              help="Render even if identity fields are missing: a one-off kvp-unpinned-* "
                   "namespace that never reuses anything on disk.")
def render_cmd(config: str, as_json: bool, out: Path | None, allow_unpinned: bool) -> None:
    """Render the lmcache server argv, vLLM arguments and namespace manifest of CONFIG."""
    result = render_config(config, allow_unpinned=allow_unpinned)
    if out is not None:
        write_rendered(result, out)
    if as_json:
        echo_json(result.as_json())
        return
    if not result.pinned:
        click.echo("WARNING: unpinned identity: one-off namespace, nothing will be reused",
                   err=True)
    click.echo(f"namespace:          {result.namespace}")
    click.echo(f"LMCache model name: {result.lmcache_model_name}")
    click.echo(f"\nlmcache server:\n  {shlex.join(result.lmcache_server_argv)}")
    click.echo(f"\nvLLM (run in {result.model_link['dir']}, where {result.namespace} -> "
               f"{result.model_link['target']}):\n  {shlex.join(result.vllm_argv)}")
    if result.container_argv:
        click.echo(f"\ncontainer:\n  {shlex.join(result.container_argv)}")
    if out is not None:
        click.echo(f"\nwritten to {out}")


def write_rendered(result: Rendered, out: Path) -> None:
    """Write the rendered artefacts into ``out`` atomically, owner-only."""
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


