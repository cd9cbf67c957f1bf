#!/usr/bin/env bash
# Install precast with its tested dependency set into a virtual environment. The one install path:
# the developer setup and CI (infra/setup-venv.sh) and the worker image (infra/Dockerfile) run it.
#
#   bash infra/install.sh deps VENV [test]   # every locked dependency (+ the test tools); needs only
#                                            # infra/install.sh and infra/requirements*.lock
#   bash infra/install.sh project VENV       # precast itself from this folder, editable, no resolve;
#                                            # then pip check: nothing may be missing or mismatched
#
# The locks pin every package, transitive ones included; infra/lock.sh refreshes them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
phase=${1:?usage: install.sh deps|project VENV [test]} venv=${2:?usage: install.sh deps|project VENV [test]}
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
pip_install() {  # pip's exit status, minus its warnings about unusable index locations
  "$venv/bin/python" -m pip install --quiet "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  return "${PIPESTATUS[0]}"
}
case "$phase" in
  deps)
    locks=(-r infra/requirements.lock)
    [ "${3:-}" = test ] && locks+=(-r infra/requirements-test.lock)
    # the installer and the build backend first, at their locked versions
    pip_install $(grep -E '^(pip|setuptools|wheel)==' infra/requirements.lock)
    # torch is pinned like everything else; on Linux x86-64 the registry's torch wheel is the CUDA
    # build (its nvidia-* libraries come pinned by torch itself), a CPU-only machine's local wheel
    # of the same version is the CPU build
    pip_install "${locks[@]}"
    ;;
  project)
    pip_install --no-deps --no-build-isolation -e .
    "$venv/bin/python" -m pip check
    ;;
  *) echo "install.sh: unknown phase '$phase' (deps or project)" >&2; exit 2 ;;
esac
