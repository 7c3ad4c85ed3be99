#!/usr/bin/env bash
# Create .venv and install expkit (editable) with the pinned, tested versions in constraints.txt.
# Safe to re-run: an up-to-date environment takes a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# torch 2.14.1 + torchvision 0.29.1 are pinned together: other pairs fail to import torchvision here
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[vision,sweep,logging,metrics,export,postgres,s3,s3test,timm,hf,dev,docs]"
