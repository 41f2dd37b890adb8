"""``kvp-admin metrics``: Prometheus text exposition of kvpersist's facts (parse and format only).

Without ``--textfile`` the exposition goes to stdout; with it, one file per cache root and one
per deployment are written atomically into the node_exporter textfile-collector directory.
"""

from __future__ import annotations

import click

from kvpersist.commands.common import TIMEOUT, end_progress, exit_with, progress_printer

#: Debian's node_exporter textfile-collector directory (prometheus-node-exporter package)
DEFAULT_TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"


@click.command("metrics")
@click.argument("configs", nargs=-1, metavar="[CONFIG]...")
@click.option("--root", type=click.Path(file_okay=False), default=None,
              help="Cache root to measure (default: the configs' KVP_CACHE_ROOT). With a root "
                   "and no CONFIG, disk figures only, with every config under configs/ on this "
                   "root counted as active.")
@click.option("--textfile", "textfile_dir", type=click.Path(file_okay=False), default=None,
              metavar="DIR",
              help="Write kvpersist-root-*.prom, kvpersist-store-*.prom (shared tier) and "
                   "kvpersist-deployment-<config>.prom into DIR "
                   f"(node_exporter's textfile collector; Debian: {DEFAULT_TEXTFILE_DIR}) "
                   "instead of printing.")
@click.option("--no-vllm", is_flag=True, help="Do not probe vLLM (this host runs none).")
@click.option("--timeout", type=TIMEOUT, default=3.0, show_default=True,
              help="Timeout of each health probe, seconds.")
def metrics(configs: tuple[str, ...], root: str | None, textfile_dir: str | None,
            no_vllm: bool, timeout: float) -> None:
    """Prometheus metrics of cache roots, shared-tier stores and deployments: bytes per
    namespace, budget, free space, temp and quarantined files, health, last verify and prune,
    keys and memory of the shared tier.

    Exit status 1 when a cache root or a shared-tier store could not be measured (its
    deployments' health series, and the store's up 0, are still written)."""
    from prometheus_client import generate_latest

    from kvpersist.actions.metrics import collect, write_textfiles
    from kvpersist.system.untrusted import show_path

    cb = progress_printer("scanned entries")
    try:
        outcome = collect(root, configs, timeout=timeout, expect_vllm=not no_vllm, progress=cb)
    finally:
        end_progress(cb)
    for note in outcome.notes:
        click.echo(f"note: {note}", err=True)
    if textfile_dir is None:
        click.echo(generate_latest(outcome.whole().registry()).decode(), nl=False)
    else:
        for path in write_textfiles(outcome, textfile_dir):
            click.echo(f"wrote {show_path(path)}", err=True)
    for problem in outcome.unmeasured:
        click.echo(f"kvp-admin: {problem}", err=True)
    if outcome.unmeasured:
        # the health series (and a store's up 0) were written; exit 1 says that a root's or a
        # store's figures are missing
        exit_with(1)
