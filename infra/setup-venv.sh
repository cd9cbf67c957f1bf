#!/usr/bin/env bash
# Create .venv and install precast into it; a no-op when pyproject.toml is unchanged since the last
# install. Sourced by infra/demo.sh and infra/test.sh; needs only python3 (3.10+).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
stamp=".venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  pip_install() {  # pip's exit status, minus its warnings about unusable index locations
    .venv/bin/python -m pip install --quiet "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  }
  echo "precast: installing into .venv (once)" >&2
  pip_install --upgrade pip
  # torch first and exactly pinned: an unpinned torch would pull several GB of CUDA wheels
  pip_install "torch==2.13.0"
  pip_install -e ".[test]"
  rm -f .venv/.installed-* && touch "$stamp"
fi
# no network on most training nodes: Prefect must not try to send telemetry
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
export PATH="$PWD/.venv/bin:$PATH"
