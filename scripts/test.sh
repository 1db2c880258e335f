#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh Debian machine, then runs it (lint + pytest).
#   bash scripts/test.sh            # what CI runs (.ci/run)
# Needs: python3.11+ with venv; root for apt (Prometheus, for the metrics tests; PostgreSQL, for the lake tests) unless
# prometheus is on PATH and a PostgreSQL server is under /usr/lib/postgresql/*/bin.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "==> installing Prometheus (Debian package) for the metrics tests"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  else
    echo "scripts/test.sh: prometheus is not installed and this is not root; install it with" >&2
    echo "  sudo apt-get install -y --no-install-recommends prometheus" >&2
    exit 1
  fi
fi

# The lake tests start a throwaway PostgreSQL cluster (the DuckLake catalog) from Debian's server binaries.
if ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    echo "==> installing PostgreSQL (Debian package) for the lake tests"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null
  else
    echo "scripts/test.sh: PostgreSQL's server (initdb under /usr/lib/postgresql/*/bin) is not installed and this is" >&2
    echo "not root; install it with" >&2
    echo "  sudo apt-get install -y --no-install-recommends postgresql" >&2
    exit 1
  fi
fi

echo "==> installing kvfabric[vllm,dev,lake] into .venv (vLLM pulls a CUDA torch: ~5 min the first time)"
python3 -m venv .venv
.venv/bin/python -m pip install -q -c constraints.txt -e ".[vllm,dev,lake]"

echo "==> ruff"
.venv/bin/ruff check kvfabric tests benchmarks dashboards

echo "==> pytest"
.venv/bin/python -m pytest -q "$@"
