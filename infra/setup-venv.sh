#!/usr/bin/env bash
# Create .venv and install precast into it with the locked dependency set (infra/install.sh, as
# the worker image does); a no-op when the locks and pyproject.toml are unchanged since the last
# install. Sourced by infra/demo.sh and infra/test.sh; needs only python3 (3.11+).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stamp=".venv/.installed-$(cat pyproject.toml infra/requirements.lock infra/requirements-test.lock | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "precast: installing into .venv (once)" >&2
  bash infra/install.sh deps .venv test
  bash infra/install.sh project .venv >/dev/null
  rm -f .venv/.installed-* && touch "$stamp"
fi
# no network on most training nodes: Prefect must not try to send telemetry
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
export PATH="$PWD/.venv/bin:$PATH"
