#!/usr/bin/env bash
# The version matrix beyond the pinned environment (docs/compatibility.md). Each line gets its own
# virtual environment, built by uv from pyproject.toml (not constraints.txt), then runs the tests
# that cover every command:
#   lowest   Python 3.10 (pyproject's requires-python), the lowest version of every dependency
#            pyproject declares (uv --resolution lowest-direct): .venv-lowest
#   newest   Python 3.13, the newest release of every dependency on the index, Hydra 1.4 and
#            OmegaConf 2.4 pre-releases included: .venv-newest
# Usage: bash scripts/test_compat.sh lowest|newest [--install-only | pytest arguments]
# (--install-only builds the environment and stops: .ci/run downloads a line while the suite runs)
set -euo pipefail
cd "$(dirname "$0")/.."
line="${1:?usage: scripts/test_compat.sh lowest|newest [--install-only | pytest arguments]}"
shift
if [ ! -x .venv/bin/uv ]; then
    bash scripts/setup.sh all   # .venv brings uv (the dev extra)
fi
case "$line" in
    lowest) python_version=3.10; resolve=(--resolution lowest-direct); extra=(); extras=vision,sweep,logging,metrics,export,dev ;;
    newest) python_version=3.13; resolve=(--resolution highest --upgrade); extra=('hydra-core>=1.4.0rc3')
            extras=vision,sweep,logging,metrics,export,postgres,dev ;;  # (postgres: Optuna 4.0's RDB storage fails there)
    *) echo "scripts/test_compat.sh: unknown line '$line' (lowest or newest)" >&2; exit 2 ;;
esac
# the interpreter: pyenv's (these machines), else one on PATH; uv must not download one
python="$(ls -d "$HOME"/.pyenv/versions/"$python_version".*/bin/python"$python_version" 2>/dev/null | sort -V | tail -1 || true)"
python="${python:-$(command -v "python$python_version" || true)}"
if [ -z "$python" ]; then
    echo "scripts/test_compat.sh: Python $python_version is not installed (pyenv install $python_version)" >&2
    exit 2
fi
venv=".venv-$line"
export UV_PYTHON_DOWNLOADS=never UV_NO_CONFIG=1
if [ ! -x "$venv/bin/python" ]; then
    .venv/bin/uv venv --quiet --python "$python" "$venv"
fi
# uv reads no pip configuration: a machine's pip constraints (a cap on torch) do not apply here
VIRTUAL_ENV="$venv" .venv/bin/uv pip install --quiet "${resolve[@]}" -e ".[$extras]" "${extra[@]}"
"$venv/bin/python" - "$line" <<'EOF'
import importlib.metadata as md, re, sys
names = ("torch", "torchvision", "hydra-core", "omegaconf", "optuna", "torchmetrics", "mlflow", "tensorboard",
         "wandb", "onnx", "onnxruntime", "safetensors", "numpy", "scikit-learn")
print(f"Python {sys.version.split()[0]}: " + ", ".join(f"{n} {md.version(n)}" for n in names))
if sys.argv[1] == "lowest":  # pyproject's lower bounds are the versions this job runs
    def release(v):
        return (tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3]) + (0, 0, 0))[:3]
    off = []
    for requirement in md.requires("expkit"):
        m = re.match(r"([\w.-]+)(?:\[.*\])?>=([\d.]+)", requirement)
        if not m or re.search(r"extra == .(docs|bench|postgres|s3|gcs|s3test|shards|timm|hf|lint|report)", requirement):  # (extras this job does not install)
            continue
        if release(md.version(m.group(1))) != release(m.group(2)):
            off.append(f"{m.group(1)}>={m.group(2)} but {md.version(m.group(1))} is installed")
    if off:
        sys.exit("scripts/test_compat.sh: raise these lower bounds in pyproject.toml to what installs: " + "; ".join(off))
EOF
if [ "${1:-}" = --install-only ]; then
    exit 0
fi
# every command once, on this line: train and resume, eval, predict, export (safetensors, ONNX in
# onnxruntime, torch.export), -m sweeps (basic, joblib, submitit_local), Optuna (in slots, two workers,
# on the newest line a PostgreSQL study), sweep resume, a kill and its resume, a user's
# --config-dir project, trust, the backends, torchmetrics, DDP and FSDP2 under torchrun; the compat
# checks and Hydra's own sweeper suites in full
tests=(
    tests/config/test_hydra_compat.py tests/sweeps/test_hydra_suites.py tests/config/test_config.py
    tests/commands/test_cli.py::test_resume_true_continues_the_run_in_its_work_dir
    tests/commands/test_eval.py::test_evaluating_the_best_checkpoint_gives_back_the_logged_test_metrics
    tests/commands/test_eval.py::test_load_model_equals_the_final_model_of_training
    tests/commands/test_predict.py::test_predict_digits_from_npy_and_pt_gives_the_models_classes_and_top_k
    tests/commands/test_export.py::test_safetensors_hold_the_checkpoint_weights_and_the_ema_ones
    tests/commands/test_export.py::test_onnx_runs_in_onnxruntime_with_any_batch_and_matches_torch
    tests/commands/test_export.py::test_torch_export_program_loads_and_runs_with_any_batch
    tests/sweeps/test_sweep.py::test_grid_with_joblib_and_two_workers tests/sweeps/test_sweep.py::test_submitit_local
    tests/sweeps/test_optuna.py::test_two_joblib_workers_share_one_sqlite_study
    "tests/sweeps/test_search_slots.py::test_a_short_trial_starts_as_soon_as_a_slot_frees_not_after_the_slowest[joblib]"
    "tests/sweeps/test_search_slots.py::test_the_same_search_started_twice_shares_one_study_and_one_sweep_dir[journal]"
    tests/sweeps/test_sweep_resume.py::test_reordered_and_added_values_mix_nothing_up
    tests/checkpoint/test_kill.py::test_sigkill_mid_epoch_then_resume_is_bit_identical
    tests/house/test_examples.py::test_user_project_experiment_with_its_own_hook_model_and_data
    tests/core/test_trust.py::test_load_model_refuses_every_untrusted_target_before_it_runs
    tests/loggers/test_backends.py::test_tensorboard_scalars_match_metrics_jsonl
    tests/loggers/test_backends.py::test_wandb_offline_run_holds_config_history_name_and_summary
    tests/loggers/test_mlflow.py::test_a_run_logs_params_metrics_status_and_artifacts_equal_to_its_own_records
    tests/engine/test_metrics.py::test_a_torchmetrics_metric_is_logged_as_a_float_everywhere
    tests/distributed/test_ddp.py::test_two_processes_one_run
    tests/distributed/test_fsdp.py::test_fsdp_trains_as_ddp_does_and_its_sharded_checkpoint_resumes_in_one_process_evaluates_and_exports
)
if [ "$line" = newest ]; then  # a study in PostgreSQL (a server of the test's own), through psycopg
    tests+=(tests/sweeps/test_search_slots.py::test_bad_storages_and_a_second_search_on_one_study_stop_before_training)
fi
# uv installs no compiled modules: the first process to import one writes it, the others read it
# (with PYTHONDONTWRITEBYTECODE set, every process would compile torch again: 6 s of CPU, not 2.5 s)
unset PYTHONDONTWRITEBYTECODE
exec "$venv/bin/python" -m pytest -p no:cacheprovider -n 2 --dist worksteal "$@" "${tests[@]}"
