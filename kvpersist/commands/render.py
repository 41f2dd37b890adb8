"""``kvp-admin render``: the launch configuration of a deployment, as data or files."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import click

from kvpersist.commands.common import config_argument, echo_json, json_option


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
    from kvpersist.actions.render import render_config, write_rendered

    result = render_config(config, allow_unpinned=allow_unpinned)
    if out is not None:
        write_rendered(result, out)
    if as_json:
        echo_json(result.as_json())
        return
    if not result.pinned:
        click.echo("WARNING: unpinned identity: one-off namespace, nothing will be reused",
                   err=True)
    for warning in result.warnings:
        click.echo(f"WARNING: {warning}", err=True)
    for lst in result.listeners:
        if not lst["loopback"]:
            click.echo(f"NOTE: {lst['component']} binds {_address(lst)}, not loopback; "
                       f"peers allowed by {lst['allow_key']}: "
                       f"{' '.join(lst['allowed_peers'])}", err=True)
    click.echo(f"namespace:          {result.namespace}")
    click.echo(f"LMCache model name: {result.lmcache_model_name}")
    click.echo(f"\nlmcache server:\n  {shlex.join(result.lmcache_server_argv)}")
    click.echo(f"\nvLLM (run in {result.model_link['dir']}, where {result.namespace} -> "
               f"{result.model_link['target']}):\n  {shlex.join(result.vllm_argv)}")
    if result.container_argv:
        click.echo(f"\ncontainer:\n  {shlex.join(result.container_argv)}")
    click.echo("\nL2 read path:")
    for line in result.read_path.get("lines", []):
        click.echo(f"  {line}")
    click.echo("\nlisteners:")
    for lst in result.listeners:
        where = "loopback" if lst["loopback"] else (
            f"NOT loopback, peers {' '.join(lst['allowed_peers'])} ({lst['allow_key']})")
        click.echo(f"  {lst['component']:13} {_address(lst):22} {where}")
    if out is not None:
        click.echo(f"\nwritten to {out}")


def _address(listener: dict[str, Any]) -> str:
    host, port = listener["host"], listener["port"]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
