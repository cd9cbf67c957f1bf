#!/usr/bin/env bash
# Set everything up, then run the whole test suite: two pytest processes (PRECAST_TEST_PROCESSES),
# each taking whole test files, so a module's fixtures (the cluster stack, the learned world) are
# built once. Much of the suite waits on servers, workers and child processes; two at once fill
# two cores. Plain `python -m pytest` runs it in one process.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup-venv.sh"
python -m pytest --numprocesses "${PRECAST_TEST_PROCESSES:-2}" --dist loadfile --no-loadscope-reorder "$@"
