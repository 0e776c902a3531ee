#!/usr/bin/env bash
# Command 1 of the README: install, then run the embedded default (tiny dummy-weight model on
# 64 synthetic samples: a short Offline performance run, an accuracy-mode run scored by the gate
# and a TEST06 run, all with the same settings) and print where the results are, the command that
# re-scores the accuracy run and the `python -m sut package --allow-noncompliant ...` command that
# lays the three runs out. Each run of this script writes to its own results/demo/<date-time>/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv
.venv/bin/python -m sut demo --output-dir results/demo
