"""``kvp-admin launch``, ``stop`` and ``status``: parse, call the lifecycle actions, format."""

from __future__ import annotations

from typing import Any

import click

from kvpersist.commands.common import config_argument, echo_json, json_option, table


def _progress(msg: str) -> None:
    click.echo(f"  {msg}", err=True)


@click.command("launch")
@config_argument
@click.option("--no-vllm", is_flag=True, help="Start only the cache server.")
@click.option("--foreground", is_flag=True,
              help="Exec the cache server in this process (for systemd); implies --no-vllm.")
@click.option("--timeout", type=float, default=60.0, show_default=True,
              help="Seconds to wait for the cache server to become healthy.")
@click.option("--vllm-timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for vLLM to serve the namespace.")
@click.option("--allow-unpinned", is_flag=True,
              help="Launch with an incomplete identity: a one-off namespace.")
@click.option("--check", is_flag=True,
              help="Preflight only (identity, budget, cache root, ports, weights); start "
                   "nothing. Exit 0 if a launch could proceed, 2 listing every problem.")
@json_option
def launch(config: str, no_vllm: bool, foreground: bool, timeout: float, vllm_timeout: float,
           allow_unpinned: bool, check: bool, as_json: bool) -> None:
    """Preflight CONFIG, start its lmcache server (and vLLM), wait until healthy."""
    from kvpersist.errors import ConfigError
    from kvpersist.stack import launch as lc

    dep, rendered, plan = lc.load_plan(config, allow_unpinned=allow_unpinned)
    if check:
        pre = lc.preflight(dep, plan, with_vllm=not (no_vllm or foreground))
        if as_json:
            echo_json({"config": dep.name, "namespace": dep.namespace, "ok": not pre.problems,
                       "problems": [str(p) for p in pre.problems],
                       "notes": list(pre.notes)})
        else:
            for note in pre.notes:
                click.echo(f"note: {note}", err=True)
        if pre.problems:
            raise ConfigError(list(pre.problems), "preflight")
        if not as_json:
            click.echo(f"preflight ok: {dep.name} (namespace {dep.namespace})")
        return
    if foreground:
        srv = lc.server_state(plan)
        if srv.running:
            lc._refuse_if_running(srv, "the cache server", _progress)
        pre = lc.preflight(dep, plan, with_vllm=False)
        if pre.problems:
            raise ConfigError(list(pre.problems), "preflight")
        lc.prepare_state(plan, rendered, progress=_progress)
        click.echo(f"exec lmcache server for {dep.namespace} (pid file "
                   f"{plan.server_pid_file})", err=True)
        lc.exec_server_foreground(plan)
        return
    click.echo(f"launching {dep.name} (namespace {dep.namespace})", err=True)
    result = lc.launch(dep, rendered, plan, with_vllm=not no_vllm, server_timeout=timeout,
                       vllm_timeout=vllm_timeout, progress=_progress)
    info: dict[str, Any] = {
        "config": dep.name,
        "namespace": dep.namespace,
        "cache_root": plan.cache_root,
        "manifest": plan.manifest_file,
        "notes": list(result.notes),
        "lmcache": {"pid": result.started[0].pid, "pid_file": plan.server_pid_file,
                    "log": plan.server_log, "http": plan.server_http_url,
                    "seconds_to_healthy": round(result.started[0].seconds, 2)},
        "vllm": None,
    }
    if len(result.started) > 1:
        v = result.started[1]
        info["vllm"] = {"pid": v.pid, "mode": plan.vllm_mode, "url": plan.vllm_url,
                        "log": plan.vllm_log, "pid_file": plan.vllm_pid_file,
                        "served_model_name": plan.served_model_name,
                        "seconds_to_ready": round(v.seconds, 2)}
    if as_json:
        echo_json(info)
        return
    click.echo(f"lmcache server  pid {info['lmcache']['pid']}  {plan.server_http_url}  "
               f"log {plan.server_log}")
    if info["vllm"]:
        click.echo(f"vLLM            pid {info['vllm']['pid']}  {plan.vllm_url}  "
                   f"(model {plan.served_model_name})  log {plan.vllm_log}")
    click.echo(f"cache root      {plan.cache_root}")
    click.echo(f"manifest        {plan.manifest_file}")


@click.command("stop")
@config_argument
@click.option("--timeout", type=float, default=30.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL.")
@click.option("--no-vllm", is_flag=True, help="Stop only the cache server.")
@json_option
def stop(config: str, timeout: float, no_vllm: bool, as_json: bool) -> None:
    """Stop CONFIG's vLLM, then its cache server. L2 files stay on disk."""
    from kvpersist.stack import launch as lc

    _, _, plan = lc.load_plan(config, allow_unpinned=True)
    results = lc.stop_deployment(plan, timeout=timeout, vllm=not no_vllm)
    if as_json:
        echo_json({"stopped": [r.__dict__ for r in results]})
        return
    for r in results:
        pid = f"pid {r.pid}" if r.pid else "-"
        extra = f" ({r.detail})" if r.detail else ""
        click.echo(f"{r.what:15} {pid:12} {r.how}{extra}")


@click.command("status")
@config_argument
@json_option
def status(config: str, as_json: bool) -> None:
    """Show whether CONFIG's cache server and vLLM run (pid files checked, not trusted)."""
    from kvpersist.stack import launch as lc

    dep, _, plan = lc.load_plan(config, allow_unpinned=True)
    srv = lc.server_state(plan)
    srv_ok = lc.http_ok(f"{plan.server_http_url}/healthcheck", 2.0) if srv.running else False
    vst = lc.vllm_state(plan) if plan.vllm_mode == "process" else None
    vllm_ok = lc.vllm_ready(plan, 2.0)
    out: dict[str, Any] = {
        "config": dep.name,
        "namespace": dep.namespace,
        "cache_root": plan.cache_root,
        "lmcache": {"state": srv.state, "pid": srv.pid, "reason": srv.reason,
                    "pid_file": plan.server_pid_file, "healthy": srv_ok,
                    "http": plan.server_http_url},
        "vllm": {"mode": plan.vllm_mode, "state": vst.state if vst else "unknown",
                 "pid": vst.pid if vst else None, "reason": vst.reason if vst else "",
                 "ready": vllm_ok, "url": plan.vllm_url},
    }
    if as_json:
        echo_json(out)
    else:
        rows = [["lmcache server", srv.state, srv.pid or "-",
                 "healthy" if srv_ok else "-", srv.reason or plan.server_http_url],
                ["vLLM", out["vllm"]["state"], out["vllm"]["pid"] or "-",
                 "ready" if vllm_ok else "-", out["vllm"]["reason"] or plan.vllm_url]]
        click.echo(f"{dep.name}  namespace {dep.namespace}")
        click.echo(table(rows, ["process", "state", "pid", "check", "detail"]))
    if not (srv.running and srv_ok):
        raise SystemExit(1)
