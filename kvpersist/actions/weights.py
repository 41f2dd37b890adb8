"""Use case: ``kvp-admin weights CONFIG``: the weights at ``KVP_MODEL_PATH`` against what the
namespace was first served with (the same check as launch's preflight), on demand and before
a vLLM that kvpersist does not start itself (``run-vllm-with-persist.sh``, the
``KV_PERSIST=1`` hook)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvpersist.config.loader import load_deployment
from kvpersist.errors import ConfigError, KvpError, Problem
from kvpersist.stack.locate import Location, locate
from kvpersist.stack.render import manifest
from kvpersist.stack.weights import WeightsCheck, check_weights, record_in_manifest
from kvpersist.system.files import service_uids, trust_problems


@dataclass(frozen=True)
class WeightsOutcome:
    """The check's result, and whether this call recorded the fingerprint."""

    config: str
    namespace: str
    loc: Location
    check: WeightsCheck
    recorded: str = ""

    @property
    def changed(self) -> bool:
        return self.check.status == "changed"

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "namespace": self.namespace,
                "model_path": self.loc.model_target, "manifest": self.loc.manifest_file,
                "digest_cache": self.loc.weights_cache, **self.check.to_dict(),
                "recorded_now": self.recorded}


def weights(config: str, *, record: bool = False, rehash: bool = False) -> WeightsOutcome:
    """Fingerprint ``config``'s weights and compare them with its namespace's record;
    ``record`` writes the fingerprint into the manifest when none is recorded yet.

    Raises ConfigError (exit 2) for a state dir that others could write, weights that are
    missing or unreadable, or a manifest that cannot be read. A changed fingerprint is in the
    result (``changed``), not raised."""

    dep = load_deployment(config, allow_unpinned=True)
    loc = locate(dep)
    try:
        also = service_uids(dep.settings.service_user)
    except KvpError as exc:
        raise ConfigError(Problem("KVP_SERVICE_USER", str(exc)), dep.name) from exc
    problems = [Problem("KVP_STATE_DIR", why, "the service user must own its state dir, and "
                        "no other user may be able to replace it (the digests and the record "
                        "are kept there)") for why in trust_problems(loc.state_dir, also=also)]
    if dep.pinned and not os.path.exists(loc.model_target):
        problems.append(Problem("KVP_MODEL_PATH", f"{loc.model_target} does not exist",
                                "point it at the model weights directory"))
    if problems:
        raise ConfigError(problems, dep.name)
    chk = check_weights(loc, pinned=dep.pinned, with_vllm=True, rehash=rehash)
    if chk.status == "unchecked" and chk.problems:
        raise ConfigError(list(chk.problems), dep.name)
    done = ""
    if record and chk.status == "first" and chk.record is not None:

        done = record_in_manifest(loc.manifest_file, chk.record, lambda: manifest(dep))
    return WeightsOutcome(dep.name, dep.namespace, loc, chk, done)
