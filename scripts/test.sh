#!/usr/bin/env bash
# Set up (scripts/setup.sh, scripts/setup_postgres.sh, scripts/setup_slurm.sh install, scripts/setup_browser.sh),
# then run the whole test suite on two pytest workers (pytest-xdist; -n 0 runs it in one process). Extra arguments
# go to pytest. Run as root, it installs Debian's postgresql package, Slurm's (slurm-wlm, slurmdbd, munge,
# mariadb-server) and Chromium's (chromium, chromium-driver; apt-get) when their programs are missing; as another
# user, the PostgreSQL, Slurm and browser tests skip instead. The Slurm tests start their own one-node cluster on
# this machine (tests/cluster/slurm_fixture.py) and stop it at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh all   # (every extra: the tests use them all)
bash scripts/setup_postgres.sh   # (the server programs for the PostgreSQL tests; apt-get as root)
bash scripts/setup_slurm.sh install   # (Slurm 22.05 and slurmdbd for the Slurm tests; apt-get as root)
bash scripts/setup_browser.sh   # (Chromium and chromedriver for the browser test of report.html; apt-get as root)
# Every test starts Python processes (expkit.train, torchrun, sweeps): they read compiled modules from
# __pycache__ as on a user's machine. With PYTHONDONTWRITEBYTECODE set (some CI images and sandboxes
# set it) each process would compile expkit's modules again.
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -n 2 --dist worksteal "$@"
