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

A template is untrusted code: ``{{ 1 / 0 }}`` raises, two nested loops of ``range(100000)``
never end, ``{{ 10 ** 10 ** 8 }}`` computes for minutes in C (at compile time: Jinja folds
constants), ``{{ 'x' * 10**10 }}`` asks for ten gigabytes. So the probe is compiled and
rendered in a forked child (:func:`kvpersist.system.forked.call_bounded`: a wall-clock and
a CPU-time limit, an address-space limit, a cap on the rendered bytes) and, inside it, in
Jinja's :class:`~jinja2.sandbox.ImmutableSandboxedEnvironment`; every way of failing is a
ConfigError naming the template's source. docs/identity.md has the measurements that chose
a forked child over an alarm or a subprocess.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvpersist.errors import ConfigError, Problem
from kvpersist.system.forked import BoundedCallError, call_bounded
from kvpersist.system.untrusted import UnreadableFile, parse_json

PROBE_MESSAGES: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Summarise our chat."},
)
PROBE_BOS = "<s>"
PROBE_EOS = "</s>"

#: the bounds of one probe render (a real chat template renders in about a millisecond)
RENDER_SECONDS = 5.0
RENDER_MAX_BYTES = 1 << 20
RENDER_MEMORY = 256 << 20
_FIX = "check the template with apply_chat_template"


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    """The one Jinja environment of the probe (built once per process, before a child is
    forked: its lexer is then not built again in every child)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = _tojson
    return env


def render_here(template: str) -> str:
    """``template`` rendered on the probe conversation in this process, without bounds (the
    sandboxed child of :func:`render_probe` calls it). Raises whatever the template raises."""
    compiled = _environment().from_string(template)
    return compiled.render(
        messages=[dict(m) for m in PROBE_MESSAGES],
        add_generation_prompt=True,
        bos_token=PROBE_BOS,
        eos_token=PROBE_EOS,
        tools=None,
    )


def render_probe_bytes(template: str, source: str = "chat template") -> bytes:
    """``template`` rendered on the probe conversation, as UTF-8, in a bounded child (see
    the module's docstring). Raises ConfigError naming ``source`` for every way of failing:
    an error of Jinja or any other exception the template raises, text that is not UTF-8,
    more than :data:`RENDER_SECONDS`, more memory than :data:`RENDER_MEMORY`, a result of
    more than :data:`RENDER_MAX_BYTES`."""
    _environment()  # built here, inherited by the child
    try:
        return call_bounded(lambda: render_here(template).encode("utf-8"),
                            seconds=RENDER_SECONDS, max_bytes=RENDER_MAX_BYTES,
                            memory=RENDER_MEMORY)
    except BoundedCallError as exc:
        raise ConfigError(Problem(source, f"does not render: {exc.why}", _FIX)) from None


def render_probe(template: str, source: str = "chat template") -> str:
    """:func:`render_probe_bytes` as text. Raises ConfigError naming ``source``."""
    return render_probe_bytes(template, source).decode("utf-8")


def template_sha256(template: str, source: str = "chat template") -> str:
    """sha256 hex of the template rendered on the probe conversation. Raises ConfigError
    naming ``source`` if it does not render within the bounds."""
    return hashlib.sha256(render_probe_bytes(template, source)).hexdigest()


def extract_template(text: str, where: str = "chat template") -> str:
    """The chat template held by ``text``: a tokenizer_config.json (its ``chat_template``,
    a string or the entry named ``default``) or the raw Jinja template itself (also what
    is not JSON at all). ``where`` names the file in errors. Raises ConfigError for a JSON
    document that cannot be used (nested too deep, a number out of range) or holds no
    chat template."""
    stripped = text.lstrip()
    if stripped.startswith("{") and not stripped.startswith(("{{", "{%", "{#")):
        try:
            data = parse_json(text, where)
        except UnreadableFile as exc:
            if exc.why.startswith("is not valid JSON"):
                return text  # a template that starts with a brace
            raise ConfigError(exc.problem()) from None
        tpl = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(tpl, list):
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            tpl = named.get("default")
        if not isinstance(tpl, str):
            raise ConfigError(Problem(where, "the JSON file has no chat_template",
                                      "pass tokenizer_config.json or a .jinja file"))
        return tpl
    return text
