#!/usr/bin/env bash
# Create .venv and install expkit (editable) with the pinned, tested versions in constraints.txt.
# Usage: bash scripts/setup.sh [all]
#   (no argument)  what the README's runs need: training, sweeps and Optuna, Slurm through submitit,
#                  TensorBoard/wandb/MLflow, torchmetrics, export (ONNX, safetensors), tar shards
#   all            everything the tests need besides: Hugging Face, timm, S3 (and a local S3 API),
#                  PostgreSQL's driver, the docs, the linters, pytest (scripts/test.sh runs this)
# Safe to re-run: an up-to-date environment is not touched (an `all` environment serves both).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
run_extras="vision,sweep,logging,metrics,export,shards,report"
case "${1:-run}" in
    run) set_name=run; extras="$run_extras" ;;
    all) set_name=all; extras="$run_extras,postgres,s3,s3test,timm,hf,dev,lint,docs" ;;
    *) echo "scripts/setup.sh: unknown set '$1' (none for the runs, or all for the tests too)" >&2; exit 2 ;;
esac
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# pip runs again only when what it installs from changed (a stamp in .venv: the set, then a hash): a
# second call is instant, and .ci/run can build a version line's environment beside it while the suite runs
hash="$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)"
stamp="$(cat .venv/.expkit-setup 2>/dev/null || true)"
if [ "$stamp" = "all $hash" ] || [ "$stamp" = "$set_name $hash" ]; then
    exit 0
fi
# what is installed and what it costs, said before pip's silence (measured on 2 cores, 2026-11-28)
if [ "$set_name" = run ]; then
    echo "Setting up .venv: expkit, torch 2.14.1 + torchvision 0.29.1 (a CUDA build: most of the ~6 GB) and" \
         "the extras $extras. The first time takes 2 to 6 minutes; \`bash scripts/setup.sh all\` adds what the tests use."
else
    echo "Setting up .venv for the tests: expkit with every extra ($extras), about 7 GB." \
         "The first time takes 2 to 7 minutes."
fi
# torch 2.14.1 + torchvision 0.29.1 are pinned together: other pairs fail to import torchvision here
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[$extras]"
echo "$set_name $hash" > .venv/.expkit-setup
echo "Set up: .venv ($(du -sh .venv 2>/dev/null | cut -f1))."
