#!/usr/bin/env bash
# Set up (scripts/setup.sh, scripts/setup_postgres.sh), then run the whole test suite on two pytest workers (pytest-xdist;
# -n 0 runs it in one process). Extra arguments go to pytest. Run as root, it installs Debian's postgresql package
# (apt-get) when its server programs are missing; as another user, the PostgreSQL tests skip instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_postgres.sh   # (the server programs for the PostgreSQL tests; apt-get as root)
# Every test starts Python processes (expkit.train, torchrun, sweeps): they read compiled modules from
# __pycache__ as on a user's machine. With PYTHONDONTWRITEBYTECODE set (some CI images and sandboxes
# set it) each process would compile expkit's modules again.
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -n 2 --dist worksteal "$@"
