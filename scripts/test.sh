#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the whole test suite on two pytest workers (pytest-xdist;
# -n 0 runs it in one process). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n 2 "$@"
