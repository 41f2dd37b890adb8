#!/usr/bin/env bash
# Start-up of `kvp-admin --help` against a named baseline: the start of a Python that only
# imports click (what any click CLI pays). Whole-process runs, alternated, with hyperfine.
# Usage: bash bench/bench_startup.sh [RUNS]      (needs hyperfine: apt-get install hyperfine)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RUNS=${1:-21}
hyperfine --warmup 3 --runs "$RUNS" -N \
  "$PY -c 'import click'" \
  "$PY -m kvpersist.cli --help" \
  "$PY -m kvpersist.cli identity namespace cpu-demo"
