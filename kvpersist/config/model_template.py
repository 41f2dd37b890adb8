"""The chat template vLLM's chat endpoint renders for a model directory, and its digest (pure).

The one vLLM would use without ``--chat-template``: a processor's (``processor_config.json``,
then ``chat_template.json``, then ``chat_template.jinja``) for models that have one, else the
tokenizer's (``chat_template.jinja`` and ``additional_chat_templates/``, else
``tokenizer_config.json``). Where it cannot be told which of two different templates vLLM
loads, the digest is refused; so is a ``chat_template`` entry of the wrong type (never
skipped for the next place a template could be).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvpersist.config.chat_template import template_sha256
from kvpersist.config.derived_field import Derived, unknown
from kvpersist.config.model_facts import ModelFacts, shown
from kvpersist.errors import ConfigError


@dataclass(frozen=True)
class TemplateChoice:
    """The chat template vLLM would use, or why it cannot be told."""

    text: str | None
    source: str
    why: str = ""
    #: a template is there but is not one (a value of the wrong type): nothing else is used
    refused: bool = False


def _tokenizer_template(m: ModelFacts) -> TemplateChoice:
    """transformers' AutoTokenizer: template files take priority over tokenizer_config."""
    files: dict[str, str] = {}
    if m.chat_template_jinja is not None:
        files["default"] = m.chat_template_jinja
    files.update(m.additional_templates)
    if files:
        if "default" not in files:
            return TemplateChoice(None, "", "additional_chat_templates/ holds only named "
                                  f"templates ({', '.join(sorted(files))}) and there is no "
                                  "chat_template.jinja: the tokenizer has no default template")
        src = ("additional_chat_templates/default.jinja" if "default" in m.additional_templates
               else "chat_template.jinja")
        return TemplateChoice(files["default"], m.file(src))
    tpl = (m.tokenizer_config or {}).get("chat_template")
    where = m.file("tokenizer_config.json")
    if isinstance(tpl, str):
        return TemplateChoice(tpl, where + ": chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return TemplateChoice(named["default"], where
                                  + ": chat_template (the one named default)")
        if "default" in named:
            return TemplateChoice(None, "", f"{where}: the chat template named default is "
                                  f"{shown(named['default'])}, not a template", True)
        return TemplateChoice(None, "", "tokenizer_config.json has named chat templates but "
                              "none named default")
    if tpl is not None:
        return TemplateChoice(None, "", f"{where}: chat_template is {shown(tpl)}, not a "
                              "template or a list of named templates", True)
    return TemplateChoice(None, "", "")


def _processor_template(m: ModelFacts) -> TemplateChoice:
    """transformers' AutoProcessor (a ProcessorMixin): processor_config.json's template, else
    the legacy chat_template.json, else the template files."""
    pc = m.processor_config or {}
    if isinstance(pc.get("chat_template"), str):
        return TemplateChoice(pc["chat_template"],
                              m.file("processor_config.json") + ": chat_template")
    if pc.get("chat_template") is not None:
        return TemplateChoice(None, "", f"{m.file('processor_config.json')}: chat_template is "
                              f"{shown(pc['chat_template'])}, not a template", True)
    if m.chat_template_json is not None:
        tpl = m.chat_template_json.get("chat_template")
        if isinstance(tpl, str) and not m.additional_templates:
            return TemplateChoice(tpl, m.file("chat_template.json"))
        if tpl is not None and not isinstance(tpl, str):
            return TemplateChoice(None, "", f"{m.file('chat_template.json')}: chat_template "
                                  f"is {shown(tpl)}, not a template", True)
        return TemplateChoice(None, "", "chat_template.json cannot be loaded by the processor")
    if "default" in m.additional_templates:
        return TemplateChoice(m.additional_templates["default"],
                              m.file("additional_chat_templates/default.jinja"))
    if m.chat_template_jinja is not None:
        return TemplateChoice(m.chat_template_jinja, m.file("chat_template.jinja"))
    return TemplateChoice(None, "", "")


def chat_template(m: ModelFacts) -> TemplateChoice:
    """The template vLLM's chat endpoint renders (no --chat-template: kvpersist owns it)."""
    tok = _tokenizer_template(m)
    may_have_processor = m.chat_template_json is not None or m.has_preprocessor_config
    if m.processor_config is not None:
        proc = _processor_template(m)
        if proc.text is not None or proc.refused:
            return proc
        return tok
    if may_have_processor:
        proc = _processor_template(m)
        if proc.refused:
            return proc
        if proc.text is not None and proc.text != tok.text:
            return TemplateChoice(None, "", (
                f"vLLM uses {proc.source} if AutoProcessor loads a processor for this model, "
                f"else {tok.source or 'the tokenizer (which has none)'}; they differ and the "
                "directory does not tell which (no processor_config.json)"))
    if tok.text is None and not tok.why:
        return TemplateChoice(None, "", "no chat template in chat_template.jinja, "
                              "chat_template.json or tokenizer_config.json (vLLM may fall back "
                              "to a template of its own for some model types)")
    return tok


def template_digest(m: ModelFacts) -> Derived:
    """KVP_CHAT_TEMPLATE_SHA256 of the template vLLM would use."""
    choice = chat_template(m)
    if choice.text is None:
        return unknown("chat_template_sha256", choice.why + ": compute the digest of the "
                        "template you serve with `kvp-admin identity template-sha FILE`")
    try:
        digest = template_sha256(choice.text, choice.source)
    except ConfigError as exc:
        why = "; ".join(p.message for p in exc.problems)
        return unknown("chat_template_sha256", f"{choice.source}: {why}")
    return Derived("chat_template_sha256", digest, f"{choice.source} (rendered on the probe)")
