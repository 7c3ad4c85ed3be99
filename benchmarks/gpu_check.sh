#!/usr/bin/env bash
# benchmarks/gpu_check.py on a machine where nothing of expkit is installed: the device tool's GPU
# machine, which has torch, torchvision and pytest in its python3 but not Hydra, OmegaConf or
# ANTLR's runtime, and reaches no package registry. It installs nothing: it runs the repo's
# expkit from the working tree (PYTHONPATH) and finds those three pure-Python packages in the
# folders the device tool carried from this checkout's .venv:
#
#   bash benchmarks/gpu_carry.sh   # here, first: Hydra, OmegaConf, antlr4 and Lightning in outputs/gpu_carry
#   run(command="bash benchmarks/gpu_check.sh --parts a,b,d", timeout_s=540, carry=["outputs/gpu_carry"])
#
# (or, without Lightning's side of part b, the three folders from .venv as before:
#   carry=[".venv/lib/python3.11/site-packages/hydra", ".../omegaconf", ".../antlr4"])
#
# Where .venv/bin/python works (this machine), it uses that. Arguments go to gpu_check.py
# (--dry, --parts b,e, ...). Writes gpu_check.json, gpu_check.log (this output) and
# gpu_check_parts.log (the parts' own output) under $OUT (the device tool sets it), else under
# outputs/gpu_check/ (ignored by git).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
repo=$PWD
out=${OUT:-$repo/outputs/gpu_check}
for arg in "$@"; do
    case "$arg" in
        --out | --out=*) echo "gpu_check.sh: set OUT=<dir> instead of --out (the log goes there too)" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1

if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, hydra" 2>/dev/null; then
    python=.venv/bin/python
else
    python=${PYTHON:-python3}
    carried=""
    for dir in "$repo"/outputs/gpu_carry "$repo"/.venv/lib/python3*/site-packages; do
        [ -d "$dir" ] && carried="$carried:$dir"
    done
    export PYTHONPATH="$repo$carried${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$python" -c "import torch, torchvision, hydra, omegaconf, pytest" 2>"$out/gpu_check.log"; then
    {
        echo "gpu_check.sh: $python cannot import what the check needs (PYTHONPATH=${PYTHONPATH:-}):"
        cat "$out/gpu_check.log"
        echo "Carry outputs/gpu_carry (bash benchmarks/gpu_carry.sh) or Hydra, OmegaConf and antlr4 from .venv (see the top of benchmarks/gpu_check.sh)."
    } >&2
    exit 2
fi
"$python" benchmarks/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
