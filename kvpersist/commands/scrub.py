"""``kvp-admin scrub``: zero the stale bytes LMCache leaves after each chunk's aesgcm frame."""

from __future__ import annotations

import click

from kvpersist.commands.common import (
    config_argument,
    echo_json,
    end_progress,
    exit_with,
    json_option,
    progress_printer,
)
from kvpersist.config.values import format_size
from kvpersist.l2.layout import display_name


@click.command("scrub")
@config_argument
@click.option("--apply", is_flag=True,
              help="Overwrite the padding with zeros (in place, never the frame). "
                   "Default: count only.")
@json_option
def scrub(config: str, apply: bool, as_json: bool) -> None:
    """Zero the padding after the aesgcm frame of CONFIG's chunk files (stale L1 bytes, often
    plaintext KV of other chunks). Exit 0 when no dirty padding is left, 1 otherwise."""
    from kvpersist.actions.scrub import scrub as scrub_action

    show = None if as_json else progress_printer("scrubbed")
    res = scrub_action(config, apply=apply, progress=show)
    if show is not None:
        end_progress(show)
    if as_json:
        echo_json(res.to_dict())
    else:
        verb = "zeroed" if apply else "would zero"
        click.echo(f"{display_name(res.root)}: {res.files} chunk files of {res.namespace}: "
                   f"{res.clean} with clean padding, {res.dirty} with stale bytes after the frame "
                   f"({verb} {format_size(res.bytes_zeroed)} in "
                   f"{res.scrubbed if apply else res.dirty} files), {res.unauthenticated} "
                   f"failing authentication (left alone; see kvp-admin verify); "
                   f"{format_size(res.bytes_read)} read in {res.seconds:.1f} s")
        for line in res.skipped:
            click.echo(f"  skipped {line}")
        if res.moved:
            click.echo(f"{len(res.moved)} file(s) hold a frame recorded under another chunk's "
                       "name: kvp-admin verify CONFIG --apply quarantines them")
        for w in res.warnings:
            click.echo(f"warning: {w}", err=True)
        if not apply and res.dirty:
            click.echo("dry run: run again with --apply to zero them")
    exit_with(1 if res.dirty - res.scrubbed else 0)
