"""``kvp-admin health``: probe a deployment; exit 0 healthy, 1 degraded, 2 down, 3 warming."""

from __future__ import annotations

import click

from kvpersist.commands.common import (
    TIMEOUT,
    WAIT,
    config_argument,
    echo_json,
    exit_with,
    json_option,
    table,
)


@click.command("health")
@config_argument
@json_option
@click.option("--wait", type=WAIT, default=0.0, metavar="SECONDS",
              help="Probe again until healthy or SECONDS pass.")
@click.option("--timeout", type=TIMEOUT, default=3.0, show_default=True,
              help="Timeout of each probe, seconds.")
@click.option("--no-vllm", is_flag=True, help="Check only the cache server and cache root.")
@click.option("--canary", "run_canary", is_flag=True,
              help="Run the known-answer canary first (docs/canary.md; the health timer "
                   "does); without it the canary check reads the last run's record.")
def health(config: str, as_json: bool, wait: float, timeout: float, no_vllm: bool,
           run_canary: bool) -> None:
    """Check CONFIG's cache server, cache root, vLLM, its warm-up and its canary.

    Exit 0 healthy, 1 degraded (serving), 2 down, 3 warming (serving, the warm-up still
    loading the warm set; --wait waits through it).

    With a shared tier, while the cache server answers, this also refreshes this host's
    fleet record on the store (docs/fleet.md, "Fleet records")."""
    from kvpersist.actions import lifecycle

    report = lifecycle.health(config, timeout=timeout, expect_vllm=not no_vllm, wait=wait,
                              refresh_record=True, with_canary=run_canary)
    if as_json:
        echo_json(report.to_dict())
    else:
        click.echo(f"{report.config}  namespace {report.namespace}: {report.status.upper()}")
        rows = [[c.name, c.status, c.detail] for c in report.checks]
        click.echo(table(rows, ["check", "status", "detail"]))
    exit_with(report.exit_code)
