#!/usr/bin/env bash
# Command 1 of the README: install, then run the embedded default (tiny dummy-weight model on
# synthetic data: a short Offline performance run and an accuracy-mode run) and print where the
# results are.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv
.venv/bin/python -m sut demo --output-dir results/demo
