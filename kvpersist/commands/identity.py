"""``kvp-admin identity``: show, compare and compute compatibility identities."""

from __future__ import annotations

from pathlib import Path

import click

from kvpersist.actions import identity as actions
from kvpersist.commands.common import config_argument, echo_json, json_option, table
from kvpersist.config.identity import ALL_IDENTITY_KEYS, canonical_json


@click.group()
def identity() -> None:
    """Compatibility identity and namespace of a deployment."""


@identity.command("show")
@config_argument
@json_option
def show(config: str, as_json: bool) -> None:
    """Fields, canonical JSON, namespace and LMCache model name of CONFIG."""
    view = actions.show(config)
    dep, data = view.dep, view.to_dict()
    if as_json:
        echo_json(data)
        return
    rows = [(name, ALL_IDENTITY_KEYS[name],
             canonical_json(value) if isinstance(value, dict) else value)
            for name, value in view.fields().items()]
    click.echo(table(rows, ("field", "env key", "value")))
    click.echo(f"\ncanonical JSON:     {data['canonical_json']}")
    click.echo(f"namespace:          {dep.namespace}")
    click.echo(f"LMCache model name: {dep.lmcache_model_name}")


@identity.command("namespace")
@config_argument
def namespace(config: str) -> None:
    """Print only the namespace of CONFIG."""
    click.echo(actions.show(config).dep.namespace)


@identity.command("diff")
@click.argument("config_a", metavar="CONFIG_A")
@click.argument("config_b", metavar="CONFIG_B")
@json_option
def diff(config_a: str, config_b: str, as_json: bool) -> None:
    """Which identity fields differ between two configs, and whether the namespace does.

    Exit 0 if the namespaces are equal (caches are shared), 1 if they differ.
    """
    d = actions.diff(config_a, config_b)
    a, b, changes, same = d.a, d.b, d.changes, d.same_namespace
    if as_json:
        echo_json(d.to_dict())
    else:
        if changes:
            click.echo(table([(f, va, vb) for f, va, vb in changes], ("field", a.name, b.name)))
        else:
            click.echo("identity fields: identical")
        verdict = "same namespace: caches are shared" if same else \
            "different namespaces: no KV block is shared"
        click.echo(f"\n{a.namespace}  {a.name}\n{b.namespace}  {b.name}\n{verdict}")
    if not same:
        raise click.exceptions.Exit(1)


@identity.command("template-sha")
@click.argument("template", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def template_sha(template: Path) -> None:
    """Compute KVP_CHAT_TEMPLATE_SHA256 from a chat template.

    TEMPLATE is a .jinja file or a tokenizer_config.json holding ``chat_template``. The
    digest is sha256 of the template rendered on kvpersist's fixed probe conversation.
    """
    click.echo(actions.template_sha(template))
