"""Check a deployment's identity against what would run (I/O): the weights at
``KVP_MODEL_PATH``, this Python's lmcache and vLLM, the image in container mode.

:func:`check` gathers the facts (:mod:`kvpersist.config.modeldir`,
:mod:`kvpersist.system.software`) and compares them (:func:`~kvpersist.config.compare.
check_identity`). ``launch``, ``launch --check``, ``launch --foreground`` (through
:func:`~kvpersist.stack.preflight.preflight`), ``kvp-admin identity check`` and, through it,
the ``KV_PERSIST=1`` hook and ``run-vllm-with-persist.sh`` all run it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from kvpersist.config.compare import (
    MISMATCH,
    OK,
    RENDERED,
    UNCHECKED,
    CheckContext,
    FieldCheck,
    check_identity,
)
from kvpersist.config.identity import CacheIdentity
from kvpersist.config.known_bad import OPT_IN as KNOWN_BAD_OPT_IN
from kvpersist.config.known_bad import known_bad
from kvpersist.config.model_facts import ModelFacts
from kvpersist.config.modeldir import read_model_dir
from kvpersist.errors import ConfigError, Problem
from kvpersist.system import software

_PIN_NAME = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==")


@dataclass(frozen=True)
class IdentityCheck:
    """The identity of one deployment compared with what would run."""

    config: str
    namespace: str
    model_path: str
    #: "present", "absent" (nothing at KVP_MODEL_PATH) or "unreadable"
    model_state: str
    vllm_mode: str
    checks: tuple[FieldCheck, ...]
    #: problems that stop the comparison itself (unreadable weights, a missing model dir
    #: where one is required)
    problems: tuple[Problem, ...] = ()

    def by_status(self, status: str) -> list[FieldCheck]:
        return [c for c in self.checks if c.status == status]

    @property
    def mismatches(self) -> list[FieldCheck]:
        return self.by_status(MISMATCH)

    @property
    def consistent(self) -> bool:
        return not self.mismatches and not self.problems

    def launch_problems(self) -> list[Problem]:
        """What refuses a launch: every problem, then every mismatch as ``KEY: config says
        X, SOURCE says Y``."""
        return [*self.problems, *(c.problem() for c in self.mismatches)]

    def launch_notes(self) -> list[str]:
        """One line for launch: what was compared, what could not be."""
        if not self.checks:
            return []
        ok = self.by_status(OK)
        unchecked = self.by_status(UNCHECKED)
        line = (f"identity: {len(ok)} field(s) agree with {self.model_path} and the installed "
                f"software, {len(self.by_status(RENDERED))} rendered to vLLM")
        if unchecked:
            line += f", {len(unchecked)} unchecked ({', '.join(c.key for c in unchecked)})"
        notes = [line]
        reasons = dict.fromkeys(c.detail for c in unchecked if c.detail)
        notes += [f"identity unchecked: {r}" for r in reasons]
        return notes

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "namespace": self.namespace,
                "model_path": self.model_path, "model_state": self.model_state,
                "vllm_mode": self.vllm_mode, "consistent": self.consistent,
                "counts": {s: len(self.by_status(s))
                           for s in (OK, MISMATCH, UNCHECKED, RENDERED)},
                "fields": {c.name: c.to_dict() for c in self.checks},
                "problems": [str(p) for p in self.problems]}


def known_bad_problems(config: Any, *, allowed: bool, canary: bool,
                       where: str) -> list[Problem]:
    """What refuses a model in the table of known corruption (:mod:`kvpersist.config.
    known_bad`): each match unless the deployment opted in, and an opt-in with the canary off
    (pure)."""
    out = []
    for bad in known_bad(config if isinstance(config, dict) else {}):
        if not allowed:
            out.append(Problem(where, bad.message(), KNOWN_BAD_OPT_IN))
        elif not canary:
            out.append(Problem("KVP_CANARY", f"{bad.message()}; KVP_ALLOW_KNOWN_CORRUPTION is "
                               "set, so the canary must stay on", "set KVP_CANARY=true"))
    return out


@dataclass(frozen=True)
class IdentityInputs:
    """What the identity check reads of a deployment, taken from it once (plain values: a
    launch plan carries them, :func:`kvpersist.stack.launch_plan.identity_inputs`;
    :func:`check` compares them with what would run)."""

    config: str = ""
    namespace: str = ""
    #: None: the deployment is not pinned (nothing to compare)
    identity: CacheIdentity | None = None
    model_path: str = ""
    vllm_mode: str = "process"
    image: str = ""
    container_engine: str = "docker"
    allow_known_corruption: bool = False
    canary: bool = True


def check(i: IdentityInputs, *, vllm_launched: bool,
          require_model: bool = False) -> IdentityCheck:
    """Compare a deployment's identity with the weights at its KVP_MODEL_PATH and the
    software that would run it.

    ``vllm_launched``: vLLM starts where this runs (its build is then compared; without it
    the weights are only compared when present). ``require_model``: a missing weights
    directory is a problem (``identity check``) instead of making the model fields
    unchecked (``launch --no-vllm`` on a host that serves the cache only; a launch that
    starts vLLM reports the missing directory in its own preflight).
    """
    mode = i.vllm_mode
    if i.identity is None:
        return IdentityCheck(i.config, i.namespace, i.model_path, "unchecked", mode, ())
    problems: list[Problem] = []
    model: ModelFacts | None = None
    path = i.model_path
    if not os.path.lexists(path):
        state = "absent"
        why = f"no weights at KVP_MODEL_PATH {path}"
        if require_model:
            problems.append(Problem("KVP_MODEL_PATH", f"{path} does not exist: the identity "
                                    "is compared with the weights there",
                                    "point it at the model weights directory"))
        elif not vllm_launched:
            why += " (vLLM does not start here)"
    else:

        try:
            model = read_model_dir(path)
            state, why = "present", ""
        except ConfigError as exc:
            state, why = "unreadable", f"the weights at KVP_MODEL_PATH {path} cannot be read"
            problems += [Problem(f"KVP_MODEL_PATH: {p.where}", p.message, p.fix)
                         for p in exc.problems]
    if model is not None:
        problems += known_bad_problems(model.config, allowed=i.allow_known_corruption,
                                       canary=i.canary, where=f"{path}/config.json")
    ident = i.identity
    pins = tuple(m.group(1) for m in (_PIN_NAME.match(b) for b in
                                      (ident.connector_build, ident.vllm_build)) if m)
    inst = software.installed(pins)
    image_info = None
    if mode == "container" and vllm_launched and "@sha256:" not in i.image and \
            "sha256:" in f"{ident.vllm_build} {ident.connector_build}":
        image_info = software.inspect_image(i.image, engine=i.container_engine)
    venv = image_info.labels.get(software.VENV_LABEL, "") if image_info else ""
    ctx = CheckContext(model=model, model_why=why, installed=inst, vllm_mode=mode,
                       vllm_launched=vllm_launched, image=i.image, image_info=image_info,
                       venv_dists_now=software.venv_distributions_digest(venv) if venv
                       else None)
    return IdentityCheck(i.config, i.namespace, path, state, mode,
                         check_identity(ident, ctx), tuple(problems))
