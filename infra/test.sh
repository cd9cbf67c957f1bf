#!/usr/bin/env bash
# Set everything up, then run the whole test suite: two pytest processes (PRECAST_TEST_PROCESSES),
# each taking whole test files, so a module's fixtures (the cluster stack, the learned world) are
# built once. Much of the suite waits on servers, workers and child processes; two at once fill
# two cores. Plain `python -m pytest` runs it in one process. Each process (and what it starts)
# computes on its share of the cores: two trainings of two torch threads each on two cores spin
# against each other (OpenMP) and took four times as long as one after the other. The 25 slowest
# tests are listed at the end: the suite must stay under 15 minutes on 2 cores.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup-venv.sh"
processes="${PRECAST_TEST_PROCESSES:-2}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) > processes ? $(nproc) / processes : 1 ))}"
python -m pytest --numprocesses "$processes" --dist loadfile --no-loadscope-reorder --durations 25 "$@"
