"""``kvp-admin shred``: crypto-shred a namespace (parse and format; the order and the rules
are in :mod:`kvpersist.actions.shred`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from kvpersist.commands.common import echo_json, exit_with, inventory_options, json_option
from kvpersist.config.values import format_size

if TYPE_CHECKING:
    from kvpersist.actions.shred import ShredOutcome


def format_outcome(out: ShredOutcome) -> str:
    """The human report: keys first (what goes, what stays and why), then the data."""
    from kvpersist.commands.prune import format_result, format_shared  # lazy: one format

    verb = "would destroy" if out.dry_run else "destroyed"
    lines = [f"shred {out.namespace} ({'dry run' if out.dry_run else 'applied'}; "
             f"tiers: {out.tier})"]
    for p in out.key_plans:
        for path in p.destroy:
            lines.append(f"1. {verb} key {path} (overwritten, fsynced, unlinked)")
        for n in p.notes:
            lines.append(f"   note: {n}")
    if not any(p.destroy for p in out.key_plans):
        lines.append("1. no key to destroy")
    lines.append(f"2. {'would record' if out.dry_run else 'recorded'} the tombstone "
                 "<state>/keys/" + out.namespace + "/shredded.json in "
                 + ", ".join(p.state_dir for p in out.key_plans))
    lines.append("3. then the data, as prune --namespace:")
    if out.prune is not None and out.prune.shared:
        lines.append(format_shared(out.prune.shared))
    if out.prune is not None and out.prune.local is not None:
        res = out.prune.local.result
        lines.append(format_result(res, out.prune.local.plan))
        lines.append(f"data: {res.deleted_files:,} files, {format_size(res.deleted_bytes)}")
    lines += [f"warning: {w}" for w in out.warnings]
    if out.dry_run:
        lines.append("dry run: nothing was destroyed; add --apply (keys first, then data)")
    return "\n".join(lines)


@click.command("shred")
@inventory_options
@click.option("--namespace", required=True, metavar="NS",
              help="The namespace whose key and data to destroy.")
@click.option("--force", is_flag=True, help="Allow shredding an active namespace.")
@click.option("--apply", is_flag=True, help="Really destroy (default: dry run).")
@json_option
def shred(root: str | None, configs: tuple[str, ...], namespace: str, force: bool,
          apply: bool, as_json: bool) -> None:
    """Destroy a namespace's L2 key, then its data: dry run unless --apply.

    The key goes first (overwritten, fsynced, unlinked), so every file and shared-tier key
    of the namespace fails authentication at once, whatever copies remain; a tombstone then
    stops a later launch from adopting the root key again; then the namespace's files (and,
    with --config naming a shared tier, its shared-tier keys) are deleted as by prune
    --namespace. Exit 1 if a file could not be deleted.
    """
    from kvpersist.actions.shred import shred as run  # lazy: `shred --help` stays light

    out = run(namespace, root, configs, apply=apply, force=force)
    if as_json:
        echo_json(out.to_dict())
    else:
        click.echo(format_outcome(out))
    exit_with(out.exit_code)
