"""How an Optuna trial ended, told to the study (its jobs' values, their mean over seeds; pruned,
failed, or left running to resume), and the study's results file."""

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from expkit.sweeps.search import UNREACHABLE, StorageUnreachable, objective_values, with_storage
from hydra_plugins.expkit_sweeper._optuna_ledger import Ledger
from hydra_plugins.expkit_sweeper._optuna_settings import SearchConfigError

__all__ = ["TrialResults"]


log = logging.getLogger("expkit")


class TrialResults:
    """The results part of ``OptunaSweeper``: each trial told to the study as it ends, and
    ``optimization_results.yaml`` at the end."""

    study_name: str
    storage_wait_s: float
    objectives: list[str] | None
    exhausted: bool

    def _tell(self, study: Any, ledger: Ledger, trial: Any, rets: Sequence[Any]) -> None:
        """The trial's value: its job's (with several seeds, their mean, once every seed finished);
        pruned if a seed was pruned; left running if a seed was interrupted (resume=true)."""
        from hydra.core.utils import JobStatus
        from optuna.trial import TrialState

        from expkit.sweeps.sweep_jobs import finished, job_result

        ends: list[tuple[dict[str, Any], Any]] = []
        for ret in rets:
            output_dir = OmegaConf.select(ret.hydra_cfg, "hydra.runtime.output_dir") if ret.hydra_cfg else None
            result = (job_result(Path(output_dir)) if output_dir else None) or {}
            if self.objectives is not None:  # several objectives: each read from result.json
                values = objective_values(result, self.objectives)
                usable = ret.status == JobStatus.COMPLETED and finished(result) and None not in values
                ends.append((result, values if usable else None))
                continue
            monitor = result.get("monitor")
            best = (result.get("best_metrics") or {}).get(monitor or "", {}).get("value")
            value = ret.return_value if ret.status == JobStatus.COMPLETED else None
            usable = finished(result) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in (best, value))
            ends.append((result, value if usable else None))
            rule = result.get("monitor_rule")
            if rule in ("greater", "less") and rule != ("greater" if study.direction.name == "MAXIMIZE" else "less"):
                raise SearchConfigError(
                    f"the study {study.direction.name.lower()}s, but {monitor} is better when "
                    f"{rule} (the run's rule); set hydra.sweeper.direction"
                )
        statuses = [r.get("status") for r, _ in ends]
        if any(r.get("status") == "stopped" and not finished(r) for r, _ in ends):
            ledger.finish(trial, "interrupted")  # preempted: left running in the study, for resume=true
            outage = next(
                (str(r["stop_reason"]) for r, _ in ends if str(r.get("stop_reason")).startswith(UNREACHABLE)), None
            )
            if outage is not None:  # (the job waited for the storage already: so does this worker)
                raise StorageUnreachable(outage.removeprefix(f"{UNREACHABLE}: "))
            return
        number = trial.number
        if "pruned" in statuses:
            tell = lambda: study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)
            status = "pruned"
        elif all(v is not None for _, v in ends):
            if self.objectives is not None:  # each objective's mean over the seeds
                told: Any = [math.fsum(v[i] for _, v in ends) / len(ends) for i in range(len(self.objectives))]  # type: ignore[index]
            else:
                told = math.fsum(v for _, v in ends) / len(ends)  # type: ignore[misc]
            tell = lambda: study.tell(trial, told, skip_if_finished=True)
            status = "completed" if len(set(statuses)) > 1 else str(statuses[0])
        else:  # failed, diverged (no finite best), or never ran
            tell = lambda: study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            status = next((s for s in statuses if s not in (None, "completed", "stopped")), "failed")
        # (an outage past the wait leaves the trial running in the study and in the ledger: the job's
        # result is on disk, and resume=true tells it)
        try:
            with_storage(f"telling trial {number} how it ended ({status})", tell, self.storage_wait_s)
        except RuntimeError as exc:
            if "Study.stop" not in str(exc):
                raise
            # GridSampler stops the study once every point of its grid is asked for (it calls
            # study.stop(), which only an optimize() loop takes): the trial was told all the same
            # (Optuna stores it in a finally), and no new trial is asked for
            log.info("Optuna: the grid is gone through; no new trial is asked for")
            self.exhausted = True
        ledger.finish(trial, status)

    def _write_results(self, study: Any, sweep_dir: Path) -> None:
        """optimization_results.yaml, as hydra-optuna-sweeper wrote it: the study's best trial (its
        best trials, the Pareto front, for several objectives)."""
        if len(study.directions) > 1:
            front = study.best_trials
            results = {
                "name": "optuna",
                "study_name": self.study_name,
                "objectives": self.objectives,
                "solutions": [{"number": t.number, "params": dict(t.params), "values": t.values} for t in front],
            }
            OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
            log.info("Optuna Pareto front: trials %s", ", ".join(str(t.number) for t in front) or "none")
            return
        try:
            best = study.best_trial
        except ValueError:  # no trial completed
            log.warning("Optuna study %s has no completed trial", self.study_name)
            return
        results = {
            "name": "optuna",
            "study_name": self.study_name,
            "best_trial": best.number,
            "best_params": dict(best.params),
            "best_value": best.value,
        }
        OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
        log.info("Optuna best: trial %d, value %.4f, %s", best.number, best.value, best.params)
