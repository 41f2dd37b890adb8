"""``kvp-admin warmup``: load the deployment's warm set from L2 into L1 (a launch step)."""

from __future__ import annotations

import click

from kvpersist.commands.common import WAIT, config_argument, echo_json, exit_with, json_option


@click.command("warmup")
@config_argument
@click.option("--wait", "wait_s", type=WAIT, default=120.0,
              show_default=True, metavar="SECONDS",
              help="Give up after SECONDS (covers the cache server's 503 until vLLM has "
                   "registered its KV layout).")
@click.option("--compute-missing", "compute", flag_value=True, default=None,
              help="Compute the chunks found on no tier by sending the warm set's token ids "
                   "to CONFIG's own vLLM (one token each), within --wait; default: "
                   "KVP_WARMUP_COMPUTE.")
@click.option("--rendered", "handoff_file", default=None, hidden=True, metavar="FILE",
              help="The launch's rendered arguments (a launch starts its warm-up child "
                   "with this; by hand the deployment is rendered here).")
@json_option
def warmup(config: str, wait_s: float, compute: bool | None, handoff_file: str | None,
           as_json: bool) -> None:
    """Prefetch CONFIG's warm set (KVP_WARMUP_FILE) from disk into the cache server's memory.

    Tokenizes the warm set as the deployment's vLLM does, pins its chunk files against
    kvp-admin prune, submits it to the server's /cache/prefetches for every TP rank and
    waits. Chunks not on disk yet are reported, not errors. Exit 0 when every prefetch
    completed (or there is no warm set), 1 when the warm-up failed or timed out, 2 for a bad
    config or warm set. The state is written to <state dir>/warmup.json.
    """
    from kvpersist.actions.warmup import warmup as warmup_action

    def progress(line: str) -> None:
        if not as_json:
            click.echo(f"  {line}", err=True)

    res = warmup_action(config, wait_s=wait_s, progress=progress, compute_missing=compute,
                        handoff_file=handoff_file)
    if as_json:
        echo_json(res.to_dict())
    elif res.state == "none":
        click.echo(f"namespace {res.namespace}: no warm set (KVP_WARMUP_FILE is empty)")
    else:
        cached = ", token ids cached" if res.tokens_cached else ""
        click.echo(f"namespace {res.namespace}: warm set {res.warm_file} "
                   f"({len(res.entries)} entries{cached})")
        for e in res.entries:
            found = (f"{e.found_keys}/{e.total_keys} keys found" if e.total_keys else
                     "nothing to load (under one chunk)" if not e.chunks else "not loaded")
            click.echo(f"  line {e.line}: {e.tokens} tokens, {e.chunks} chunk(s), {found}")
        missing = res.requested_chunks - res.found_chunks
        why = f" ({missing} not on disk yet)" if res.state == "done" and missing else ""
        click.echo(f"{res.state}: {res.found_chunks}/{res.requested_chunks} chunks found{why}, "
                   f"{res.bytes:,} bytes of pinned files on disk, {res.seconds:.1f} s; "
                   f"{res.pinned_files} file(s) pinned")
        if res.compute:
            left = (f"; still missing on line(s) {', '.join(map(str, res.not_computed))}"
                    if res.not_computed else "")
            click.echo(f"computed by vLLM: {res.computed_chunks} chunk(s) in "
                       f"{res.compute_seconds:.1f} s{left}")
        for ld in res.loads:
            how = "" if ld.ok else f" (failed: {ld.detail})"
            click.echo(f"loaded into vLLM before ready: line {ld.line}, {ld.chunks} chunk(s) "
                       f"in {ld.seconds:.2f} s{how}")
        if res.error:
            click.echo(f"error: {res.error}", err=True)
    for w in res.warnings:
        click.echo(f"warning: {w}", err=True)
    exit_with(res.exit_code)
