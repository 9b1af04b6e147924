#!/usr/bin/env bash
# Install (idempotent) and run the test suite. pytest's exit code 5 ("no tests collected") is a
# failure here: a green run must have executed tests.
#   bash scripts/test.sh            the full suite (what .ci/run calls)
#   bash scripts/test.sh --fast     everything but the tests marked slow (Flower simulations and
#                                   deployments, mypy, import-linter on copies, end-to-end benches)
# Further arguments go to pytest. Every run ends with its 25 slowest tests (--durations), and a test
# running past pyproject.toml's pytest timeout fails. Tests run in FEDMJP_TEST_WORKERS processes
# (pytest-xdist, default 2: the CI machine's cores; 0 runs them in this process), each test module
# on one worker so that its module-scoped fixtures are built once.
set -uo pipefail
marker=()
if [ "${1:-}" = "--fast" ]; then
    shift
    marker=(-m "not slow")
fi
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
python3 -m pytest -q --durations=25 -n "${FEDMJP_TEST_WORKERS:-2}" --dist loadscope "${marker[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "no tests were collected: failing" >&2; exit 1; fi
exit "$rc"
