"""``kvp-admin demo``: persistence across restarts, shown on the built-in CPU deployment."""

from __future__ import annotations

import click

from kvpersist.commands.common import Number, echo_json, exit_with


@click.command("demo")
@click.option("--dir", "workdir", default="kvp-demo", show_default=True,
              type=click.Path(file_okay=False),
              help="Working directory: demo model, cache root, logs.")
@click.option("--size", type=click.Choice(["tiny", "demo", "bench"]), default="demo",
              show_default=True,
              help="Demo model: demo (79M parameters, one KV head, served in float32: prefill "
                   "dominates the first token, identical output), tiny (7M, what the tests "
                   "serve: fixed costs dominate) or bench (180M, bfloat16).")
@click.option("--turns", type=Number(1, 1000, integer=True), default=12, show_default=True,
              help="Turns of chat history in the long request.")
@click.option("--keep-running", is_flag=True,
              help="Leave the cache server and vLLM running after the second request.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def demo(workdir: str, size: str, turns: int, keep_running: bool, as_json: bool) -> None:
    """Launch the cache server and vLLM (CPU build) on a generated model, send a long chat,
    restart both, send it again: cold vs after-restart time to first token, tokens served from
    disk, identical output. Stops everything at the end."""
    from kvpersist.demo.run import format_result, run_demo

    def progress(msg: str) -> None:
        click.echo(msg, err=True)

    result = run_demo(workdir, size=size, turns=turns, keep_running=keep_running,
                      progress=progress)
    if as_json:
        echo_json(result.to_dict())
    else:
        click.echo(format_result(result))
    # after the restart the chat must reuse the persisted cache: read from it by the chat, or
    # loaded from it into vLLM's prefix cache by the warm-up before ready (a restarted vLLM's
    # prefix cache holds nothing else of the chat)
    reused = result.warm.tokens_from_disk + result.warm.tokens_from_prefix_cache
    if not result.identical or reused <= 0:
        exit_with(1)
