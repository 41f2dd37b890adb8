"""The version is written once (kvpersist.__version__); everything else reads or matches it."""

from __future__ import annotations

import re
import tomllib

import yaml

import kvpersist

from ..cli import kvp
from ..conftest import REPO


def test_pyproject_reads_the_version_from_the_package() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "kvpersist.__version__"}


def test_changelog_has_an_entry_for_the_version() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    version = re.escape(kvpersist.__version__)
    assert re.search(rf"^## .*(?<![\w.]){version}(?![\w.])", text, flags=re.M)


def test_ansible_role_and_docs_install_this_version() -> None:
    defaults = yaml.safe_load((REPO / "ansible/roles/kvp/defaults/main.yml").read_text())
    assert defaults["kvp_version"] == kvpersist.__version__
    role_readme = (REPO / "ansible/roles/kvp/README.md").read_text()
    assert f"| `kvp_version` | `{kvpersist.__version__}` |" in role_readme
    deployment = (REPO / "docs/deployment.md").read_text()
    assert f"'kvpersist[cache]=={kvpersist.__version__}'" in deployment


def test_cli_version_option() -> None:
    res = kvp("--version")
    assert res.returncode == 0
    assert res.stdout.strip() == f"kvp-admin, version {kvpersist.__version__}"
