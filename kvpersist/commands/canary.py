"""``kvp-admin canary``: the namespace's known-answer canary (parse and format only)."""

from __future__ import annotations

from typing import Any

import click

from kvpersist.commands.common import config_argument, echo_json, exit_with, json_option


@click.group("canary")
def canary() -> None:
    """The namespace's known-answer canary: what it found, a run now, reset.

    docs/canary.md: the reset lets a namespace whose canary failed use the cache again."""


def _line(run: dict[str, Any] | None) -> str:
    if not run:
        return "-"
    v = run.get("verdict") or {}
    return (f"{run.get('state')} at {run.get('at')} ({run.get('when')}, path {run.get('path')}"
            f", max |Δ logprob| {v.get('max_diff')} of {v.get('tolerance')})"
            + (f": {run['detail']}" if run.get("detail") else ""))


@canary.command("show")
@config_argument
@json_option
def show(config: str, as_json: bool) -> None:
    """What the namespace's canary found: its state (failed is kept until reset), the last
    run and the runs the record keeps. Exit 0 unless it failed or is unreadable (1)."""
    from kvpersist.actions import canary as action

    out = action.show(config)
    doc = out.to_dict()
    if as_json:
        echo_json(doc)
    else:
        click.echo(f"{out.config}  namespace {out.namespace}  canary "
                   f"{'on' if doc['enabled'] else 'off (KVP_CANARY=false)'}")
        click.echo(f"state           {doc['state']}")
        if doc.get("error"):
            click.echo(f"error           {doc['error']}")
        if doc.get("failed"):
            click.echo(f"FAILED          {_line(doc['failed'])}")
        click.echo(f"last            {_line(doc.get('last'))}")
        click.echo(f"last passed     {doc.get('last_passed_at') or '-'}")
        click.echo(f"reference       {doc.get('reference_at') or '-'}  ({doc['chunks']} chunks "
                   f"of {doc['chunk_size']} tokens, tolerance {doc['tolerance']:g})")
        click.echo(f"record          {doc['record']}")
    if doc["state"] == "failed" or doc.get("error"):
        exit_with(1)


@canary.command("run")
@config_argument
@click.option("--warm-sample", type=click.IntRange(0, 16), default=0, show_default=True,
              metavar="N",
              help="Then check N warm-set entries too (served, and recomputed under a fresh "
                   "salt: two requests of each entry's length; the next run takes the next "
                   "N).")
@json_option
def run(config: str, warm_sample: int, as_json: bool) -> None:
    """Run the canary now against the running vLLM. Exit 0 passed, 1 failed or unknown
    (a run that could not compare is never a pass). A failure is kept: the next start of
    vLLM serves without the cache."""
    from kvpersist.actions import canary as action

    out = action.run(config, warm_sample=warm_sample)
    if as_json:
        echo_json(out.to_dict())
    else:
        click.echo(f"{out.config}: {out.run.summary()}")
        if out.run.warm_sample is not None:
            w = out.run.warm_sample
            click.echo(f"{out.config}: warm-set sample {w.state}: {len(w.entries)} "
                       f"entr{'y' if len(w.entries) == 1 else 'ies'}"
                       + (f" ({w.detail})" if w.detail else ""))
    if out.run.state != "passed":
        exit_with(1)


@canary.command("reset")
@config_argument
@click.option("--apply", is_flag=True,
              help="Remove the record. Default: show what would be removed.")
@json_option
def reset(config: str, apply: bool, as_json: bool) -> None:
    """Forget the namespace's canary record, its failure with it, once its cause is found:
    the next start of vLLM has the cache connector again (`kvp-admin restart CONFIG --only
    vllm`) and makes a new prompt and reference. The namespace's files are not touched.
    Dry run unless --apply."""
    from kvpersist.actions import canary as action

    out = action.reset(config, apply=apply)
    if as_json:
        echo_json(out.to_dict())
        return
    was = out.status.get("state")
    if not apply:
        click.echo(f"would remove {out.record} (canary {was}); run again with --apply")
    elif out.removed:
        click.echo(f"removed {out.record} (canary was {was}); restart vLLM to use the cache "
                   f"again: kvp-admin restart {config} --only vllm")
    else:
        click.echo(f"no canary record at {out.record}")
