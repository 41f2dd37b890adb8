"""``kvp-admin verify``: find chunk files that can never be valid; quarantine with --apply."""

from __future__ import annotations

import sys

import click

from kvpersist.commands.common import (
    AGE_S,
    RATE,
    config_argument,
    echo_json,
    exit_with,
    json_option,
    table,
)
from kvpersist.l2.layout import display_name


@click.command("verify")
@config_argument
@click.option("--apply", is_flag=True,
              help="Quarantine what is found (rename into .kvpersist/quarantine/). "
                   "Default: report only.")
@click.option("--all-namespaces", is_flag=True,
              help="Authenticate every namespace's files with this deployment's key.")
@click.option("--rate", "rate_mb_s", type=RATE, default=200.0, show_default=True,
              help="Read at most this many MB/s (0: unbounded).")
@click.option("--temp-age", type=AGE_S, default=600.0, show_default=True,
              help="Temp files (interrupted writes) older than this many seconds are stale.")
@click.option("--no-scrub", "no_scrub", is_flag=True,
              help="With --apply, do not zero the padding after each frame of the "
                   "namespace's files that authenticate (kvp-admin scrub).")
@json_option
def verify(config: str, apply: bool, all_namespaces: bool, rate_mb_s: float,
           temp_age: float, no_scrub: bool, as_json: bool) -> None:
    """Check CONFIG's cache root: wrong sizes, frames failing authentication with the
    deployment's key, one frame under two names, a frame recorded under another chunk's name,
    links, FIFOs and unreadable files under chunk names, stale temp files. Exit 0 clean (or
    all quarantined), 1 findings left. With --apply (aesgcm) the padding after each
    authenticated frame is then zeroed, as kvp-admin scrub --apply does."""
    from kvpersist.actions.scrub import scrub as scrub_action
    from kvpersist.actions.verify import verify as verify_action

    show = not as_json and sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if show:
            click.echo(f"\r  verified {done}/{total} chunk files", err=True, nl=done == total)

    res = verify_action(config, apply=apply, all_namespaces=all_namespaces,
                        rate_mb_s=rate_mb_s or None, temp_age=temp_age, progress=progress)
    scrubbed = (scrub_action(config, apply=True)
                if apply and not no_scrub and res.serde == "aesgcm" else None)
    if as_json:
        doc = res.to_dict()
        if scrubbed is not None:
            doc["scrub"] = scrubbed.to_dict()
        echo_json(doc)
    else:
        click.echo(f"{display_name(res.root)}: {res.files} chunk files, "
                   f"{res.authenticated} authenticated, "
                   f"{len(res.findings)} finding(s) in {res.seconds:.1f} s")
        if res.pinned:
            click.echo(f"warm-set pinned files checked first: {res.pinned}, "
                       f"{res.pinned_findings} finding(s)")
        f = res.frames
        if f is not None and f.applies:
            click.echo(f"frame record: {f.files} chunk files, {f.new} new, {f.rewritten} "
                       f"rewritten, {f.restored} restored, {f.moved} under another chunk's "
                       f"name, {f.gone} gone since the last check")
        if res.findings:
            rows = [[f.kind, f.size, display_name(f.path.rsplit('/', 1)[-1])[:72], f.detail]
                    for f in res.findings]
            click.echo(table(rows, ["kind", "bytes", "file", "detail"]))
        if apply:
            click.echo(f"quarantined {len(res.quarantined)} file(s) into "
                       f"{display_name(res.root)}/.kvpersist/quarantine")
            for line in res.skipped:
                click.echo(f"  skipped {line}")
        elif res.findings:
            click.echo("dry run: run again with --apply to quarantine them")
        if scrubbed is not None:
            click.echo(f"padding zeroed after the frame of {scrubbed.scrubbed} file(s) "
                       f"({scrubbed.clean} clean already)")
        for w in res.warnings:
            click.echo(f"warning: {w}", err=True)
    left = len(res.findings) - (len(res.quarantined) if apply else 0)
    exit_with(1 if left else 0)
