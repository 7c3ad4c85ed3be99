#!/usr/bin/env bash
# The Hydra 1.4 line: .venv-hydra14 takes everything from .venv (scripts/setup.sh runs first)
# but hydra-core 1.4 and omegaconf 2.4 (the newest 1.4/2.4 releases on the index, release
# candidates included), then runs the tests that cover every command on that line.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv-hydra14/bin/python ]; then
    "$PYTHON" -m venv .venv-hydra14
fi
base=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
here=$(.venv-hydra14/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$base" > "$here/expkit_base_venv.pth"   # torch, optuna, launchers...: .venv's, after this venv's own
.venv-hydra14/bin/python -m pip install --quiet --disable-pip-version-check --pre --no-deps \
    'hydra-core>=1.4.0rc3,<1.5' 'omegaconf>=2.4.1rc1,<2.5'
.venv-hydra14/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
.venv-hydra14/bin/python -c "import hydra, omegaconf; print('Hydra', hydra.__version__, 'OmegaConf', omegaconf.__version__)"
export PATH="$PATH:$(pwd)/.venv/bin"   # console scripts (optuna-dashboard) of the packages taken from .venv
exec .venv-hydra14/bin/python -m pytest -p no:cacheprovider "$@" \
    tests/test_hydra_compat.py tests/test_hydra_suites.py tests/test_config.py tests/test_cli.py \
    tests/test_sweep.py tests/test_sweep_resume.py tests/test_optuna.py tests/test_eval.py tests/test_predict.py \
    tests/test_export.py tests/test_trust.py tests/test_examples.py tests/test_kill.py \
    tests/test_ddp.py::test_two_processes_one_run \
    tests/test_fsdp.py::test_fsdp_trains_as_ddp_does_and_its_sharded_checkpoint_resumes_in_one_process_evaluates_and_exports
