"""The chat-template digest of the identity (pure).

``chat_template_sha256`` = sha256 of the chat template *rendered* on the fixed probe
conversation below, the way Hugging Face ``apply_chat_template`` renders it (sandboxed
Jinja2, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``). Two templates
that render the probe identically produce the same token stream for it, and any change that
alters what the model sees changes the digest.

The probe (documented in README; never change it, every namespace depends on it):

* messages: system "You are a helpful assistant.", user "Hello!", assistant "Hi! How can I
  help?", user "Summarise our chat."
* ``add_generation_prompt=True``, ``bos_token="<s>"``, ``eos_token="</s>"``, no tools.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvpersist.errors import ConfigError, Problem

PROBE_MESSAGES: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Summarise our chat."},
)
PROBE_BOS = "<s>"
PROBE_EOS = "</s>"


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def render_probe(template: str) -> str:
    """Render ``template`` on the probe conversation; raises ConfigError if it fails."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = _tojson
    try:
        compiled = env.from_string(template)
        return compiled.render(
            messages=[dict(m) for m in PROBE_MESSAGES],
            add_generation_prompt=True,
            bos_token=PROBE_BOS,
            eos_token=PROBE_EOS,
            tools=None,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ConfigError(Problem("chat template", f"does not render: {exc}",
                                  "check the template with apply_chat_template")) from exc


def template_sha256(template: str) -> str:
    """sha256 hex of the template rendered on the probe conversation."""
    return hashlib.sha256(render_probe(template).encode("utf-8")).hexdigest()


def extract_template(text: str) -> str:
    """The chat template held by ``text``: a tokenizer_config.json (its ``chat_template``,
    a string or the entry named ``default``) or the raw Jinja template itself."""
    stripped = text.lstrip()
    if stripped.startswith("{") and not stripped.startswith(("{{", "{%", "{#")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return text
        tpl = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(tpl, list):
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            tpl = named.get("default")
        if not isinstance(tpl, str):
            raise ConfigError(Problem("chat template", "the JSON file has no chat_template",
                                      "pass tokenizer_config.json or a .jinja file"))
        return tpl
    return text
