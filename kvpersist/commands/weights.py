"""``kvp-admin weights``: the weights fingerprint of a deployment against its record."""

from __future__ import annotations

import click

from kvpersist.commands.common import config_argument, echo_json, exit_with, json_option


@click.command("weights")
@config_argument
@click.option("--record", is_flag=True,
              help="When the namespace has no fingerprint yet, record this one (what launch "
                   "does at the first launch).")
@click.option("--rehash", is_flag=True,
              help="Read every file, ignoring the digest cache and the hub's names (an "
                   "audit; slow on large weights).")
@json_option
def weights(config: str, record: bool, rehash: bool, as_json: bool) -> None:
    """Check that the weights at CONFIG's KVP_MODEL_PATH are those its namespace was first
    served with.

    The same check as launch's preflight. Exit 0 if they are (or nothing is recorded yet),
    1 if they changed (launch would refuse), 2 for a configuration problem.
    """
    from kvpersist.actions import weights as actions

    out = actions.weights(config, record=record, rehash=rehash)
    chk = out.check
    if as_json:
        echo_json(out.to_dict())
    else:
        for note in chk.notes:
            click.echo(f"note: {note}", err=True)
        if out.recorded:
            click.echo(f"note: {out.recorded}", err=True)
        if chk.current is not None:
            click.echo(f"{out.config}  namespace {out.namespace}  weights "
                       f"{chk.current.record.fingerprint}  {chk.status}")
        for p in chk.problems:
            click.echo(f"kvp-admin weights: {p}", err=True)
    if out.changed:
        exit_with(1)
