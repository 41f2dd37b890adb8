"""The releases of the support matrix and where their venvs are.

0.32.0 is vLLM's CPU build in this suite's own venv (the full stack runs on it); 0.33.0 and
0.34.0 are the GPU wheels in ``.venv-vllm-VERSION`` (``bash scripts/setup.sh --vllm VERSION``;
``scripts/test.sh`` builds them), or ``KVP_TEST_VLLM_VENVS=DIR`` holding ``vllm-VERSION/``.
A missing venv fails the tests that need it (never skips): the matrix is part of the suite.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

import pytest

from kvpersist.system.vllm_seam import DEFAULT_VERSION, RELEASES

from ..conftest import REPO


def venv_of(version: str) -> Path:
    """The venv that has vLLM ``version`` (its ``bin`` has python and kvp-admin), once no
    ``scripts/setup.sh --vllm`` is building it (it holds ``VENV.lock`` meanwhile)."""
    if version == DEFAULT_VERSION:
        return Path(sys.executable).parent.parent
    base = os.environ.get("KVP_TEST_VLLM_VENVS")
    venv = Path(base) / f"vllm-{version}" if base else REPO / f".venv-vllm-{version}"
    lock = Path(f"{venv}.lock")
    if lock.exists():
        with lock.open() as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # waits for a build in progress
    if not (venv / ".kvpersist-stack").exists():
        pytest.fail(f"no venv with vLLM {version} at {venv}: run `bash scripts/setup.sh "
                    f"--vllm {version}` (scripts/test.sh does)")
    return venv


VERSIONS = list(RELEASES)
