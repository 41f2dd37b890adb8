"""Token ids of a warm set, exactly as the deployment's vLLM computes them (imports vLLM).

vLLM's render-only server (the render app state of the installed release, found through
:mod:`kvpersist.system.vllm_seam`) builds the same
preprocessing pipeline as the OpenAI server without an engine: the deployment's vLLM argv is
parsed with vLLM's own parser, ``AsyncEngineArgs.create_model_config()`` and ``VllmConfig``
are built as ``run_launch_fastapi`` builds them, and ``init_render_app_state`` sets up the
``OnlineRenderer`` (tokenizer, ``--chat-template`` resolution, content format, default chat
template kwargs). A ``{"messages": ...}`` entry then goes through
``OnlineRenderer.render_chat(ChatCompletionRequest)`` -- the path of ``/v1/chat/completions``
-- and a ``{"prompt": ...}`` entry through ``render_completion(CompletionRequest)``. Where each
of those lives in the installed vLLM is the seam's business; a vLLM outside the supported
releases is refused (ConfigError naming it), since its internals are not known.
``--model`` is the real weights directory (``KVP_MODEL_PATH``), not the namespace link: the
tokenizer and chat template are read from there.

The template vLLM resolves (its ``resolve_chat_template``) is digested with
kvpersist's probe (:func:`kvpersist.config.chat_template.template_sha256`) and must equal the
identity's ``chat_template_sha256``; otherwise the warm set is refused.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpersist.config.chat_template import template_sha256
from kvpersist.config.warmset import WarmEntry
from kvpersist.errors import ConfigError, KvpError, Problem
from kvpersist.system import vllm_seam


@dataclass(frozen=True)
class Tokenized:
    """Token ids per entry (file order) and the digest of the template that rendered them."""

    token_ids: list[list[int]]
    template_sha256: str


def _argv_with_model(vllm_argv: Sequence[str], model_path: str) -> list[str]:
    """The rendered arguments with the model (``--model NS``, or ``vllm serve``'s positional
    ``NS`` first) replaced by ``--model model_path``."""
    argv = list(vllm_argv)
    for i, a in enumerate(argv[:-1]):
        if a == "--model":
            argv[i + 1] = model_path
            return argv
    if argv and not argv[0].startswith("-"):
        argv = argv[1:]
    return ["--model", model_path, *argv]


def tokenize(vllm_argv: Sequence[str], model_path: str, entries: Sequence[WarmEntry], *,
             expected_template_sha256: str | None, source: str) -> Tokenized:
    """Token ids of ``entries`` for the deployment whose rendered vLLM arguments are
    ``vllm_argv`` (``--model`` replaced by ``model_path``).

    Raises ConfigError (exit 2) when vLLM refuses the arguments or an entry (naming its line),
    or when the chat template vLLM resolves does not digest to ``expected_template_sha256``
    (None: not checked; an unpinned deployment has no recorded digest)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return asyncio.run(_tokenize(_argv_with_model(vllm_argv, model_path), entries,
                                 expected_template_sha256, source))


def _parts() -> Any:
    """The installed vLLM's internals (the seam); ConfigError for an unsupported release."""
    try:
        version = vllm_seam.installed_version_in_process()
    except ImportError as exc:
        raise ConfigError(Problem("vLLM", f"cannot import vLLM: {exc}",
                                  "run where the deployment's vLLM is installed")) from None
    problem = vllm_seam.support_problem(version, "the installed vLLM")
    if problem:
        raise ConfigError(Problem("vLLM", f"{problem}: its renderer is not known, so token "
                                  "ids cannot be computed", vllm_seam.SUPPORT_FIX))
    try:
        return vllm_seam.parts(version)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(Problem("vLLM", f"vLLM {version} does not have what kvpersist "
                                  f"expects of it: {exc}", "reinstall vLLM")) from None


async def _tokenize(argv: list[str], entries: Sequence[WarmEntry],
                    expected: str | None, source: str) -> Tokenized:
    from starlette.datastructures import State

    vllm = _parts()
    try:
        args = vllm.make_arg_parser(vllm.FlexibleArgumentParser()).parse_args(argv)
        engine_args = vllm.AsyncEngineArgs.from_cli_args(args)
        model_config = engine_args.create_model_config()
        # as vLLM's render-only server: no inference, no KV cache
        model_config.quantization = None
        setattr(vllm.envs, vllm_seam.ENV_CPU_KVCACHE_SPACE, 0)
        vllm_config = vllm.VllmConfig(
            model_config=model_config,
            logging_config=engine_args.create_logging_config(),
            structured_outputs_config=engine_args.create_structured_outputs_config())
        state = State()
        await vllm.init_render_app_state(vllm_config, state, args)
    except (Exception, SystemExit) as exc:  # vLLM raises many types for a bad model dir
        raise ConfigError(Problem("KVP_MODEL_PATH / vLLM arguments",
                                  f"vLLM cannot build its renderer: {exc}",
                                  "check KVP_MODEL_PATH and `kvp-admin render CONFIG`")) from None
    online = state.online_renderer
    problems: list[Problem] = []
    templates: dict[str, str] = {}
    out: list[list[int]] = []
    for e in entries:
        where = f"{source}:{e.line}"
        try:
            ids, digest = await _entry(vllm, online, model_config, e, templates)
        except _Refused as exc:
            problems.append(Problem(where, str(exc)))
            out.append([])
            continue
        if expected is not None and digest is not None and digest != expected:
            problems.append(Problem(
                where, f"vLLM renders it with a chat template whose digest is {digest}, not "
                       f"the identity's KVP_CHAT_TEMPLATE_SHA256 {expected}: its token ids "
                       "would not be what this namespace's requests send",
                "fix KVP_CHAT_TEMPLATE_SHA256 (kvp-admin identity derive) or the "
                "--chat-template the deployment passes"))
        out.append(ids)
    if problems:
        raise ConfigError(problems, source)
    digest = next(iter(templates.values()), "") if templates else ""
    return Tokenized(out, digest)


class _Refused(KvpError):
    pass


async def _entry(vllm: Any, online: Any, model_config: Any, e: WarmEntry,
                 templates: dict[str, str]) -> tuple[list[int], str | None]:
    try:
        if e.kind == "prompt":
            creq = vllm.CompletionRequest(model=model_config.served_model_name, **e.body)
            res: Any = await online.render_completion(creq)
            digest = None
        else:
            req = vllm.ChatCompletionRequest(model=model_config.served_model_name, **e.body)
            digest = _template_digest(vllm, online, model_config, req, templates)
            res = await online.render_chat(req)
            if not isinstance(res, tuple):
                raise _Refused(_error_text(res))
            res = res[1]
    except _Refused:
        raise
    except Exception as exc:  # pydantic validation, template errors
        raise _Refused(f"vLLM refuses it: {exc}") from None
    if not isinstance(res, list) or len(res) != 1:
        raise _Refused(_error_text(res))
    ids = res[0].get("prompt_token_ids")
    if not isinstance(ids, list):
        raise _Refused("vLLM produced no prompt token ids for it")
    return [int(t) for t in ids], digest


def _template_digest(vllm: Any, online: Any, model_config: Any, req: Any,
                     templates: dict[str, str]) -> str:
    tools = None if req.tools is None else [t.model_dump() for t in req.tools]
    tokenizer = online.renderer.get_tokenizer()
    chosen = req.chat_template or online.chat_template
    key = f"{chosen!r}:{tools is not None}"
    if key not in templates:
        text = vllm.resolve_chat_template(tokenizer, chosen, tools, model_config=model_config)
        if not text:
            raise _Refused("vLLM finds no chat template for this model")
        templates[key] = template_sha256(text)
    return templates[key]


def _error_text(res: Any) -> str:
    err = getattr(res, "error", None)
    message = getattr(err, "message", None) or getattr(res, "message", None)
    return f"vLLM refuses it: {message or res}"
