"""Use cases: show, compare, compute, derive and check compatibility identities
(``kvp-admin identity``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpersist.config.chat_template import extract_template, template_sha256
from kvpersist.config.deployment import Deployment
from kvpersist.config.derive import derive_identity
from kvpersist.config.identity import diff_identities
from kvpersist.config.loader import load_deployment
from kvpersist.config.modeldir import read_model_dir
from kvpersist.errors import ConfigError, Problem, UsageError
from kvpersist.stack import identity_check
from kvpersist.stack.launch_plan import identity_inputs
from kvpersist.system import software
from kvpersist.system.files import atomic_write
from kvpersist.system.untrusted import (
    MAX_MODEL_JSON_BYTES,
    UnreadableFile,
    decode,
    read_bytes,
    show_path,
)

if TYPE_CHECKING:
    from kvpersist.config.derive import Derivation, DeriveOptions
    from kvpersist.stack.identity_check import IdentityCheck


@dataclass(frozen=True)
class IdentityView:
    """A deployment's identity fields, canonical JSON and namespace."""

    dep: Deployment

    def fields(self) -> dict[str, Any]:
        assert self.dep.identity is not None  # load_deployment refuses unpinned without opt-in
        return self.dep.identity.as_dict()

    def to_dict(self) -> dict[str, Any]:
        dep = self.dep
        assert dep.identity is not None
        return {"config": dep.name, "source": dep.source, "identity": self.fields(),
                "canonical_json": dep.identity.canonical_json(), "namespace": dep.namespace,
                "lmcache_model_name": dep.lmcache_model_name}


def show(config: str) -> IdentityView:
    """The identity of ``config`` (pinned; ConfigError otherwise)."""
    return IdentityView(load_deployment(config))


@dataclass(frozen=True)
class IdentityDiff:
    """Which identity fields differ between two deployments, and whether the namespace does."""

    a: Deployment
    b: Deployment
    changes: tuple[tuple[str, Any, Any], ...]

    @property
    def same_namespace(self) -> bool:
        return self.a.namespace == self.b.namespace

    def to_dict(self) -> dict[str, Any]:
        return {"a": {"config": self.a.name, "namespace": self.a.namespace},
                "b": {"config": self.b.name, "namespace": self.b.namespace},
                "same_namespace": self.same_namespace,
                "differences": [{"field": f, "a": va, "b": vb} for f, va, vb in self.changes]}


def diff(config_a: str, config_b: str) -> IdentityDiff:
    a, b = load_deployment(config_a), load_deployment(config_b)
    assert a.identity is not None and b.identity is not None
    return IdentityDiff(a, b, tuple(diff_identities(a.identity, b.identity)))


def template_sha(template: Path) -> str:
    """KVP_CHAT_TEMPLATE_SHA256 of a .jinja file or a tokenizer_config.json. The file is read
    as untrusted (a FIFO, a device, a directory, a file past 64 MiB, bad UTF-8 are refused;
    its bytes as they are: no newline translation, which Jinja does itself) and the template
    rendered in a bounded sandbox. Raises ConfigError naming the file if it cannot be read
    or its template does not render."""
    fix = "give a chat template file or tokenizer_config.json"
    try:
        text = decode(read_bytes(template, max_bytes=MAX_MODEL_JSON_BYTES, fix=fix),
                      show_path(template), fix)
    except FileNotFoundError:
        raise ConfigError(Problem(show_path(template), "not found", fix)) from None
    except UnreadableFile as exc:
        raise ConfigError(exc.problem()) from None
    return template_sha256(extract_template(text, show_path(template)), show_path(template))


def derive(model_dir: str, opts: DeriveOptions) -> Derivation:
    """The identity of the weights in ``model_dir`` served by this Python's lmcache and
    vLLM (or ``opts.image``). Raises ConfigError for an unreadable model directory,
    UsageError when an option contradicts what the directory records."""

    facts = read_model_dir(os.path.abspath(model_dir))
    return derive_identity(facts, software.installed(), opts)


def derived_env_text(d: Derivation) -> str:
    """The identity.env text of ``d``; UsageError if a value cannot be written to one."""
    try:
        return d.env_text()
    except ValueError as exc:
        raise UsageError(f"cannot write an identity.env for {d.model_dir}: {exc}") from exc


def write_derived(d: Derivation, out: Path, *, force: bool = False) -> None:
    """Write the identity.env of ``d`` to ``out`` (0644, atomically); an existing file is
    replaced only with ``force``."""
    if out.exists() and not force:
        raise UsageError(f"{out} exists; pass --force to replace it")
    atomic_write(out, derived_env_text(d), mode=0o644)


def check(config: str) -> IdentityCheck:
    """Compare CONFIG's identity with the weights at its KVP_MODEL_PATH and the software
    that would run it, as if vLLM started here (the model directory must exist)."""

    dep = load_deployment(config)
    if dep.identity is None:  # KVP_ALLOW_UNPINNED=true in the file
        raise ConfigError([Problem(dep.source, "the identity is unpinned: there is nothing to "
                                   "check (an unpinned namespace is never reused)",
                                   "complete the identity fields")], dep.source)
    return identity_check.check(identity_inputs(dep), vllm_launched=True,
                               require_model=True)
