#!/usr/bin/env bash
# Set everything up, then run the demo: tiny models + generated data through all five stages.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup-venv.sh"
precast demo "$@"
