#!/usr/bin/env bash
# Installs what kvrouter needs on a fresh machine: the package with its test extra, and
# Debian's redis-server (used by the shared-state tests). Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[test]"
if [[ "${1:-}" == "--with-redis" ]] && ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server not found and apt-get unavailable: install Redis >= 6 yourself" >&2
    exit 1
  fi
fi
