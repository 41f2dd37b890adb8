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
# TEST_LANES=2 runs two pytest processes at once on a machine with two idle cores: the full
# stack and the deployment gates in one (output shown when both are done), unit and
# integration in the other. The suite spends most of its time starting processes one at a
# time, so the second lane uses the second core. Pass no test paths then (both lanes get
# "$@"). The default, 1, is one pytest process over testpaths, as before.
if [ "${TEST_LANES:-1}" = 1 ]; then
    exec "$VENV/bin/python" -m pytest -p no:cacheprovider "$@"
fi
lane2=(tests/fullstack tests/deploy tests/infra)
log=$(mktemp -t kvp-test-lane2.XXXXXX)
echo "[test] two lanes: ${lane2[*]} (to $log) beside tests/unit tests/integration" >&2
"$VENV/bin/python" -m pytest -p no:cacheprovider "$@" "${lane2[@]}" >"$log" 2>&1 &
pid2=$!
rc1=0
"$VENV/bin/python" -m pytest -p no:cacheprovider "$@" tests/unit tests/integration || rc1=$?
rc2=0
wait "$pid2" || rc2=$?
echo "[test] lane ${lane2[*]} (exit $rc2):" >&2
cat "$log"
echo "[test] exit: unit+integration $rc1, ${lane2[*]} $rc2" >&2
[ "$rc1" = 0 ] || exit "$rc1"
exit "$rc2"
