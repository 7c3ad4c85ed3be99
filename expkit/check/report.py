"""The check's report: its table (a row per comparison), the findings that explain what differs,
the text printed, and the machine-readable ``check.out``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from expkit.check.planning import Plan
    from expkit.check.training_runs import Run

__all__ = ["Comparison", "Finding", "Row", "json_report", "render", "summary"]


@dataclass
class Finding:
    """A difference the check explains: what breaks reproducibility or resuming, and the fix.

    Args:
        check: the check (row) it belongs to.
        message: the explanation, naming the piece at fault and what to change.
    """

    check: str
    message: str


@dataclass
class Row:
    """One row of the check's table.

    Args:
        check: what is compared.
        result: ``ok``, ``differs``, ``skipped`` or ``info``.
        detail: the first difference, or what was compared.
    """

    check: str
    result: str
    detail: str = ""


@dataclass
class Comparison:
    """The check's table and findings.

    Args:
        rows: the table's rows, in order.
        findings: the differences explained.
    """

    rows: list[Row] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    def add(self, check: str, problems: list[str], ok_detail: str = "") -> None:
        """Add a row: ``differs`` with the first problem as its detail, else ``ok``.

        Args:
            check: what is compared.
            problems: the differences found; empty when none.
            ok_detail: the detail of an ``ok`` row.
        """
        self.rows.append(Row(check, "differs" if problems else "ok", problems[0] if problems else ok_detail))

    def explain(self, check: str, message: str) -> None:
        """Add a finding.

        Args:
            check: the row it belongs to.
            message: what breaks it and what to change.
        """
        self.findings.append(Finding(check, message))

    def differs(self, prefix: str) -> bool:
        """Whether a row whose check starts with `prefix` differs.

        Args:
            prefix: the start of the rows' ``check``, e.g. ``same seed``.

        Returns:
            True when one of them differs.
        """
        return any(r.result == "differs" for r in self.rows if r.check.startswith(prefix))

    @property
    def ok(self) -> bool:
        """Whether everything matched: no finding and no row that differs."""
        return not self.findings and all(r.result != "differs" for r in self.rows)


def render(rows: list[Row], findings: list[Finding]) -> str:
    """The check's report as text: the table, then the findings under "What breaks it:".

    Args:
        rows: the table's rows (at least one).
        findings: the findings; none adds no section.

    Returns:
        The report's lines, joined.
    """
    width = max(len(r.check) for r in rows)
    lines = [f"{'check':<{width}}  {'result':<8}  detail", f"{'-' * width}  {'-' * 8}  {'-' * 6}"]
    lines += [f"{r.check:<{width}}  {r.result:<8}  {r.detail}" for r in rows]
    if findings:
        lines += ["", "What breaks it:"]
        lines += [f"  - {f.message}" for f in findings]
    return "\n".join(lines)


def summary(ok: bool, plan: Plan, seconds: float, runs: dict[str, Run], kept_in: Path | None) -> str:
    """The line printed under the table.

    Args:
        ok: whether everything matched.
        plan: the plan.
        seconds: the check's wall time, in seconds.
        runs: the runs, trained.
        kept_in: the scratch dir when ``check.keep=true``, else None.

    Returns:
        The line, with a blank line before it.
    """
    training = sum(r.seconds for r in runs.values())
    verdict = "OK: reproducible and resumes exactly" if ok else "DIFFERS"
    kept = f"; runs kept in {kept_in}" if kept_in is not None else ""
    return f"\n{verdict} ({plan.budget} iterations a run; {seconds:.1f} s in all, {training:.1f} s in the runs){kept}"


def json_report(
    result: Comparison, plan: Plan, seconds: float, runs: dict[str, Run], kept_in: Path | None
) -> dict[str, Any]:
    """The machine-readable report (``check.out``).

    Args:
        result: the table and findings.
        plan: the plan.
        seconds: the check's wall time, in seconds.
        runs: the runs, trained.
        kept_in: the scratch dir when ``check.keep=true``, else None.

    Returns:
        The report, JSON-ready.
    """
    return {
        "ok": result.ok,
        "budget": plan.budget,
        "kill_at": plan.kill_at,
        "steps_per_epoch": plan.steps_per_epoch,
        "seconds": round(seconds, 2),
        "run_seconds": {r.name: round(r.seconds, 2) for r in runs.values()},
        "rows": [vars(r) for r in result.rows],
        "findings": [vars(f) for f in result.findings],
        "scratch": str(kept_in) if kept_in is not None else None,
    }
