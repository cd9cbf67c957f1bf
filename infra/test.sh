#!/usr/bin/env bash
# Set everything up, then run the whole test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup-venv.sh"
python -m pytest "$@"
