"""``kvp-admin launch``, ``stop``, ``restart`` and ``status``: parse, call the lifecycle
actions, format."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from kvpersist.commands.common import (
    RATE,
    SECONDS,
    WAIT,
    config_argument,
    echo_json,
    exit_with,
    json_option,
    table,
)
from kvpersist.stack.launch_options import DEFAULTS, STOP_TIMEOUT, LaunchOptions

if TYPE_CHECKING:
    from kvpersist.actions import lifecycle as lifecycle_types


def _progress(msg: str) -> None:
    click.echo(f"  {msg}", err=True)


#: options launch and restart share
_server_timeout = click.option("--timeout", type=SECONDS, default=DEFAULTS.server_timeout,
                               show_default=True,
                               help="Seconds to wait for the cache server to become healthy.")
_vllm_timeout = click.option("--vllm-timeout", type=SECONDS, default=DEFAULTS.vllm_timeout,
                             show_default=True,
                             help="Seconds to wait for vLLM to serve the namespace.")
_no_warmup = click.option("--no-warmup", is_flag=True,
                          help="Report ready as soon as vLLM serves, without the priming "
                               "request and the warm-up.")
_no_canary = click.option(
    "--no-canary", is_flag=True,
    help="Do not run the known-answer canary this time (docs/canary.md; KVP_CANARY=false: "
         "never). A namespace whose canary failed stays without the cache either way.")
_warmup_wait = click.option(
    "--warmup-wait", type=WAIT, default=None, metavar="SECONDS",
    help="Bound of the warm-up (kvp-admin warmup --wait) [default: KVP_WARMUP_WAIT, 120 s]; a "
         "warm-up past it is a warning, never a failed launch.")


@click.command("launch")
@config_argument
@click.option("--no-vllm", is_flag=True, help="Start only the cache server.")
@click.option("--foreground", is_flag=True,
              help="Exec the cache server in this process (for systemd); implies --no-vllm.")
@_server_timeout
@_vllm_timeout
@click.option("--allow-unpinned", is_flag=True,
              help="Launch with an incomplete identity: a one-off namespace.")
@click.option("--allow-lmcache-tmp-cleanup", "allow_tmp_cleanup", is_flag=True,
              help="Launch although files that are not LMCache's have '.tmp.' in their "
                   "names under the cache root: LMCache deletes them at its next clean stop "
                   "(as KVP_ALLOW_LMCACHE_TMP_CLEANUP=true; default: refuse, naming them).")
@click.option("--allow-unsupported-vllm", is_flag=True,
              help="Launch although the vLLM that would run is not a supported release "
                   "(docs/vllm-versions.md): the checks that need vLLM's internals are "
                   "skipped, each saying so (as KVP_ALLOW_UNSUPPORTED_VLLM=true).")
@click.option("--crash-check-rate", "crash_rate", type=RATE, default=DEFAULTS.crash_rate_mb_s,
              show_default=True,
              help="After an unclean stop: read the crash window at most this many MB/s "
                   "(0: unbounded).")
@click.option("--crash-check-seconds", "crash_seconds", type=WAIT,
              default=DEFAULTS.crash_seconds, show_default=True,
              help="After an unclean stop: stop checking the crash window after this many "
                   "seconds (what is left is checked at the next launch).")
@click.option("--check", is_flag=True,
              help="Preflight only (identity, budget, cache root, ports, weights); start "
                   "nothing. Exit 0 if a launch could proceed, 2 listing every problem.")
@_no_warmup
@_no_canary
@_warmup_wait
@click.option("--warmup-only", is_flag=True,
              help="Start nothing: wait until the deployment's vLLM (started by a unit or a "
                   "recipe) serves the namespace, then warm up, all within --deadline; for "
                   "the vLLM unit's ExecStartPost and the KV_PERSIST=1 hook. Exit 0 even "
                   "when the warm-up fails; 3 when the canary fails (docs/canary.md).")
@click.option("--deadline", type=SECONDS, default=1800.0, show_default=True,
              metavar="SECONDS",
              help="With --warmup-only: seconds for the wait and the warm-up together (the "
                   "warm-up gets KVP_WARMUP_WAIT or what is left).")
@click.option("--vllm-pid", type=click.IntRange(min=1), default=None, metavar="PID",
              help="With --warmup-only: vLLM's process (the vLLM unit passes $MAINPID); "
                   "stop waiting as soon as it exits.")
@json_option
def launch(config: str, no_vllm: bool, foreground: bool, timeout: float, vllm_timeout: float,
           allow_unpinned: bool, allow_tmp_cleanup: bool, allow_unsupported_vllm: bool,
           crash_rate: float,
           crash_seconds: float, check: bool,
           no_warmup: bool, no_canary: bool, warmup_wait: float | None, warmup_only: bool,
           deadline: float, vllm_pid: int | None, as_json: bool) -> None:
    """Preflight CONFIG, start whatever of its lmcache server and vLLM does not run, warm up.

    The two are independent processes: a running one is left as it is (and said so). After
    vLLM serves, the warm-up (kvp-admin warmup) loads the warm set into L1 before the
    launch returns; one that fails or times out is a warning: vLLM keeps serving, cold."""
    from kvpersist.actions import lifecycle
    from kvpersist.errors import ConfigError, UsageError

    if warmup_wait is not None and warmup_wait <= 0:
        raise UsageError("--warmup-wait must be > 0 seconds")
    if vllm_pid is not None and not warmup_only:
        raise UsageError("--vllm-pid goes with --warmup-only")
    if warmup_only:
        if check or foreground or no_warmup or no_canary or warmup_wait is not None:
            raise UsageError("--warmup-only cannot be combined with --check, --foreground, "
                             "--no-warmup, --no-canary or --warmup-wait (it takes "
                             "KVP_WARMUP_WAIT and KVP_CANARY)")
        if deadline <= 0:
            raise UsageError("--deadline must be > 0 seconds")
        ready = lifecycle.warmup_only(config, deadline_s=deadline, vllm_pid=vllm_pid,
                                      progress=_progress)
        if as_json:
            echo_json(ready.to_dict())
        else:
            from kvpersist.stack.launch import warmup_summary

            if ready.canary is not None:
                click.echo(f"{ready.config}: {ready.canary.summary()}")
            click.echo(f"{ready.config}: {warmup_summary(ready.warmup)}")
        if ready.canary_failed:
            exit_with(3)
        return

    opts = LaunchOptions(with_vllm=not no_vllm, foreground=foreground, server_timeout=timeout,
                         vllm_timeout=vllm_timeout, crash_rate_mb_s=crash_rate or None,
                         crash_seconds=crash_seconds, warmup=not no_warmup,
                         canary=not no_canary,
                         warmup_wait=warmup_wait, allow_unpinned=allow_unpinned,
                         allow_tmp_cleanup=allow_tmp_cleanup,
                         allow_unsupported_vllm=allow_unsupported_vllm)
    if check:
        res = lifecycle.check_launch(config, opts)
        if as_json:
            echo_json(res.to_dict())
        else:
            for note in res.notes:
                click.echo(f"note: {note}", err=True)
        if not res.ok:
            raise ConfigError(list(res.problems), "preflight")
        if not as_json:
            click.echo(f"preflight ok: {res.config} (namespace {res.namespace})")
        return
    out = lifecycle.launch(config, opts, progress=_progress)  # --foreground: never returns
    info = out.to_dict()
    if as_json:
        echo_json(info)
        _exit_if_canary_failed(out)
        return
    plan = out.plan
    click.echo(f"lmcache server  pid {info['lmcache']['pid']}  {plan.server_http_url}  "
               f"log {plan.server_log}")
    if info["vllm"]:
        click.echo(f"vLLM            pid {info['vllm']['pid']}  {plan.vllm_url}  "
                   f"(model {plan.served_model_name})  log {plan.vllm_log}")
    click.echo(f"cache root      {plan.cache_root}")
    click.echo(f"manifest        {plan.manifest_file}")
    if out.result.crash is not None:
        click.echo(f"crash window    {out.result.crash.summary().split(': ', 1)[1]}")
    if out.result.warmup is not None:
        from kvpersist.stack.launch import warmup_summary

        click.echo(f"warm-up         {warmup_summary(out.result.warmup)}")
    if out.result.prime is not None:
        click.echo(f"prime           {out.result.prime.summary()}")
    if out.result.canary is not None:
        click.echo(f"canary          {out.result.canary.summary()}")
    if out.result.recompute:
        click.echo(f"RECOMPUTE       vLLM serves without the cache: {out.result.recompute}")
    _exit_if_canary_failed(out)


def _exit_if_canary_failed(out: lifecycle_types.LaunchOutcome) -> None:
    """Exit 1 when this launch's canary failed: the deployment serves, recomputed, and
    the operator must look (docs/canary.md)."""
    canary = out.result.canary
    if canary is not None and canary.state == "failed":
        click.echo("kvp-admin: the canary failed: vLLM serves without the cache until "
                   "`kvp-admin canary reset CONFIG --apply` (see `kvp-admin canary show "
                   "CONFIG`)", err=True)
        exit_with(1)


@click.command("stop")
@config_argument
@click.option("--timeout", type=SECONDS, default=STOP_TIMEOUT, show_default=True,
              help="Seconds between SIGTERM and SIGKILL.")
@click.option("--no-vllm", is_flag=True, help="Stop only the cache server (--only server).")
@click.option("--only", type=click.Choice(["vllm", "server"]), default=None,
              help="Stop only vLLM (the cache server keeps its L1 and serves on) or only the "
                   "cache server (vLLM serves on, cold, and reconnects when it is back).")
@click.option("--systemd-stop-post", is_flag=True,
              help="For the unit's ExecStopPost: stop nothing; record a clean stop when "
                   "systemd reports that the server exited by itself with success.")
@json_option
def stop(config: str, timeout: float, no_vllm: bool, only: str | None,
         systemd_stop_post: bool, as_json: bool) -> None:
    """Stop CONFIG's vLLM, then its cache server. L2 files stay on disk."""
    import os

    from kvpersist.actions import lifecycle
    from kvpersist.errors import UsageError

    if no_vllm and only == "vllm":
        raise UsageError("--no-vllm stops only the cache server: it cannot go with --only vllm")
    if no_vllm:
        only = "server"

    if systemd_stop_post:
        post = lifecycle.systemd_stop_post(config, dict(os.environ))
        if as_json:
            echo_json(post.to_dict())
        else:
            verdict = "clean stop recorded" if post.clean else "not a clean stop"
            click.echo(f"{post.config}: {verdict} (SERVICE_RESULT={post.service_result or '-'}"
                       f" EXIT_CODE={post.exit_code or '-'} "
                       f"EXIT_STATUS={post.exit_status or '-'})")
            if post.fleet_record:
                click.echo(post.fleet_record)
        return

    out = lifecycle.stop(config, timeout=timeout, vllm=only in (None, "vllm"),
                         server=only in (None, "server"))
    if as_json:
        echo_json(out.to_dict())
    else:
        _echo_stopped(out)
    if not out.ok:
        exit_with(1)


def _echo_stopped(out: lifecycle_types.StopOutcome) -> None:
    for r in out.stopped:
        pid = f"pid {r.pid}" if r.pid else "-"
        extra = f" ({r.detail})" if r.detail else ""
        click.echo(f"{r.what:15} {pid:12} {r.how}{extra}")
        if r.error:
            click.echo(f"kvp-admin: {r.error}", err=True)
    if out.fleet_record is not None:
        click.echo(out.fleet_record.note(), err=not out.fleet_record.ok)


@click.command("restart")
@config_argument
@click.option("--only", type=click.Choice(["vllm", "server"]), default=None,
              help="Restart only vLLM (the cache server and its L1 stay) or only the cache "
                   "server (vLLM serves on, cold, and reconnects).")
@click.option("--stop-timeout", type=SECONDS, default=STOP_TIMEOUT, show_default=True,
              help="Seconds between SIGTERM and SIGKILL.")
@_server_timeout
@_vllm_timeout
@_no_warmup
@_no_canary
@_warmup_wait
@json_option
def restart(config: str, only: str | None, stop_timeout: float, timeout: float,
            vllm_timeout: float, no_warmup: bool, no_canary: bool, warmup_wait: float | None,
            as_json: bool) -> None:
    """Restart CONFIG, or only its vLLM or its cache server; L2 files stay on disk.

    Stops what is named (both by default), then launches what does not run: the launch's
    preflight, crash-window check and warm-up as for kvp-admin launch."""
    from kvpersist.actions import lifecycle
    from kvpersist.errors import UsageError

    if warmup_wait is not None and warmup_wait <= 0:
        raise UsageError("--warmup-wait must be > 0 seconds")
    opts = LaunchOptions(server_timeout=timeout, vllm_timeout=vllm_timeout,
                         warmup=not no_warmup, canary=not no_canary, warmup_wait=warmup_wait)
    out = lifecycle.restart(config, opts, only=only, timeout=stop_timeout, progress=_progress)
    if as_json:
        echo_json(out.to_dict())
        _exit_if_canary_failed(out.launch)
        return
    _echo_stopped(out.stop)
    info = out.launch.to_dict()
    click.echo(f"restarted       {', '.join(out.restarted) or 'nothing'}")
    click.echo(f"lmcache server  pid {info['lmcache']['pid']}")
    if info["vllm"]:
        click.echo(f"vLLM            pid {info['vllm']['pid']}")
    if out.launch.result.canary is not None:
        click.echo(f"canary          {out.launch.result.canary.summary()}")
    _exit_if_canary_failed(out.launch)


@click.command("status")
@config_argument
@json_option
def status(config: str, as_json: bool) -> None:
    """Show whether CONFIG's cache server and vLLM run (pid files checked, not trusted)."""
    from kvpersist.actions import lifecycle

    out = lifecycle.status(config)
    doc = out.to_dict()
    if as_json:
        echo_json(doc)
    else:
        srv, vllm = doc["lmcache"], doc["vllm"]
        rows = [["lmcache server", srv["state"], srv["pid"] or "-",
                 "healthy" if srv["healthy"] else "-", srv["reason"] or srv["http"]],
                ["vLLM", vllm["state"], vllm["pid"] or "-",
                 "ready" if vllm["ready"] else "-", vllm["reason"] or vllm["url"]]]
        click.echo(f"{out.config}  namespace {out.namespace}")
        click.echo(table(rows, ["process", "state", "pid", "check", "detail"]))
    if not out.running:
        exit_with(1)
