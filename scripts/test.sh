#!/usr/bin/env bash
# Set up (if needed), lint, type-check and check the Prometheus rules (fail fast), then run
# the whole test suite: unit, integration against real lmcache server processes, the full
# stack with vLLM's CPU build, and the deployment gates.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${KVP_VENV:-.venv}
export LMCACHE_DISABLE_BANNER=1 PYTHONUNBUFFERED=1
# No leftover KVP_ settings from the caller's shell may relocate the tests' deployments.
for v in $(env | sed -n 's/^\(KVP_[A-Z0-9_]*\)=.*/\1/p'); do unset "$v"; done
# Static checks first: a lint or type error fails in seconds, before any server starts.
echo "[test] ruff check kvpersist tests bench" >&2
"$VENV/bin/python" -m ruff check kvpersist tests bench
echo "[test] mypy (strict, see [tool.mypy] in pyproject.toml)" >&2
"$VENV/bin/python" -m mypy
echo "[test] promtool check rules / test rules (monitoring/)" >&2
promtool check rules monitoring/kvpersist-rules.yml
promtool test rules monitoring/tests/*.yml
exec "$VENV/bin/python" -m pytest -p no:cacheprovider "$@"
