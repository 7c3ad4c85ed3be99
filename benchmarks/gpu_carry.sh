#!/usr/bin/env bash
# What benchmarks/gpu_check.sh needs on the device tool's GPU machine beyond its own torch,
# torchvision and pytest, in one folder the tool can carry (it reaches no package registry, and a
# run carries 8 paths at most): Hydra, OmegaConf and ANTLR's runtime (expkit's configs), Lightning
# with lightning-utilities, torchmetrics and tqdm (the Lightning twin of part b). All are
# pure Python, so one folder serves the machine's Python whatever its version.
#
#   bash benchmarks/gpu_carry.sh          # -> outputs/gpu_carry (ignored by git; 22 MB)
#   run(command="bash benchmarks/gpu_check.sh --parts a,b,d", carry=["outputs/gpu_carry"], timeout_s=540)
set -euo pipefail
cd "$(dirname "$0")/.."
target=outputs/gpu_carry
rm -rf "$target"
# the versions of constraints.txt where it pins them (Hydra's line, torchmetrics), Lightning's tested one
pins=$(grep -iE '^(hydra-core|omegaconf|antlr4-python3-runtime|torchmetrics|lightning-utilities|tqdm)==' constraints.txt || true)
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --target "$target" \
    $pins lightning==2.6.6 $(for p in hydra-core omegaconf antlr4-python3-runtime torchmetrics lightning-utilities tqdm; do
        grep -qi "^$p==" <<<"$pins" || echo "$p"; done)
rm -rf "$target"/bin
echo "Carry $target ($(du -sh "$target" | cut -f1)): run(..., carry=[\"$target\"])"
