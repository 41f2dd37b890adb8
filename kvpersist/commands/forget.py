"""``kvp-admin forget``: remove one conversation's chunks from every tier (dry run by default)."""

from __future__ import annotations

from typing import Any

import click

from kvpersist.commands.common import config_argument, echo_json, exit_with, json_option, table
from kvpersist.errors import UsageError
from kvpersist.l2.layout import display_name


@click.command("forget")
@config_argument
@click.option("--messages", "messages", metavar="FILE",
              help="A chat conversation: a JSON array of {role, content} messages, or "
                   "{\"messages\": [...]}; rendered with the deployment's chat template.")
@click.option("--prompt-file", "prompt_file", metavar="FILE",
              help="A text prompt, tokenized as /v1/completions does.")
@click.option("--token-ids", "token_ids", metavar="FILE",
              help="A JSON array of token ids, used as they are.")
@click.option("--cache-salt", "cache_salt", default="", metavar="SALT",
              help="The cache_salt the conversation's requests carried (their chunk names "
                   "end in @SALT).")
@click.option("--include-pinned", is_flag=True,
              help="Also remove the chunks the conversation shares with the warm set "
                   "(pinned; kept by default).")
@click.option("--apply", is_flag=True, help="Delete (default: a dry run that deletes nothing).")
@json_option
def forget(config: str, messages: str | None, prompt_file: str | None, token_ids: str | None,
           cache_salt: str, include_pinned: bool, apply: bool, as_json: bool) -> None:
    """Remove one conversation's KV chunks from every tier: dry run unless --apply.

    Tokenizes the input as the deployment's vLLM does, computes its chunk keys with
    LMCache's own key code (every request of the conversation, every TP rank) and removes
    those chunks only: the files under the cache root, the keys on the shared tier and the
    copies in the cache server's L1 (DELETE /cache/objects). Chunks the conversation shares
    with the warm set are kept unless --include-pinned. Exit 0 done (or a dry run), 1 when a
    tier could not be completed (run it again), 2 for a usage or configuration error.
    """
    given = [(k, p) for k, p in (("messages", messages), ("prompt", prompt_file),
                                 ("token_ids", token_ids)) if p is not None]
    if len(given) != 1:
        raise UsageError("give exactly one of --messages FILE, --prompt-file FILE and "
                         "--token-ids FILE")
    from kvpersist.actions.forget import forget as forget_action

    (kind, path), = given
    res = forget_action(config, kind=kind, path=path, cache_salt=cache_salt,
                        include_pinned=include_pinned, apply=apply)
    if as_json:
        echo_json(res.to_dict())
    else:
        _print(res.to_dict())
    for w in res.warnings:
        click.echo(f"warning: {w}", err=True)
    for p in res.problems:
        click.echo(f"error: {p}", err=True)
    exit_with(res.exit_code)


def _print(doc: dict[str, Any]) -> None:
    plan, tiers = doc["plan"], doc["tiers"]
    verb = "would remove" if doc["dry_run"] else "removed"
    salt = f", cache salt {display_name(doc['cache_salt'])}" if doc["cache_salt"] else ""
    click.echo(f"namespace {doc['namespace']}{salt}: {doc['input']['kind']} "
               f"{doc['input']['file']}, {len(plan['requests'])} request(s), "
               f"{plan['chunks']} chunk(s) x {doc['world_size']} rank(s) = {plan['keys']} "
               f"key(s); {plan['pinned_keys']} key(s) shared with the warm set "
               f"({'removed too' if doc['include_pinned'] else 'kept'})")
    nvme, mem, shared = tiers["nvme"], tiers["memory"], tiers["shared"]
    rows: list[list[Any]] = [[
        "nvme", nvme["state"], f"{nvme['found']['files']} files",
        f"{nvme['found']['bytes']:,}", nvme["deleted"]["files"],
        f"{nvme['kept_pinned']['files']} files"]]
    if shared["configured"]:
        found = shared.get("found", {"keys": 0, "bytes": 0})
        rows.append(["shared", shared["state"], f"{found['keys']} keys", f"{found['bytes']:,}",
                     shared.get("deleted", {}).get("keys", 0),
                     f"{shared.get('kept_pinned', {}).get('keys', 0)} keys"])
    else:
        rows.append(["shared", "none (no KVP_SHARED_TIER)", "-", "-", "-", "-"])
    mem_found = "not listable" if doc["dry_run"] else f"{mem['deleted_keys']} keys"
    rows.append(["memory (L1)", mem["state"] + ("" if mem["server_answers"] else
                                                 ", server not answering"),
                 mem_found, "-", mem["deleted_keys"], "-"])
    click.echo(table(rows, ["TIER", "STATE", "FOUND", "BYTES", "DELETED", "KEPT (PINNED)"]))
    total_files = nvme["found"]["files"]
    click.echo(f"{verb} {total_files} file(s), {nvme['found']['bytes']:,} bytes on the NVMe"
               + ("" if doc["dry_run"] else
                  f"; {mem['deleted_keys']} key(s) dropped from L1, "
                  f"{mem['index_dropped_keys']} from the server's NVMe index")
               + ("; dry run: nothing deleted, --apply deletes" if doc["dry_run"] else ""))
