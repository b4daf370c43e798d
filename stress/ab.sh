#!/usr/bin/env bash
# A/B of two revisions, alternated runs, medians and ratios: see stress/ab.py.
#   stress/ab.sh REV_A REV_B [--pairs 3] [--what bench|flights|consume|publish|spark-writer|tier] [--whole-tree] [-- ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python stress/ab.py "$@"
