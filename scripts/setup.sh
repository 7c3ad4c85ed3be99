#!/usr/bin/env bash
# Create .venv and install expkit (editable) with the pinned, tested versions in constraints.txt.
# Safe to re-run: an up-to-date environment is not touched.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# pip runs again only when what it installs from changed (a stamp in .venv): a second call is instant,
# and .ci/run can build a version line's environment beside it while the suite runs
stamp="$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ "$(cat .venv/.expkit-setup 2>/dev/null)" = "$stamp" ]; then
    exit 0
fi
# torch 2.14.1 + torchvision 0.29.1 are pinned together: other pairs fail to import torchvision here
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[vision,sweep,logging,metrics,export,postgres,s3,s3test,shards,timm,hf,dev,lint,docs]"
echo "$stamp" > .venv/.expkit-setup
