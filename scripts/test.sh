#!/usr/bin/env bash
# Command 2 of the README (and .ci/run): install if needed, then run the default test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow` for the slow tests.
# The 15 slowest tests are listed at the end (the default suite must stay under 15 min on 2 cores).
# pytest's exit code 5 ("no tests collected") is turned into a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv || exit 1
.venv/bin/python -m pytest -p no:cacheprovider --durations=15 "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi
exit $rc
