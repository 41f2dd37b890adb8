"""``kvp-admin budget CONFIG``: the L1/L2 sizing plan of a deployment (parse and format only)."""

from __future__ import annotations

import click

from kvpersist.commands.common import config_argument, echo_json, exit_with, json_option
from kvpersist.config.values import GIB, format_size
from kvpersist.errors import EXIT_PROBLEM
from kvpersist.l2.budget import BudgetPlan


def format_plan(plan: BudgetPlan) -> str:
    """Human view of a budget plan."""
    lines = [
        f"namespace          {plan.namespace}",
        f"filesystem         {format_size(plan.fs_total_bytes)}, "
        f"{format_size(plan.fs_avail_bytes)} available",
        f"budget / reserve   {format_size(plan.budget_bytes)} / {format_size(plan.reserve_bytes)}",
        f"limit              {format_size(plan.limit_bytes)}",
        f"on disk now        {format_size(plan.on_disk_bytes)} "
        f"(this namespace {format_size(plan.own_bytes)}, inactive "
        f"{format_size(plan.inactive_bytes)}, other active "
        f"{format_size(plan.other_active_bytes)})",
        f"share              {format_size(plan.share_bytes)}"
        + (f" (quota {format_size(plan.quota_bytes)})" if plan.quota_bytes is not None else ""),
        f"L2 max_capacity_gb {plan.l2_max_capacity_gb:g}  "
        f"({format_size(plan.l2_max_capacity_bytes)})",
        f"reusable after restart {format_size(plan.reusable_bytes)} of "
        f"{format_size(plan.own_bytes)}",
        f"worst case on disk {format_size(plan.worst_case_bytes)} "
        f"({'within' if plan.within_budget else 'OVER'} the limit)",
        f"L1 size_gb         {plan.l1_size_gb:g} (at most {plan.l1_max_gb:g} on this host, "
        f"{plan.host_ram_bytes / GIB:.1f} GiB RAM)",
    ]
    if plan.over_low_watermark_bytes:
        lines.append(f"over low watermark {format_size(plan.over_low_watermark_bytes)} "
                     f"(kvp-admin prune --to-budget frees it)")
    lines.append("why:")
    lines += [f"  - {r}" for r in plan.reasons]
    lines += [f"warning: {w}" for w in plan.warnings]
    lines += [f"problem: {p}" for p in plan.problems]
    return "\n".join(lines)


@click.command("budget")
@config_argument
@json_option
def budget(config: str, as_json: bool) -> None:
    """How much L1 (RAM) and L2 (NVMe) the deployment's cache server may use, and why.

    Measures the cache root and host RAM; exits 1 if the plan has a problem (e.g. an L1 that
    does not fit in RAM).
    """
    from kvpersist.actions.budget import budget as budget_action

    plan, read_path = budget_action(config)
    if as_json:
        echo_json({**plan.to_dict(), "read_path": read_path.to_dict()})
    else:
        click.echo(format_plan(plan))
        click.echo("L2 read path:")
        click.echo("\n".join(f"  - {line}" for line in read_path.lines))
    if not plan.ok:
        exit_with(EXIT_PROBLEM)
